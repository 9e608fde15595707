"""The prompt cache: the KV caches of earlier calls, kept so that a prompt that starts with the same
tokens as one of them skips that prefix's prefill.

An entry is the tokens a call's caches have seen (prompt and generated ids) and those caches. A new
prompt restores the entry with the longest exact common prefix, as a copy cut to that prefix
(`Cache.prefix(n)`: arrays are shared, and an update of the copy writes new arrays, so entries are
never changed), and only the rest of the prompt is prefilled. A rotating cache can give back an
earlier state only when it still holds it and that state does not depend on how the tokens were
chunked (see `RotatingKVCache.prefix`); otherwise the lookup is a miss. The cache is bounded in
entries and bytes; the least recently used entries go first.

Entries are only valid for the weights that made them: `check_weights` drops them all when the
model's parameter arrays are no longer the same objects (an adapter attached, fused or trained).

`save_entries`/`load_entries` write and read a safetensors file whose metadata names the model
(`model_identity`: model_type and a fingerprint of config, weight names, shapes, dtypes and a
sample of values) and each entry's token ids; a file made by another model is refused.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

import pymlxc.core as mx
from pymlxc.core import Array
from pymlxc.files import write_replacing
from pymlxc.safetensors_check import checked_load

from .cache import KVCache, RotatingKVCache
from .recurrent_cache import KIND as RECURRENT
from .recurrent_cache import RecurrentCache, RecurrentCacheError

FORMAT = "pymlxc-prompt-cache"
FORMAT_VERSION = "1"
DEFAULT_ENTRIES = 8
DEFAULT_BYTES = 2 << 30
_SAMPLE = 8  # values of each weight that go into the fingerprint


class PromptCacheError(ValueError):
    """A prompt cache file that cannot be used here: another model, another cache layout, or damaged."""


@runtime_checkable
class PrefixCache(Protocol):
    """What the prompt cache needs of a layer cache (KVCache and RotatingKVCache have it)."""

    offset: int

    def prefix(self, n: int) -> Any: ...

    @property
    def state(self) -> tuple[Array, ...]: ...


def restore(caches: Sequence[Any], n: int) -> list[Any] | None:
    """Copies of `caches` in their state after `n` tokens, or None when one of them cannot give it."""
    out = []
    for c in caches:
        restored = c.prefix(n) if isinstance(c, PrefixCache) else None
        if restored is None:
            return None
        out.append(restored)
    return out


def restorable(caches: Sequence[Any], n: int) -> int:
    """The longest prefix of at most `n` tokens that every cache can give back: a recurrent cache
    only where it kept its state (RecurrentCache.restorable), any other at any length."""
    for c in caches:
        if isinstance(c, RecurrentCache):
            n = min(n, c.restorable(n))
    return n


def consistent_offset(caches: Sequence[Any]) -> int | None:
    """The number of tokens every cache has seen, or None when they disagree (an update failed
    half-way) or a cache is of a kind the prompt cache cannot restore."""
    offsets = {c.offset for c in caches if isinstance(c, PrefixCache)}
    if len(offsets) != 1 or not all(isinstance(c, PrefixCache) for c in caches):
        return None
    return offsets.pop()


def _nbytes(caches: Iterable[Any]) -> int:
    seen: dict[int, int] = {}
    for c in caches:
        for a in c.state:
            seen[id(a)] = a.nbytes
    return sum(seen.values())


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    m = min(len(a), len(b))
    differ = np.flatnonzero(a[:m] != b[:m])
    return int(differ[0]) if len(differ) else m


@dataclass
class Entry:
    tokens: np.ndarray  # int32 [n]: what the caches have seen, in order
    caches: list[Any]
    nbytes: int


@dataclass
class CacheUse:
    """What one call got from the prompt cache (for GenerateMetrics)."""

    hits: int = 0
    misses: int = 0
    hit_tokens: int = 0
    restore_duration: float = 0.0


class PromptCache:
    """Exact token-prefix reuse, bounded by `max_entries` and `max_bytes` (0 entries: off). Thread-safe."""

    def __init__(self, max_entries: int = DEFAULT_ENTRIES, max_bytes: int = DEFAULT_BYTES) -> None:
        self._lock = threading.Lock()
        self._entries: OrderedDict[int, Entry] = OrderedDict()  # least recently used first
        self._next = 0
        self._weights: list[weakref.ref[Array]] = []
        self.resize(max_entries, max_bytes)

    # ------------------------------------------------------------------ size
    def resize(self, max_entries: int, max_bytes: int) -> None:
        if max_entries < 0 or max_bytes < 0:
            raise ValueError(f"prompt cache bounds must be >= 0, not {max_entries} entries, {max_bytes} bytes")
        with self._lock:
            self.max_entries, self.max_bytes = max_entries, max_bytes
            self._evict()

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0 and self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(e.nbytes for e in self._entries.values())

    def entries(self) -> list[tuple[int, int]]:
        """(tokens, bytes) of each entry, least recently used first."""
        with self._lock:
            return [(len(e.tokens), e.nbytes) for e in self._entries.values()]

    def snapshot(self) -> list[Entry]:
        with self._lock:
            return list(self._entries.values())

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def check_weights(self, params: Iterable[Array]) -> None:
        """Drop every entry when the weights changed since the last call (other arrays, or more or
        fewer of them): caches made with other weights would give other results."""
        params = list(params)
        with self._lock:
            same = len(params) == len(self._weights) and all(
                r() is p for r, p in zip(self._weights, params, strict=True))
            if not same:
                self._entries.clear()
                self._weights = [weakref.ref(p) for p in params]

    # ------------------------------------------------------------------ use
    def lookup(self, prompt: Sequence[int], limit: int) -> tuple[list[Any], int] | None:
        """Caches holding the longest stored prefix of `prompt` (at most `limit` tokens), as copies,
        and its length; None on a miss."""
        if limit <= 0 or not self.enabled:
            return None
        wanted = np.asarray(prompt[:limit], dtype=np.int64)
        with self._lock:
            # Longest first; among equals the most recently used (later in the order).
            candidates = sorted(((restorable(e.caches, _common_prefix(e.tokens, wanted)), rank, key)
                                 for rank, (key, e) in enumerate(self._entries.items())), reverse=True)
            for n, _, key in candidates:
                if n == 0:
                    break
                restored = restore(self._entries[key].caches, n)
                if restored is not None:
                    self._entries.move_to_end(key)
                    return restored, n
        return None

    def store(self, tokens: Sequence[int], caches: Sequence[Any]) -> bool:
        """Keep `caches`, which have seen exactly `tokens` (the caller gives up the caches), if they
        can be restored at their full length. An entry that the new one can stand in for (its tokens
        are a prefix of the new ones and the new caches restore to its length) is dropped; a new entry
        that an old one can stand in for is not kept. False when nothing was kept."""
        if not self.enabled or not tokens or consistent_offset(caches) != len(tokens):
            return False
        if restore(caches, len(tokens)) is None:  # e.g. past a context bound with sinks: no use later
            return False
        entry = Entry(np.asarray(tokens, dtype=np.int32), list(caches), _nbytes(caches))
        if entry.nbytes > self.max_bytes:
            return False
        with self._lock:
            common = {key: _common_prefix(old.tokens, entry.tokens) for key, old in self._entries.items()}
            # Whether an old entry holds this one already is settled before any is dropped: a
            # rotating cache may stand in for a shorter entry that an old one cannot, and dropping
            # that entry and then not keeping this one would lose its prefix.
            for key, n in common.items():
                if n == len(entry.tokens) and restore(self._entries[key].caches, n) is not None:
                    self._entries.move_to_end(key)
                    return False
            for key, n in common.items():
                if n == len(self._entries[key].tokens) and restore(entry.caches, n) is not None:
                    del self._entries[key]
            self._entries[self._next] = entry
            self._next += 1
            self._evict()
            return True

    def _evict(self) -> None:
        total = sum(e.nbytes for e in self._entries.values())
        while self._entries and (len(self._entries) > self.max_entries or total > self.max_bytes):
            _, gone = self._entries.popitem(last=False)
            total -= gone.nbytes


def timed_lookup(cache: PromptCache, prompt: Sequence[int], limit: int) -> tuple[list[Any] | None, int, CacheUse]:
    """`cache.lookup` with what it gave, for the metrics: (caches or None, tokens restored, use)."""
    start = time.perf_counter()
    found = cache.lookup(prompt, limit)
    use = CacheUse(restore_duration=time.perf_counter() - start)
    if found is None:
        use.misses = 1
        return None, 0, use
    use.hits, use.hit_tokens = 1, found[1]
    return found[0], found[1], use


# ---------------------------------------------------------------------- identity

def _dtype_name(a: Array) -> str:
    return str(a.dtype).rsplit(".", 1)[-1]


def model_identity(model: Any, model_type: str) -> dict[str, str]:
    """model_type and a fingerprint of the model: its config, every weight's name, shape and dtype,
    and the first values of each weight (so that two checkpoints of one architecture differ)."""
    params = model.parameters()
    names = sorted(params)
    samples = [mx.astype(mx.reshape(params[n], (-1,))[:_SAMPLE], mx.float32) for n in names]
    mx.eval(samples)
    args = getattr(model, "args", None)
    config = dataclasses.asdict(args) if dataclasses.is_dataclass(args) and not isinstance(args, type) else {}
    digest = hashlib.sha256()
    digest.update(json.dumps({"model_type": model_type, "config": config}, sort_keys=True, default=str).encode())
    for name, sample in zip(names, samples, strict=True):
        a = params[name]
        digest.update(f"{name}:{tuple(a.shape)}:{_dtype_name(a)}:".encode())
        digest.update(np.asarray(sample, dtype=np.float32).tobytes())
    return {"model_type": model_type, "fingerprint": digest.hexdigest()}


# ---------------------------------------------------------------------- files

def _layout(cache: Any) -> dict[str, Any]:
    if isinstance(cache, RecurrentCache):
        return {"kind": RECURRENT}
    if isinstance(cache, RotatingKVCache):
        return {"kind": "RotatingKVCache", "max_size": cache.max_size, "keep": cache.keep}
    if isinstance(cache, KVCache):
        return {"kind": "KVCache"}
    raise PromptCacheError(f"a {type(cache).__name__} cannot be saved in a prompt cache file")


def _arrays(cache: Any) -> tuple[Array, Array]:
    keys, values = cache.state
    if isinstance(cache, KVCache) and keys.shape[2] > cache.offset:  # drop the unused capacity
        keys, values = (mx.slice(v, [0, 0, 0, 0], [v.shape[0], v.shape[1], cache.offset, v.shape[3]], [1, 1, 1, 1])
                        for v in (keys, values))
    return keys, values


def save_entries(path: str | os.PathLike[str], entries: Sequence[Entry], identity: dict[str, str]) -> int:
    """Write `entries` to a safetensors file at `path`; returns how many were written."""
    arrays: dict[str, Array] = {}
    described = []
    for i, entry in enumerate(entries):
        layers = []
        for j, cache in enumerate(entry.caches):
            if isinstance(cache, RecurrentCache):  # keys: the conv windows, values: the states
                meta, arrays[f"{i}.{j}.keys"], arrays[f"{i}.{j}.values"] = cache.file_state()
                layers.append({**_layout(cache), "meta": list(meta)})
                continue
            layers.append({**_layout(cache), "meta": [int(v) for v in cache.meta_state]})
            arrays[f"{i}.{j}.keys"], arrays[f"{i}.{j}.values"] = _arrays(cache)
        described.append({"tokens": entry.tokens.tolist(), "layers": layers})
    metadata = {"format": FORMAT, "version": FORMAT_VERSION, **identity, "entries": json.dumps(described)}
    _write(os.fspath(path), arrays, metadata)
    return len(described)


def _write(where: str, arrays: dict[str, Array], metadata: dict[str, str]) -> None:
    """Write the file at exactly `where`: MLX appends ".safetensors" to a name without it (the file
    would land beside the path asked for) and opens the path itself (a FIFO there blocks forever),
    so it writes a temporary file that then replaces `where` (`pymlxc.files.write_replacing`)."""
    def save(tmp: str) -> None:
        try:
            mx.save_safetensors(tmp, arrays, metadata)
        except mx.MLXError as exc:  # e.g. the disk is full
            raise OSError(f"cannot write prompt cache file {where}: {exc}") from None

    write_replacing(where, save, what="prompt cache file", suffix=".safetensors")


@dataclass(frozen=True)
class TensorSpec:
    """What one layer cache's keys or values must be, but for their length: [batch, heads, length, dim]."""

    batch: int
    heads: int
    dim: int
    dtype: Any

    def check(self, a: Array, what: str) -> None:
        if a.ndim != 4 or (a.shape[0], a.shape[1], a.shape[3]) != (self.batch, self.heads, self.dim):
            raise PromptCacheError(f"{what} has shape {tuple(a.shape)}; this model's are "
                                   f"({self.batch}, {self.heads}, length, {self.dim}) (batch, heads, length, head_dim)")
        if a.dtype != self.dtype:
            raise PromptCacheError(f"{what} is {_dtype_name(a)}; this model's are {str(self.dtype).rsplit('.', 1)[-1]}")


def cache_specs(model: Any, caches: Sequence[Any]) -> list[Any]:
    """The keys' and values' spec of each of `caches` (fresh, from `model.make_cache`; they are
    used up): the model itself writes one token into them, so every architecture's head counts,
    head dims (per layer where they differ) and cache dtype come out as generation makes them. A
    recurrent cache is its own spec (the shapes a file's arrays must have)."""
    model(mx.array([[0]], dtype=mx.int32), cache=list(caches))
    mx.eval([a for c in caches for a in c.state])
    specs: list[Any] = []
    for c in caches:
        if isinstance(c, RecurrentCache):
            specs.append(c)  # a file's arrays must be shaped as this cache's (RecurrentCache.from_file)
            continue
        keys, values = c.state
        specs.append((TensorSpec(1, keys.shape[1], keys.shape[3], keys.dtype),
                      TensorSpec(1, values.shape[1], values.shape[3], values.dtype)))
    return specs


def load_entries(path: str | os.PathLike[str], identity: dict[str, str], layout: Sequence[Any],
                 vocab_size: int, *, model: Any, max_entries: int | None = None,
                 max_bytes: int | None = None) -> list[tuple[np.ndarray, list[Any]]]:
    """The entries of the file at `path` as (tokens, caches), oldest first, after checking that the
    file was made by the model `identity` names with caches like `layout` (a fresh cache list, used
    up here), and that every tensor has the batch, heads, head_dim and dtype `model` writes. Every
    entry is checked, but with a cache's bounds (`max_entries`, `max_bytes`) only those that such a
    cache keeps are read (and checked for NaN and infinity): a file larger than the cache does not
    have to fit in memory."""
    if isinstance(path, (bytes, bytearray)) or not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"the prompt cache file must be a path, not {type(path).__name__}")
    where = os.fspath(path)
    # Header checked before MLX reads the file (MLX takes shapes it cannot hold); a FIFO, a
    # directory or a damaged file is a PromptCacheError naming it.
    arrays, metadata = checked_load(where, PromptCacheError, "prompt cache file")
    if metadata.get("format") != FORMAT:
        raise PromptCacheError(f"{where}: not a pymlxc prompt cache file (format {metadata.get('format')!r})")
    if metadata.get("version") != FORMAT_VERSION:
        raise PromptCacheError(f"{where}: prompt cache format version {metadata.get('version')!r}, "
                               f"this pymlxc reads {FORMAT_VERSION!r}")
    if metadata.get("model_type") != identity["model_type"]:
        raise PromptCacheError(f"{where}: the prompt cache was made by a {metadata.get('model_type')!r} model; "
                               f"this model is {identity['model_type']!r}")
    if metadata.get("fingerprint") != identity["fingerprint"]:
        raise PromptCacheError(f"{where}: the prompt cache was made by another {identity['model_type']} model "
                               "(its config or weights differ from this one's)")
    expected = [_layout(c) for c in layout]
    specs = cache_specs(model, layout)
    try:
        described = json.loads(metadata["entries"])
        if not isinstance(described, list) or not all(isinstance(d, dict) for d in described):
            raise TypeError("entries must be a list of objects")
        entries = [_entry(arrays, i, d, expected, specs, vocab_size) for i, d in enumerate(described)]
    except PromptCacheError as exc:
        raise PromptCacheError(f"{where}: {exc}") from None
    except (KeyError, TypeError, ValueError, RecursionError) as exc:
        raise PromptCacheError(f"{where}: damaged prompt cache file ({type(exc).__name__}: {exc})") from None
    index = {id(caches[0]): i for i, (_, caches) in enumerate(entries)}  # an entry's number in the file
    if max_entries is not None and max_bytes is not None:
        # What a cache of these bounds keeps of them (its own eviction and prefix rules; sizes come
        # from shapes, nothing is read yet): only those are read.
        scratch = PromptCache(max_entries, max_bytes)
        for tokens, caches in entries:
            scratch.store(tokens.tolist(), caches)
        entries = [(e.tokens, e.caches) for e in scratch.snapshot()]
    # A NaN or infinity in a restored cache would turn every answer that reuses it into garbage:
    # one reduction per tensor, evaluated with the tensors (read now: the file may go).
    names = [f"{index[id(caches[0])]}.{j}.{part}" for _, caches in entries
             for j in range(len(caches)) for part in ("keys", "values")]
    finite = mx.stack([mx.all(mx.isfinite(arrays[name])) for name in names] or [mx.array(True)])
    mx.eval([finite, *(a for _, caches in entries for c in caches for a in c.state)])
    bad = [name for name, ok in zip(names, finite.tolist(), strict=False) if not ok]
    if bad:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise PromptCacheError(f"{where}: the tensor {bad[0]}{more} holds NaN or infinite values; "
                               "the prompt cache file is damaged")
    return entries


def _ints(value: Any, what: str) -> list[int]:
    """`value` as a list of ints: a float, bool or string there is damage, not something to round."""
    if not isinstance(value, list) or not all(type(v) is int for v in value):
        raise PromptCacheError(f"{what} must be a list of integers")
    return value


def _entry(arrays: dict[str, Array], i: int, described: dict[str, Any], expected: list[dict[str, Any]],
           specs: list[Any], vocab_size: int) -> tuple[np.ndarray, list[Any]]:
    raw = _ints(described["tokens"], f"entry {i}: the token ids")
    if not raw or min(raw) < 0 or max(raw) >= vocab_size:
        raise PromptCacheError(f"entry {i}: token ids missing or outside the vocabulary of {vocab_size}")
    tokens = np.asarray(raw, dtype=np.int64)
    layers = described["layers"]
    if not isinstance(layers, list) or not all(isinstance(layer, dict) for layer in layers):
        raise PromptCacheError(f"entry {i}: layers must be a list of objects")
    got = [{k: v for k, v in layer.items() if k != "meta"} for layer in layers]
    if got != expected:
        raise PromptCacheError(f"entry {i}: its caches ({_kinds(got)}) are not this model's ({_kinds(expected)}); "
                               "was it made with another context_len?")
    caches: list[Any] = []
    for j, layer in enumerate(layers):
        keys, values = arrays[f"{i}.{j}.keys"], arrays[f"{i}.{j}.values"]
        meta = tuple(_ints(layer["meta"], f"entry {i} layer {j}: meta"))
        if layer["kind"] == RECURRENT:
            try:
                caches.append(RecurrentCache.from_file(keys, values, meta, len(tokens), specs[j]))
            except RecurrentCacheError as exc:
                raise PromptCacheError(f"entry {i} layer {j}: {exc}") from None
            continue
        specs[j][0].check(keys, f"entry {i} layer {j}: the keys tensor {i}.{j}.keys")
        specs[j][1].check(values, f"entry {i} layer {j}: the values tensor {i}.{j}.values")
        if keys.shape[2] != values.shape[2]:
            raise PromptCacheError(f"entry {i} layer {j}: keys {keys.shape} and values {values.shape} do not fit")
        if layer["kind"] == "KVCache":
            if meta != (len(tokens),) or keys.shape[2] != len(tokens):
                raise PromptCacheError(f"entry {i} layer {j}: {keys.shape[2]} keys for {len(tokens)} tokens")
            caches.append(KVCache.from_state((keys, values), meta))
        else:
            if len(meta) != 4:
                raise PromptCacheError(f"entry {i} layer {j}: rotating cache state {meta} is not (keep, max_size, "
                                       "offset, index)")
            keep, max_size, offset, idx = meta
            held = keys.shape[2]
            # The buffer is either in order (index == offset, nothing evicted) or a ring after
            # eviction: the first `keep` slots, the newest up to `index`, the oldest after it.
            # Any other index would put keys at the wrong positions, and the layout's own bounds hold.
            if ((keep, max_size) != (layer["keep"], layer["max_size"]) or offset != len(tokens)
                    or not (idx == offset <= held or keep <= idx <= held <= offset)):
                raise PromptCacheError(f"entry {i} layer {j}: rotating cache state {meta} does not fit "
                                       f"{held} keys and {len(tokens)} tokens")
            caches.append(RotatingKVCache.from_state((keys, values), meta))
    return tokens.astype(np.int32), caches


def _kinds(layout: Sequence[dict[str, Any]]) -> str:
    counts: dict[str, int] = {}
    for layer in layout:
        name = layer["kind"] + (f"({layer['max_size']}, keep {layer['keep']})" if "max_size" in layer else "")
        counts[name] = counts.get(name, 0) + 1
    return ", ".join(f"{n} x {k}" for k, n in counts.items())

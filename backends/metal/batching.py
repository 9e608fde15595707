"""Continuous batching: one running decode batch that requests join and leave between steps.

A `Scheduler` owns a thread and one decode batch. Each turn of its loop it
1. admits queued requests (up to `max_batch` running or prefilling at once),
2. drops cancelled requests, freeing their rows of the batch's caches,
3. runs one prefill chunk of the oldest request still being prefilled (so a long prompt never
   stops the running streams for longer than one chunk), and
4. runs one decode step for every running row.

A request is prefilled alone, into the model's own caches (`make_cache`, or the prompt cache's
longest prefix of its prompt: prefixes are shared across requests), exactly as `generate` prefills,
or, where short prompts wait together, in a left-padded group (`_prefill_group`). Recurrent layers
(Gated DeltaNet) mask a group's padding out of their states, and group only prompts with no cached
prefix (a state cannot be cut back to an earlier position); their rows' conv windows and states
join the batch as `BatchRecurrentCache`s, row b in row b of each array.
Its first token is sampled from the prefill's logits; its caches then join the batch's
`BatchKVCache`s: each row right-aligned at the batch's current column, with its own RoPE positions
(`offset` is an array, one position per row) and its own first valid column, so a row decodes the
tokens it would decode alone. Each row samples with its own sampler, penalties, logit bias, stop
ids and constraint (`Constraint`: a grammar's allowed-token mask), and reports each token through
its own `emit` callback, on the scheduler's thread.

While every running row is greedy with nothing to apply but a fixed logit bias (the batch's
biases go in as [B, K] id and amount arrays, made when the rows change) and no prompt is being
prefilled, the loop looks one step ahead: step k+1's forward pass takes step k's argmax as a lazy array and is
queued on the device (`async_eval`) before step k's ids are read back and reported, so the host's
work (building the next graph, reporting, stop rules) overlaps the device's. A row that finishes at
step k has had step k+1 computed for nothing; that token is dropped with the row. Anything that
changes the batch (a prompt to prefill, a cancelled row) settles the step in flight first.

Every step runs as a counted step of the model (`host.counted_step()`), so `close()` waits for the
running step and then stops the loop; the requests left get a `ModelClosedError` event.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

import pymlxc.core as mx
from pymlxc.bridge.protocol import context_full_problem
from pymlxc.model import GenerationCancelled, ModelClosedError
from pymlxc.options import check_sampling, checked_int, checked_real, checked_token_ids

from . import generate as loops
from . import prompt_cache as pcache
from .cache import KVCache, RotatingKVCache
from .decode.batch_step import BatchStep
from .kernels.check import on_cuda
from .kernels.matvec import MAX_X_ROWS
from .recurrent_cache import RecurrentCache, set_left_padding
from .sample import DEFAULT_PENALTY_CONTEXT, greedy, make_repeat_penalty, make_sampler

_NEG_INF = float("-inf")
GROW = 256  # columns added to a batch cache at a time
GROUP_CHUNKS = 2  # a group of prompts prefilled together holds at most this many chunks' tokens
WARM_ROWS = MAX_X_ROWS  # batch sizes a server warms up: pymlxc's CUDA matvec kernel compiles one per size
MAX_TOP_LOGPROBS = 20  # OpenAI's bound


class BatchingUnsupported(RuntimeError):
    """The model's caches cannot join a batch (a linear-attention layer's recurrent state)."""


class QueueFull(RuntimeError):
    """The scheduler's queue holds `max_queue` requests already."""


class ContextFull(ValueError):
    """A row ended at the scheduler's context length before its max_tokens (or had no room at all):
    a batch row's caches do not rotate past `context_len`, as a single generation's do."""


class Constraint(Protocol):
    """A grammar that decoding follows: `allowed()` is the bool mask [vocab] of the ids that may come
    next, `advance(id)` consumes the sampled id, `done()` says the grammar is complete (nothing
    more may follow: the row stops as at a stop id)."""

    def allowed(self) -> np.ndarray: ...

    def advance(self, token: int) -> None: ...

    def done(self) -> bool: ...


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples. 0 is off for every filter and penalty; 1.0 for `repetition_penalty`."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 0.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0  # OpenAI's: subtracted once from every generated id's logit
    frequency_penalty: float = 0.0  # subtracted per occurrence among the generated ids
    repetition_penalty: float = 1.0  # llama.cpp's, over the last 64 ids of prompt and output
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None  # None: none; k >= 0: the sampled id's and the top k
    stop_ids: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        # The checks of GenerateConfig (pymlxc/options.py), with OpenAI's name of the penalty.
        put = object.__setattr__
        for name, value in check_sampling(self, penalty="repetition_penalty").items():
            put(self, name, value)
        # The rest is checked too: a NaN bias or penalty would make every logit NaN (the argmax
        # then picks an arbitrary id, silently), a malformed one fail the row mid-run.
        for name in ("presence_penalty", "frequency_penalty"):
            put(self, name, checked_real(name, getattr(self, name)))
        bias = self.logit_bias
        if isinstance(bias, (str, bytes, Mapping)) or not isinstance(bias, Iterable):
            raise TypeError(f"logit_bias must be a sequence of (token id, amount) pairs, not {type(bias).__name__}")
        pairs = []
        for n, pair in enumerate(bias):
            if isinstance(pair, (str, bytes)) or not isinstance(pair, Sequence) or len(pair) != 2:
                raise TypeError(f"logit_bias[{n}] must be a (token id, amount) pair, not {pair!r}")
            pairs.append((checked_int(f"logit_bias[{n}]'s token id", pair[0], low=0),
                          checked_real(f"logit_bias[{n}]'s amount", pair[1])))
        put(self, "logit_bias", tuple(pairs))
        put(self, "stop_ids", frozenset(checked_token_ids("stop_ids", self.stop_ids)))
        if self.logprobs is not None:
            put(self, "logprobs", checked_int("top_logprobs", self.logprobs))
            if not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
                raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], not {self.logprobs}")


@dataclass(frozen=True)
class Event:
    """One sampled token of a request (`token`), or its end (`finish`: "stop", "length",
    "cancelled", "error"; `error` says what went wrong)."""

    token: int | None = None
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    finish: str | None = None
    error: BaseException | None = None


class Request:
    """A generation in the scheduler: prompt ids in, `Event`s out through `emit` (called on the
    scheduler's thread: it must not block). `cancel()` removes it between steps."""

    _ids = itertools.count()

    def __init__(self, prompt: Sequence[int], params: SamplingParams, emit: Callable[[Event], None],
                 constraint: Constraint | None = None) -> None:
        if not prompt:
            raise ValueError("the prompt has no tokens")
        self.id = next(self._ids)
        self.prompt = list(prompt)
        self.params = params
        self.emit = emit
        self.constraint = constraint
        self._cancelled = threading.Event()
        self.submitted = time.perf_counter()

    def send(self, event: Event) -> bool:
        """`emit(event)`, False where it raised (the client is gone): the request is cancelled then.
        The scheduler sends every event through here, so one request's emit cannot fail the others
        (or stop them getting their ends)."""
        try:
            self.emit(event)
        except Exception:  # noqa: BLE001 - this request alone ends
            self._cancelled.set()
            return False
        return True

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()


class Host(Protocol):
    """What the scheduler needs from the model that owns it (`MetalTextModel`)."""

    @property
    def language_model(self) -> Any: ...

    def counted_step(self) -> contextlib.AbstractContextManager[None]: ...

    def restore_prefix(self, ids: list[int]) -> tuple[list[Any], int]: ...

    def keep_prefix(self, ids: list[int], cache: list[Any]) -> None: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def batch_step(self) -> BatchStep | None: ...

    @property
    def keeps_prefixes(self) -> bool: ...


# ---------------------------------------------------------------------- the batch's caches

class _Stepping:
    """A device array that moves by one with the batch's column: uploaded from the host when the
    rows change (or a step is skipped), else the last one plus one, computed on the device."""

    def __init__(self) -> None:
        self._array: mx.Array | None = None
        self._at: tuple[int, bytes] = (-1, b"")

    def at(self, idx: int, key: bytes, values: Callable[[], np.ndarray]) -> mx.Array:
        last_idx, last_key = self._at
        if self._array is None or key != last_key or idx not in (last_idx, last_idx + 1):
            self._array = mx.array(values().astype(np.int32))
        elif idx == last_idx + 1:
            self._array = self._array + 1
        self._at = (idx, key)
        return self._array


class Columns:
    """What every layer cache of one batch shares: the columns' RoPE positions and masks as device
    arrays, made once per step rather than once per layer. From one step to the next the positions
    (and the column written) are the last step's plus one, computed on the device, and a mask is
    built from the first valid column of each row (uploaded once per change of the rows) and a
    device `arange`: nothing goes from host to device per step while the rows stay."""

    def __init__(self) -> None:
        self._positions = _Stepping()
        self._column = _Stepping()
        # Each form of the rows' first valid columns seen, by its bytes: the layers of a batch share
        # one unless a row holds fewer keys in its sliding-window layers, then two.
        self._firsts: dict[bytes, mx.Array] = {}
        self._masks: dict[tuple[int, int | None, bytes], mx.Array | None] = {}

    def offset(self, idx: int, starts: np.ndarray) -> mx.Array:
        """Each row's next position (idx - starts), int32 [B]."""
        return self._positions.at(idx, starts.tobytes(), lambda: idx - starts)

    def column(self, idx: int) -> mx.Array:
        """The column this step writes, int32 [1] (the compiled step's input)."""
        return self._column.at(idx, b"", lambda: np.array([idx]))

    def first_valid(self, valid: np.ndarray, key: bytes | None = None) -> mx.Array:
        """Each row's first valid column, int32 [B], uploaded once per change of the rows. `key`:
        `valid.tobytes()` where the caller has it."""
        key = valid.tobytes() if key is None else key
        first = self._firsts.get(key)
        if first is None:
            if len(self._firsts) >= 4:  # forms of rows gone by
                self._firsts, self._masks = {}, {}
            first = self._firsts[key] = mx.array(valid.astype(np.int32))
        return first

    def mask(self, idx: int, valid: np.ndarray, window: int | None) -> mx.Array | None:
        """[B, 1, 1, idx + 1] booleans, True where a row may attend (its valid columns, inside
        the window), or None where every row may attend to every column."""
        form = valid.tobytes()
        first = self.first_valid(valid, form)
        key = (idx, window, form)
        if key in self._masks:
            return self._masks[key]
        # A window cuts in only once the columns outnumber it.
        cut = window if window is not None and idx + 1 > window else None
        m: mx.Array | None = None
        if cut is not None or valid.any():
            cols = mx.arange(idx + 1, dtype=mx.int32)[None, :]
            visible = cols >= mx.expand_dims(first, 1)
            if cut is not None:
                visible = mx.logical_and(visible, cols > idx - cut)
            m = mx.reshape(visible, (valid.shape[0], 1, 1, idx + 1))
        self._masks = {key: m, **{k: v for k, v in self._masks.items() if k[0] == idx}}
        return m


class BatchKVCache:
    """One attention layer's keys and values for every row of the decode batch (the `Cache`
    protocol: one-token steps, and the left-padded prompts of a group prefilled together).

    Columns are shared: column c of row b holds position c - starts[b]; columns before
    `valid[b]` are padding (or keys a sliding window dropped before the row joined). `offset` is
    the array of each row's next position (for RoPE), `make_mask` hides each row's invalid columns
    and, with a window, what is older than it.
    """

    def __init__(self, keys: mx.Array, values: mx.Array, idx: int, starts: np.ndarray, valid: np.ndarray,
                 columns: Columns | None = None) -> None:
        self.keys, self.values = keys, values
        self.idx = idx
        self.starts = starts
        self.valid = valid
        self.columns = columns if columns is not None else Columns()

    @property
    def offset(self) -> mx.Array:
        return self.columns.offset(self.idx, self.starts)

    @classmethod
    def for_prompts(cls, pads: np.ndarray, columns: Columns) -> BatchKVCache:
        """An empty cache for left-padded prompts (`pads[b]` padding columns before row b's first
        token, which is at position 0): its buffers are made at the first update, shaped as the
        keys and values given."""
        empty = mx.zeros((0,), mx.float32)
        return cls(empty, empty, 0, pads.copy(), pads.copy(), columns)

    @property
    def capacity(self) -> int:
        return self.keys.shape[2] if self.keys.ndim == 4 else 0

    def update_and_fetch(self, keys: mx.Array, values: mx.Array) -> tuple[mx.Array, mx.Array]:
        b, h, s, dk = keys.shape
        dv = values.shape[3]
        end = self.idx + s
        if end > self.capacity:
            if self.keys.ndim != 4:  # made by for_prompts: the buffers take the first chunk's shape
                want = max(GROW, -(-end // GROW) * GROW)
                self.keys = mx.zeros((b, h, want, dk), keys.dtype)
                self.values = mx.zeros((b, h, want, dv), values.dtype)
            while end > self.capacity:
                self.grow()
        self.keys = mx.slice_update(self.keys, keys, [0, 0, self.idx, 0], [b, h, end, dk], [1, 1, 1, 1])
        self.values = mx.slice_update(self.values, values, [0, 0, self.idx, 0], [b, h, end, dv], [1, 1, 1, 1])
        self.idx = end
        return (mx.slice(self.keys, [0, 0, 0, 0], [b, h, end, dk], [1, 1, 1, 1]),
                mx.slice(self.values, [0, 0, 0, 0], [b, h, end, dv], [1, 1, 1, 1]))

    def round_capacity(self) -> None:
        """Zero columns at the end up to a multiple of GROW: the batch's buffer sizes stay few, so
        the compiled step is traced once per size and batch size."""
        have = self.capacity
        self.pad_to(max(GROW, -(-have // GROW) * GROW))

    def shift(self, n: int) -> None:
        """`n` empty columns in front (every row's positions move by n columns)."""
        b, h, _, dk = self.keys.shape
        dv = self.values.shape[3]
        self.keys = mx.concatenate([mx.zeros((b, h, n, dk), self.keys.dtype), self.keys], 2)
        self.values = mx.concatenate([mx.zeros((b, h, n, dv), self.values.dtype), self.values], 2)
        self.idx += n
        self.starts = self.starts + n
        self.valid = self.valid + n
        self.round_capacity()

    def pad_to(self, capacity: int) -> None:
        """Empty columns at the end up to `capacity`."""
        have = self.capacity
        if capacity > have:
            b, h, _, dk = self.keys.shape
            dv = self.values.shape[3]
            self.keys = mx.concatenate([self.keys, mx.zeros((b, h, capacity - have, dk), self.keys.dtype)], 2)
            self.values = mx.concatenate([self.values, mx.zeros((b, h, capacity - have, dv), self.values.dtype)], 2)

    def grow(self) -> None:
        """GROW more columns at the end."""
        b, h, _, dk = self.keys.shape
        dv = self.values.shape[3]
        self.keys = mx.concatenate([self.keys, mx.zeros((b, h, GROW, dk), self.keys.dtype)], axis=2)
        self.values = mx.concatenate([self.values, mx.zeros((b, h, GROW, dv), self.values.dtype)], axis=2)

    def make_mask(self, n: int, window_size: int | None = None) -> mx.Array | None:
        if n != 1:  # a group's prompts: `valid` is each row's padding
            return loops.left_padded_mask(mx.array(self.valid.astype(np.int32)), self.idx, n, window_size)
        return self.columns.mask(self.idx, self.valid, window_size)

    @property
    def state(self) -> tuple[mx.Array, ...]:
        return (self.keys, self.values)

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def is_trimmable(self) -> bool:
        return False

    def trim(self, n: int) -> int:
        return 0


class BatchRecurrentCache(RecurrentCache):
    """One Gated DeltaNet layer's conv window and delta-rule state for every row of the decode
    batch, row b's in row b of each array: a `RecurrentCache` (so the layer, and a pipeline rank
    advancing a layer it does not hold, treat it as one) that rows join and leave. One-token steps
    only: a prompt with such layers is prefilled into the model's own `RecurrentCache`, whose
    arrays then join here (or a group's, prefilled left-padded with the padding masked out of its
    states: `Scheduler._prefill_group`), so no step has padding and the layer needs no token mask."""

    @classmethod
    def of(cls, cache: RecurrentCache) -> BatchRecurrentCache:
        """The rows of `cache` (a prompt prefilled alone, or a group's, its padding behind it)."""
        if cache.conv is None or cache.recurrent is None:
            raise ValueError("an empty recurrent cache cannot join the batch")
        batch = cls()
        batch.conv, batch.recurrent, batch.offset = cache.conv, cache.recurrent, cache.offset
        return batch

    def update(self, conv: mx.Array, recurrent: mx.Array, n: int) -> None:
        if n != 1:
            raise BatchingUnsupported("a batch's recurrent layers take one token a step "
                                      "(prompts are prefilled before they join)")
        self.conv, self.recurrent = conv, recurrent
        self.offset += 1  # the rows' own positions differ: this counts steps only

    @property
    def state(self) -> tuple[mx.Array, ...]:
        assert self.conv is not None and self.recurrent is not None  # `of` made it
        return (self.conv, self.recurrent)

    def join(self, other: BatchRecurrentCache) -> None:
        """`other`'s rows after these."""
        assert self.conv is not None and self.recurrent is not None and other.conv is not None \
            and other.recurrent is not None  # `of` made both
        self.conv = mx.concatenate([self.conv, other.conv], 0)
        self.recurrent = mx.concatenate([self.recurrent, other.recurrent], 0)

    def select(self, index: mx.Array) -> None:
        """Keep the rows at `index` (in that order)."""
        assert self.conv is not None and self.recurrent is not None  # `of` made it
        self.conv, self.recurrent = mx.take(self.conv, index, axis=0), mx.take(self.recurrent, index, axis=0)


def _row_kv(cache: Any) -> tuple[mx.Array, mx.Array, int]:
    """A request's layer cache as keys and values [1, H, m, D] in position order, the last m of
    its `offset` positions (m < offset where a sliding window dropped the oldest)."""
    state, meta = cache.state, cache.meta_state
    if not state:
        raise ValueError("an empty cache cannot join the batch")
    keys, values = state
    if isinstance(cache, RotatingKVCache):
        keep, _max_size, offset, idx = meta
        length = keys.shape[2]
        if idx == offset:  # nothing evicted: slot i holds position i
            return keys[:, :, :offset], values[:, :, :offset], offset
        if keep:
            raise BatchingUnsupported("a context-bounded cache that evicted cannot join the batch")
        if idx >= length:
            return keys, values, offset
        order = np.concatenate([np.arange(idx, length), np.arange(0, idx)]).astype(np.int32)
        index = mx.array(order)
        return mx.take(keys, index, axis=2), mx.take(values, index, axis=2), offset
    (offset,) = meta
    return keys[:, :, :offset], values[:, :, :offset], offset


def _prefix_caches(prefixes: Sequence[Sequence[Any]], held: Sequence[int], pads: np.ndarray,
                   columns: Columns) -> list[BatchKVCache]:
    """A group's layer caches before its chunk: row b's cached prefix (`held[b]` tokens, the
    caches in `prefixes[b]`; none for a padded row) ends at the common column max(held), so that
    the chunk's columns follow every row's prefix; a padded row's first token comes `pads[b]`
    columns into the chunk."""
    idx = max(held)
    out = []
    for layer in range(len(prefixes[0])):
        parts = [_row_kv(p[layer]) if n else None for p, n in zip(prefixes, held, strict=True)]
        like = next(part for part in parts if part is not None)
        _, h, _, dk = like[0].shape
        dv, dtype = like[1].shape[3], like[0].dtype
        keys, values, starts, valid = [], [], [], []
        for part, pad in zip(parts, pads, strict=True):
            k, v, positions = part if part is not None else (mx.zeros((1, h, 0, dk), dtype),
                                                             mx.zeros((1, h, 0, dv), dtype), 0)
            m = k.shape[2]
            if idx > m:
                k = mx.concatenate([mx.zeros((1, h, idx - m, dk), dtype), k], 2)
                v = mx.concatenate([mx.zeros((1, h, idx - m, dv), dtype), v], 2)
            keys.append(k)
            values.append(v)
            starts.append(idx - positions + int(pad))
            valid.append(idx - m + int(pad))
        cache = BatchKVCache(mx.concatenate(keys, 0), mx.concatenate(values, 0), idx, np.array(starts),
                             np.array(valid), columns)
        cache.round_capacity()
        out.append(cache)
    return out


def _row_caches(prefix: list[Any], caches: Sequence[Any], b: int, first: int, tokens: int) -> list[Any]:
    """Row `b` of a prefilled group as the caches a prefill alone leaves: `prefix` (its cached
    prefix, or the model's `make_cache`) given the row's chunk (columns `first`.. of the group's
    caches, `tokens` of them) as one update, as that prefill gives it; a recurrent layer its row
    of the group's window and state."""
    for cache, group in zip(prefix, caches, strict=True):
        if isinstance(group, RecurrentCache):  # a group without cached prefixes (`Scheduler._group`)
            assert group.conv is not None and group.recurrent is not None  # prefilled
            cache.update(group.conv[b:b + 1], group.recurrent[b:b + 1], tokens)
            continue
        end = group.idx
        _, h, _, dk = group.keys.shape
        dv = group.values.shape[3]
        cache.update_and_fetch(mx.slice(group.keys, [b, 0, first, 0], [b + 1, h, end, dk], [1, 1, 1, 1]),
                               mx.slice(group.values, [b, 0, first, 0], [b + 1, h, end, dv], [1, 1, 1, 1]))
    return prefix


def _prompts_caches(like: Sequence[Any], pads: np.ndarray, columns: Columns) -> list[Any]:
    """The layer caches of a group of left-padded prompts with no cached prefix, each of the kind
    of the model's own in `like`: a `BatchKVCache`, or a `RecurrentCache` told the padding."""
    caches = [RecurrentCache() if isinstance(c, RecurrentCache) else BatchKVCache.for_prompts(pads, columns)
              for c in like]
    set_left_padding(caches, mx.array(pads.astype(np.int32)))
    return caches


def check_batchable(caches: Sequence[Any]) -> bool:
    """Whether the model's layer caches can join a batch (else BatchingUnsupported, naming the
    layer); True where some are recurrent (their prompts then group only from an empty cache)."""
    for i, c in enumerate(caches):
        if not isinstance(c, (KVCache, RotatingKVCache, RecurrentCache)):
            raise BatchingUnsupported(f"layer {i} has a {type(c).__name__}: continuous batching takes "
                                      "KVCache, RotatingKVCache and RecurrentCache layers")
    return any(isinstance(c, RecurrentCache) for c in caches)


_versions = itertools.count()


class Batch:
    """The running rows and their layer caches: a `BatchKVCache` per attention layer (all with the
    same columns) and a `BatchRecurrentCache` per Gated DeltaNet layer."""

    def __init__(self) -> None:
        self.rows: list[_Row] = []
        self.caches: list[Any] = []
        self.columns = Columns()  # the layers' shared positions and masks
        self.version = next(_versions)  # new at every change of the rows (BatchStep looks again at the weights)
        self._shared_valid = (-1, True)  # (version, whether every attention layer has the same `valid`)
        self._layer_valid: tuple[int, mx.Array | None] = (-1, None)  # (version, `layer_valid`'s array)

    def __len__(self) -> int:
        return len(self.rows)

    def add(self, row: _Row, layer_caches: Sequence[Any]) -> None:
        """Add a row from its own caches (a prefill alone), right-aligned at the batch's column."""
        parts = [None if isinstance(c, RecurrentCache) else _row_kv(c) for c in layer_caches]
        # The row's next position; a layer may hold fewer keys (a window).
        positions = next((part[2] for part in parts if part is not None), 0)
        one = Batch()
        for c, part in zip(layer_caches, parts, strict=True):
            if part is None:
                one.caches.append(BatchRecurrentCache.of(c))
                continue
            keys, values, _ = part
            m = keys.shape[2]
            cache = BatchKVCache(keys, values, m, np.array([m - positions]), np.array([0]), one.columns)
            if m < positions:  # the row's last key goes in column `positions - 1`
                cache.shift(positions - m)
            else:
                cache.round_capacity()
            one.caches.append(cache)
        one.rows.append(row)
        self.extend(one)

    def attention_caches(self) -> list[BatchKVCache]:
        return [c for c in self.caches if isinstance(c, BatchKVCache)]

    def extend(self, other: Batch) -> None:
        """Take `other`'s rows (after this batch's): the batch whose last column is earlier gets
        empty columns in front, so that both end at the same column, then each layer's buffers
        are joined along the rows."""
        if not other.rows:
            return
        if not self.rows:
            self.caches = other.caches
            for c in self.caches:
                c.columns = self.columns
        else:
            kv, other_kv = self.attention_caches(), other.attention_caches()
            shift = other_kv[0].idx - kv[0].idx if kv else 0
            for c in kv if shift > 0 else other_kv if shift < 0 else ():
                c.shift(abs(shift))
            for mine, theirs in zip(self.caches, other.caches, strict=True):
                if isinstance(mine, BatchRecurrentCache):
                    mine.join(theirs)
                    continue
                capacity = max(mine.capacity, theirs.capacity)
                mine.pad_to(capacity)
                theirs.pad_to(capacity)
                mine.keys = mx.concatenate([mine.keys, theirs.keys], 0)
                mine.values = mx.concatenate([mine.values, theirs.values], 0)
                mine.starts = np.append(mine.starts, theirs.starts)
                mine.valid = np.append(mine.valid, theirs.valid)
        mx.eval([c.state for c in self.caches])
        self.rows.extend(other.rows)
        other.rows, other.caches = [], []
        self.version = next(_versions)

    def logits(self, model: Any, ids: mx.Array, step: BatchStep | None) -> mx.Array:
        """The next logits [B, V] of every row from their last ids [B, 1], the caches moved one column
        on: on the compiled step where it applies, else built op by op (the same tokens)."""
        caches = self.caches
        first = next((c for c in caches if isinstance(c, BatchKVCache)), None)  # the columns' reference
        if step is not None and first is not None:
            if first.idx + 1 > first.capacity:
                for c in self.attention_caches():
                    c.grow()
            cols = self.columns
            valid = cols.first_valid(first.valid) if self.shares_valid() else self.layer_valid()
            got = step.logits(ids, cols.column(first.idx), cols.offset(first.idx, first.starts),
                              valid, [a for c in caches for a in c.state], self.version)
            if got is not None:
                logits, buffers = got
                for i, c in enumerate(caches):
                    if isinstance(c, BatchRecurrentCache):
                        c.update(buffers[2 * i], buffers[2 * i + 1], 1)
                    else:
                        c.keys, c.values = buffers[2 * i], buffers[2 * i + 1]
                        c.idx += 1
                return logits
        out: mx.Array = model(ids, cache=caches)[:, -1, :]
        return out

    def shares_valid(self) -> bool:
        """Whether every attention layer has the same first valid column in each row: then the
        compiled step takes one [B] array for all layers. A sliding-window layer of a row that
        joined holding fewer keys than positions (a prompt cache hit past the window) has later
        ones; the step then takes `layer_valid`."""
        version, same = self._shared_valid
        if version != self.version:
            kv = self.attention_caches()
            same = all(np.array_equal(c.valid, kv[0].valid) for c in kv[1:])
            self._shared_valid = (self.version, same)
        return same

    def layer_valid(self) -> mx.Array:
        """Each attention layer's first valid column of each row, int32 [layers, B] in the order of
        `attention_caches`, uploaded once per change of the rows (`valid` changes only with them)."""
        version, stacked = self._layer_valid
        if version != self.version or stacked is None:
            stacked = mx.array(np.stack([c.valid for c in self.attention_caches()]).astype(np.int32))
            self._layer_valid = (self.version, stacked)
        return stacked

    def remove(self, gone: Sequence[_Row]) -> None:
        """Drop rows, and the leading columns no row needs any more."""
        if gone:
            self.take([i for i, r in enumerate(self.rows) if r not in gone])

    def take(self, keep: Sequence[int]) -> None:
        """Keep the rows at `keep` (in that order), and drop the leading columns none of them needs."""
        self.rows = [self.rows[i] for i in keep]
        self.version = next(_versions)
        if not keep:
            self.caches = []
            return
        index = mx.array(np.array(keep, dtype=np.int32))
        kv = self.attention_caches()
        first = min((int(c.valid[keep].min()) for c in kv), default=0)
        for c in self.caches:
            if isinstance(c, BatchRecurrentCache):
                c.select(index)
                continue
            keys, values = mx.take(c.keys, index, axis=0), mx.take(c.values, index, axis=0)
            if first:
                keys, values = keys[:, :, first:], values[:, :, first:]
            c.keys, c.values = keys, values
            c.idx -= first
            c.starts = c.starts[keep] - first
            c.valid = c.valid[keep] - first
            c.round_capacity()
        mx.eval([c.state for c in self.caches])


# ---------------------------------------------------------------------- rows

@dataclass
class _Row:
    """A request being prefilled or decoded: its sampler and what it has produced."""

    request: Request
    sampler: Any
    generated: list[int] = field(default_factory=list)
    counts: collections.Counter[int] = field(default_factory=collections.Counter)
    cache: list[Any] | None = None  # while prefilling: the request's own caches
    done_tokens: int = 0  # prompt tokens in `cache`
    started: bool = False
    checked: bool = False  # the memory check of its prefill was made
    alone: bool = False  # prefilled on its own (its group could not run)
    max_tokens: int = 0
    context_bound: bool = False  # max_tokens cut to what the context holds after the prompt
    bias: tuple[mx.Array, mx.Array] | None = None
    repeat: Any = None
    failed: BaseException | None = None  # what its own processing raised (`Scheduler._sample`): it ends with it

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @functools.cached_property
    def plain(self) -> bool:
        """Greedy with nothing to apply but a fixed logit bias: the batch's argmax serves it (after
        the batch's biases, `Scheduler._greedy`); fixed for the row's life."""
        p = self.params
        return (self.sampler is greedy and self.request.constraint is None and p.logprobs is None
                and not p.presence_penalty and not p.frequency_penalty and p.repetition_penalty == 1.0)

    def process(self, logits: mx.Array) -> mx.Array:
        """This row's logits [1, V] after its penalties, bias and constraint."""
        p = self.params
        if p.repetition_penalty != 1.0:
            recent = (self.request.prompt[-DEFAULT_PENALTY_CONTEXT:] + self.generated)[-DEFAULT_PENALTY_CONTEXT:]
            logits = self.repeat(mx.array([recent], dtype=mx.int32), logits)
        if (p.presence_penalty or p.frequency_penalty) and self.counts:
            ids = np.fromiter(self.counts.keys(), dtype=np.int32)
            amounts = np.array([p.presence_penalty + p.frequency_penalty * n for n in self.counts.values()],
                               dtype=np.float32)
            index = mx.array(ids[None, :])
            seen = mx.take_along_axis(logits, index, axis=-1)
            logits = mx.put_along_axis(logits, index, seen - mx.array(amounts[None, :]).astype(logits.dtype), axis=-1)
        if self.bias is not None:
            bias_ids, bias_amounts = self.bias
            seen = mx.take_along_axis(logits, bias_ids, axis=-1)
            logits = mx.put_along_axis(logits, bias_ids, seen + bias_amounts.astype(logits.dtype), axis=-1)
        constraint = self.request.constraint
        if constraint is not None:
            allowed = constraint.allowed()
            vocab = logits.shape[-1]
            if allowed.shape[0] < vocab:
                allowed = np.concatenate([allowed, np.zeros(vocab - allowed.shape[0], dtype=bool)])
            logits = mx.where(mx.array(allowed[None, :vocab]), logits, mx.array(_NEG_INF, logits.dtype))
        return logits


# The row `Scheduler.warm` puts in its throwaway batch (a batch only keeps its rows in a list).
_WARM_ROW: Any = object()


def _batch_bias(rows: Sequence[_Row]) -> tuple[mx.Array, mx.Array] | None:
    """The rows' logit biases as ids and amounts [B, K] (see `Scheduler._greedy`), or None."""
    pairs: list[tuple[tuple[int, float], ...]] = [r.params.logit_bias or () for r in rows]
    width = max((len(p) for p in pairs), default=0)
    if not width:
        return None
    ids = np.zeros((len(rows), width), dtype=np.int32)
    amounts = np.zeros((len(rows), width), dtype=np.float32)
    for b, row_pairs in enumerate(pairs):
        if row_pairs:
            padded = list(row_pairs) + [row_pairs[0]] * (width - len(row_pairs))
            ids[b] = [i for i, _ in padded]
            amounts[b] = [a for _, a in padded]
    return mx.array(ids), mx.array(amounts)


def _make_row(request: Request, vocab: int) -> _Row:
    loops.check_prompt_ids(request.prompt, vocab)
    p = request.params
    row = _Row(request, make_sampler(p.temperature, p.top_k, p.top_p, p.min_p, key=p.seed))
    if p.logit_bias:
        ids = np.array([i for i, _ in p.logit_bias], dtype=np.int64)  # int32 would overflow on a huge id
        if ids.min() < 0 or ids.max() >= vocab:
            raise ValueError(f"logit_bias names token id {int(ids[(ids < 0) | (ids >= vocab)][0])}, outside "
                             f"the vocabulary of {vocab}")
        if not row.plain:  # a plain row's bias goes in with the batch's (`Scheduler._greedy`)
            amounts = np.array([[b for _, b in p.logit_bias]], dtype=np.float32)
            row.bias = (mx.array(ids[None, :].astype(np.int32)), mx.array(amounts))
    if p.repetition_penalty != 1.0:
        row.repeat = make_repeat_penalty(p.repetition_penalty)
    return row


# ---------------------------------------------------------------------- the scheduler

class Scheduler:
    """The continuous-batching loop of one model (see the module doc). Thread-safe `submit`."""

    def __init__(self, host: Host, *, max_batch: int = 16, max_queue: int = 64, prefill_step: int = 512,
                 context_len: int | None = None) -> None:
        if max_batch < 1 or max_queue < 0 or prefill_step < 1:
            raise ValueError("max_batch and prefill_step must be >= 1, max_queue >= 0")
        self._host = host
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.prefill_step = prefill_step
        self.context_len = context_len
        self._recurrent = check_batchable(host.language_model.make_cache(context_len))
        self._queue: collections.deque[Request] = collections.deque()
        self._lock = threading.Condition()
        self._stopping = False
        self._prefilling: collections.deque[_Row] = collections.deque()
        self._batch = Batch()
        self._thread: threading.Thread | None = None
        self._driven = False  # run_turn's caller runs the loop (no thread of its own)
        # The ids of the last decode step, one per batch row, queued on the device and not yet read
        # back (the look-ahead: see the module doc).
        self._ahead: mx.Array | None = None
        # The plain rows last seen by `_greedy`, and their logit biases.
        self._bias_rows: tuple[_Row, ...] = ()
        self._bias: tuple[mx.Array, mx.Array] | None = None
        self.steps = 0  # decode steps run (for tests and metrics)
        self.grouped = 0  # rows whose prompts were prefilled together with others
        self.peak_rows = 0

    # ------------------------------------------------------------------ the caller's side
    def submit(self, request: Request, bounded: bool = True) -> None:
        """Queue `request`; QueueFull when `max_queue` requests wait already for a free row
        (`bounded=False`: queued whatever the length, for a caller that waits for them all)."""
        self.submit_all([request], bounded)

    def submit_all(self, requests: Sequence[Request], bounded: bool = True) -> None:
        """Queue `requests` at once: the loop sees all of them or none, so what it runs (which
        prompts are prefilled together) does not depend on when its thread woke. The ranks of a
        distributed model rely on it: each runs the same steps only if each sees the same queue.
        QueueFull (none queued) where `bounded` and they do not fit beside those waiting."""
        gone: list[Request] = []
        try:
            with self._lock:
                if self._stopping:
                    raise ModelClosedError("the model is closed")
                if self._driven:
                    raise RuntimeError("this scheduler is driven turn by turn (run_turn), not through submit")
                # Requests cancelled while they waited hold no place: left in the queue until a row
                # frees, they would turn new requests away (QueueFull) for clients that are gone.
                gone = [r for r in self._queue if r.cancelled]
                if gone:
                    self._queue = collections.deque(r for r in self._queue if not r.cancelled)
                free = max(0, self.max_batch - self.running())
                if bounded and len(self._queue) + len(requests) > self.max_queue + free:
                    raise QueueFull(f"{len(self._queue)} requests are waiting already (max_queue={self.max_queue})")
                self._queue.extend(requests)
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="pymlxc-batch", daemon=True)
                    self._thread.start()
                self._lock.notify_all()
        finally:
            for request in gone:  # their end, as `_admit` would have sent it, outside the lock
                request.send(Event(finish="cancelled"))

    def warm(self, rows: int | None = None) -> None:
        """Run one decode step at each batch size 1..`rows` (at most `max_batch`) on throwaway rows,
        so that what the device builds once per batch size is built now, not while the first
        requests that reach that size wait. A server calls it before it listens. `rows` None: the
        sizes worth it here: on MLX's CUDA device those up to WARM_ROWS (pymlxc's matvec kernel
        is compiled per row count of x in every process), every size where the batch step is
        compiled (traced per size); none elsewhere (a large model's steps on a CPU would only
        delay the start)."""
        if rows is None:
            rows = (self.max_batch if self._host.batch_step is not None else WARM_ROWS) if on_cuda() else 0
        sizes = range(1, min(rows, self.max_batch) + 1)
        if not sizes:
            return
        model = self._host.language_model
        with self._host.counted_step():
            batch = Batch()
            for size in sizes:
                while len(batch) < size:
                    caches = model.make_cache(self.context_len)
                    mx.eval(model(mx.zeros((1, 1), mx.int32), cache=caches))
                    batch.add(_WARM_ROW, caches)
                logits = batch.logits(model, mx.zeros((size, 1), mx.int32), self._host.batch_step)
                mx.eval(mx.argmax(logits, axis=-1))

    def run_turn(self, requests: Sequence[Request] = ()) -> None:
        """One turn of the loop on the caller's thread, `requests` queued first: for a scheduler
        driven from outside, whose every turn must be the same on several processes (the ranks of a
        distributed server: `pymlxc/server/ranks.py`), never beside `submit`'s own thread. A turn
        that raises fails the requests it held (as the loop's own turns do), then raises."""
        with self._lock:
            if self._thread is not None:
                raise RuntimeError("this scheduler runs its own loop (submit); run_turn would race it")
            if self._stopping:
                raise ModelClosedError("the model is closed")
            self._driven = True
            self._queue.extend(requests)
        self._counted_turn()

    def idle(self) -> bool:
        """Nothing queued, prefilling or decoding."""
        with self._lock:
            return not self._queue and not self.running()

    def running(self) -> int:
        """Rows decoding or prefilling now."""
        return len(self._batch) + len(self._prefilling)

    def stats(self) -> dict[str, int]:
        return {"running": len(self._batch), "prefilling": len(self._prefilling), "queued": len(self._queue),
                "steps": self.steps, "peak_rows": self.peak_rows, "grouped": self.grouped}

    def close(self, timeout: float = 30.0) -> None:
        """Stop the loop (after its running step); requests left get ModelClosedError."""
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        self._fail_all(ModelClosedError("the model was closed"))

    # ------------------------------------------------------------------ the loop
    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._stopping and not self._queue and not self.running():
                    self._lock.wait(0.5)
                if self._stopping:
                    break
            try:
                self._counted_turn()
            except ModelClosedError:
                break
            except Exception:  # noqa: BLE001, S112 - a failed step fails its requests, not the loop
                continue
        self._fail_all(ModelClosedError("the model was closed"))

    def _counted_turn(self) -> None:
        """One turn as a counted step of the model; one that raises fails the requests it held,
        then raises."""
        try:
            with self._host.counted_step():
                self._turn()
        except Exception as exc:
            self._fail_all(exc)
            raise

    def _turn(self) -> None:
        self._admit()
        if self._ahead is not None and (self._prefilling or any(r.request.cancelled for r in self._batch.rows)):
            self._settle()
        self._drop_cancelled()
        group = self._group()
        if len(group) > 1:
            self._prefill_group(group)
        elif self._prefilling:
            self._prefill_chunk(self._prefilling[0])
        if len(self._batch):
            self._decode_step()

    def _admit(self) -> None:
        vocab = self._host.vocab_size
        while True:
            with self._lock:
                if not self._queue or self.running() >= self.max_batch:
                    return
                request = self._queue.popleft()
            if request.cancelled:
                request.send(Event(finish="cancelled"))
                continue
            try:
                row = _make_row(request, vocab)
            except Exception as exc:  # noqa: BLE001 - a bad request fails alone
                request.send(Event(finish="error", error=exc))
                continue
            row.max_tokens = request.params.max_tokens
            if self.context_len is not None and self.context_len - len(request.prompt) < row.max_tokens:
                row.max_tokens = self.context_len - len(request.prompt)
                row.context_bound = True
            if row.max_tokens <= 0:
                request.send(Event(finish="length", error=_context_full(row, self.context_len)))
                continue
            self._prefilling.append(row)

    def _drop_cancelled(self) -> None:
        for row in [r for r in self._prefilling if r.request.cancelled]:
            self._prefilling.remove(row)
            row.cache = None
            row.request.send(Event(finish="cancelled"))
        gone = [r for r in self._batch.rows if r.request.cancelled]
        if gone:
            self._batch.remove(gone)
            for row in gone:
                row.request.send(Event(finish="cancelled"))

    def _group(self) -> list[_Row]:
        """The waiting prompts that go through the model together this turn: from the oldest on,
        those whose uncached part (past the prompt cache's prefix) fits one chunk, while the group,
        left-padded to its longest uncached part, holds at most GROUP_CHUNKS chunks' tokens. A
        longer prompt is prefilled alone, a chunk a turn."""
        group: list[_Row] = []
        width = 0
        for row in self._prefilling:
            if not row.started:
                row.started = True
                row.cache, row.done_tokens = self._host.restore_prefix(row.request.prompt)
            rest = len(row.request.prompt) - row.done_tokens
            # A recurrent state cannot be cut back to an earlier position: such a model groups only
            # prompts that start from nothing (a row with a cached prefix is prefilled alone).
            if (self._recurrent and row.done_tokens) or row.checked or row.alone or rest > self.prefill_step \
                    or max(width, rest) * (len(group) + 1) > GROUP_CHUNKS * self.prefill_step:
                continue
            group.append(row)
            width = max(width, rest)
        return group

    def _prefill_group(self, rows: list[_Row]) -> None:
        """Prefill `rows` in one forward pass of `width` columns (their longest uncached part):
        each row feeds its last `width` prompt tokens (all of a shorter prompt, left-padded) on
        top of its cached prefix of the tokens before them (the prompt cache's, cut to that
        length), in a batch of their own whose columns line up the rows' ends, each row at its
        own RoPE positions and padding masked out; that batch then joins the running one. Their
        first tokens are sampled from the last column's logits, as a prefill alone samples them.
        Where the group cannot run (the memory check, an error), its rows go back to being
        prefilled one by one."""
        host, model = self._host, self._host.language_model
        prompts = [r.request.prompt for r in rows]
        width = max(len(p) - r.done_tokens for p, r in zip(prompts, rows, strict=True))
        held = [max(0, len(p) - width) for p in prompts]  # each row's tokens before its chunk
        prefixes: list[list[Any]] = []
        for row, n in zip(rows, held, strict=True):
            cut = pcache.restore(row.cache or (), n) if n else model.make_cache(self.context_len)
            if cut is None:  # a cached prefix that cannot be cut at that length
                self._ungroup(rows)
                return
            prefixes.append(cut)
        pads = np.array([max(0, width - len(p)) for p in prompts])
        tokens = mx.array([[p[0]] * int(pad) + p[-width:] for p, pad in zip(prompts, pads, strict=True)],
                          dtype=mx.int32)
        group = Batch()
        if any(held):
            group.caches = _prefix_caches(prefixes, held, pads, group.columns)
        else:
            group.caches = _prompts_caches(prefixes[0], pads, group.columns)
        start = group.attention_caches()[0].idx if group.attention_caches() else 0
        try:
            logits = loops.prefill(model, tokens, group.caches, step=width, finish=lambda x: x,
                                   new_tokens=max(r.request.params.max_tokens for r in rows))
            if logits is None:
                raise RuntimeError("the prefill of a group's prompts returned no logits")
            mx.eval(logits, [c.state for c in group.caches])
        except (ModelClosedError, GenerationCancelled):
            raise
        except Exception:  # noqa: BLE001 - each prompt alone then meets its own check and error
            self._ungroup(rows)
            return
        # The recurrent layers' windows and states (the padding masked out of them) join as the batch's.
        group.caches = [BatchRecurrentCache.of(c) if isinstance(c, RecurrentCache) else c for c in group.caches]
        group.rows = list(rows)
        self.grouped += len(rows)
        for row in rows:
            self._prefilling.remove(row)
            row.checked = True
            row.cache = None
        if host.keeps_prefixes:
            kept = [_row_caches(prefix, group.caches, b, start + int(pads[b]), width - int(pads[b]))
                    for b, prefix in enumerate(prefixes)]
            mx.eval([c.state for caches in kept for c in caches])  # no lazy graph outlives this thread
            for prompt, caches in zip(prompts, kept, strict=True):
                host.keep_prefix(prompt, caches)
        results = self._sample(rows, logits)
        keep = [b for b, (row, (token, logprob, top)) in enumerate(zip(rows, results, strict=True))
                if self._record(row, token, logprob, top)]
        if len(keep) < len(rows):
            group.take(keep)
        self._batch.extend(group)
        self.peak_rows = max(self.peak_rows, len(self._batch))

    @staticmethod
    def _ungroup(rows: Sequence[_Row]) -> None:
        """Send `rows` to the prefill alone (their restored caches are untouched), which makes each
        one's own memory check and meets its own errors."""
        for row in rows:
            row.alone = True

    def _prefill_chunk(self, row: _Row) -> None:
        """One chunk of `row`'s prompt; after the last, its first token and its place in the batch."""
        request, host = row.request, self._host
        model = host.language_model
        ids = request.prompt
        try:
            if not row.started:
                row.started = True
                row.cache, row.done_tokens = host.restore_prefix(ids)
            cache = row.cache
            if cache is None:  # set at the row's first chunk, released once it joins the batch
                raise RuntimeError("a row still in prefill has no cache")
            start = row.done_tokens
            stop = min((start // self.prefill_step + 1) * self.prefill_step, len(ids))
            last = stop == len(ids)
            tokens = mx.array([ids[:stop]], dtype=mx.int32)
            first_chunk = not row.checked
            row.checked = True
            logits = loops.prefill(model, tokens, cache, step=self.prefill_step, start=start,
                                   finish=(lambda x: x) if last else None,
                                   # the caller's max_tokens: the check caps the caches at context_len
                                   # itself, and its message names what the caller asked for
                                   new_tokens=request.params.max_tokens if first_chunk else None)
            row.done_tokens = stop
            if not last:
                return
            if logits is None:
                raise RuntimeError("the prefill of a prompt's last chunk returned no logits")
            self._prefilling.popleft()
            host.keep_prefix(ids, cache)
            token, logprob, top = self._sample([row], logits)[0]
            if self._record(row, token, logprob, top):
                self._batch.add(row, cache)
                self.peak_rows = max(self.peak_rows, len(self._batch))
            row.cache = None
        except (ModelClosedError, GenerationCancelled):
            raise
        except Exception as exc:  # noqa: BLE001 - this request fails, the batch goes on
            if row in self._prefilling:
                self._prefilling.remove(row)
            row.cache = None
            request.send(Event(finish="error", error=exc))

    def _decode_step(self) -> None:
        look_ahead = not self._prefilling and all(r.plain for r in self._batch.rows)
        if self._ahead is not None and not look_ahead:
            self._settle()
            if not len(self._batch):
                return
        rows = list(self._batch.rows)
        model = self._host.language_model
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            inputs = mx.expand_dims(ahead, 1)
        else:
            inputs = mx.array([[r.generated[-1]] for r in rows], dtype=mx.int32)
        logits = self._batch.logits(model, inputs, self._host.batch_step)
        self.steps += 1
        if look_ahead:
            following = self._greedy(rows, logits)
            mx.async_eval(following)
            if ahead is not None:
                keep = self._report(rows, ahead.tolist())
                if len(keep) < len(rows) and keep:
                    following = mx.take(following, mx.array(np.array(keep, dtype=np.int32)), axis=0)
                if not keep:
                    return
            self._ahead = following
            return
        results = self._sample(rows, logits)
        finished = [row for row, (token, logprob, top) in zip(rows, results, strict=True)
                    if not self._record(row, token, logprob, top)]
        self._batch.remove(finished)

    def _greedy(self, rows: Sequence[_Row], logits: mx.Array) -> mx.Array:
        """The argmax ids [B] (int32, lazy) of plain rows' logits [B, V], each after its own logit
        bias: the rows' biased ids and amounts as [B, K] arrays (a row with fewer repeats its first
        pair, which writes the same value again; a row with none adds 0 to id 0), uploaded once per
        set of rows, not per step."""
        last = self._bias_rows  # held, so no id of theirs is reused by a later row
        if len(last) != len(rows) or any(a is not b for a, b in zip(last, rows, strict=False)):
            self._bias_rows = tuple(rows)
            self._bias = _batch_bias(rows)
        if self._bias is not None:
            ids, amounts = self._bias
            seen = mx.take_along_axis(logits, ids, axis=-1)
            logits = mx.put_along_axis(logits, ids, seen + amounts.astype(logits.dtype), axis=-1)
        return mx.argmax(logits, axis=-1).astype(mx.int32)

    def _settle(self) -> None:
        """Read back and report the step in flight (the look-ahead's ids)."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            self._report(list(self._batch.rows), ahead.tolist())

    def _report(self, rows: Sequence[_Row], ids: Sequence[int]) -> list[int]:
        """Record each row's greedy id; drop the rows that finished; return the kept rows' indices."""
        keep = [i for i, (row, token) in enumerate(zip(rows, ids, strict=True))
                if self._record(row, int(token), None, ())]
        if len(keep) < len(rows):
            kept = set(keep)
            self._batch.remove([row for i, row in enumerate(rows) if i not in kept])
        return keep

    def _sample(self, rows: Sequence[_Row],
                logits: mx.Array) -> list[tuple[int, float | None, tuple[tuple[int, float], ...]]]:
        """Each row's next id (and log-probabilities where asked) from logits [B, V]."""
        plain = [i for i, r in enumerate(rows) if r.plain]
        outputs: list[Any] = [None] * len(rows)
        extras: dict[int, tuple[mx.Array, mx.Array, mx.Array]] = {}
        if len(plain) == len(rows):
            ids = self._greedy(rows, logits).tolist()
            return [(int(t), None, ()) for t in ids]
        if plain:
            plain_logits = mx.take(logits, mx.array(np.array(plain, dtype=np.int32)), axis=0)
            chosen = self._greedy([rows[i] for i in plain], plain_logits)
        plain_rows = set(plain)
        for i, row in enumerate(rows):
            if i in plain_rows:
                continue
            try:
                row_logits = row.process(logits[i:i + 1])
            except Exception as exc:  # noqa: BLE001 - e.g. its grammar's mask failed: this request fails alone
                row.failed = exc
                continue
            token = row.sampler(row_logits)
            outputs[i] = token
            k = row.params.logprobs
            if k is not None:
                logp = row_logits.astype(mx.float32)
                logp = logp - mx.logsumexp(logp, axis=-1, keepdims=True)
                picked = mx.take_along_axis(logp, mx.expand_dims(token, 1), axis=-1)
                top = mx.argsort(-logp, axis=-1)[:, :k] if k else mx.zeros((1, 0), mx.int32)
                extras[i] = (picked, top, mx.take_along_axis(logp, top, axis=-1) if k else top)
        evaluated = [outputs[i] for i in range(len(rows)) if outputs[i] is not None]
        mx.eval(evaluated + [v for e in extras.values() for v in e] + ([chosen] if plain else []))
        result: list[tuple[int, float | None, tuple[tuple[int, float], ...]]] = [(0, None, ())] * len(rows)
        if plain:
            for i, t in zip(plain, chosen.tolist(), strict=True):
                result[i] = (int(t), None, ())
        for i, token in enumerate(outputs):
            if token is None:
                continue
            t = int(token.tolist()[0])
            if i in extras:
                picked, top, top_lp = extras[i]
                pairs = tuple(zip((int(x) for x in top.tolist()[0]), (float(x) for x in top_lp.tolist()[0]),
                                  strict=True))
                result[i] = (t, float(picked.tolist()[0][0]), pairs)
            else:
                result[i] = (t, None, ())
        return result

    def _record(self, row: _Row, token: int, logprob: float | None, top: tuple[tuple[int, float], ...]) -> bool:
        """Report `token` of `row`; False where the row is finished."""
        request = row.request
        if row.failed is not None:
            request.send(Event(finish="error", error=row.failed))
            return False
        if request.cancelled:
            request.send(Event(finish="cancelled"))
            return False
        if token in request.params.stop_ids:
            request.send(Event(finish="stop"))
            return False
        constraint = request.constraint
        try:
            if constraint is not None:
                constraint.advance(token)
        except Exception as exc:  # noqa: BLE001 - the grammar refused: this request fails alone
            request.send(Event(finish="error", error=exc))
            return False
        row.generated.append(token)
        row.counts[token] += 1
        if not request.send(Event(token=token, logprob=logprob, top_logprobs=top)):
            return False
        try:
            done = constraint is not None and constraint.done()
        except Exception as exc:  # noqa: BLE001 - as a refused token: this request fails alone
            request.send(Event(finish="error", error=exc))
            return False
        if done:
            request.send(Event(finish="stop"))
            return False
        if len(row.generated) >= row.max_tokens:
            request.send(Event(finish="length", error=_context_full(row, self.context_len)))
            return False
        return True

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            queued = list(self._queue)
            self._queue.clear()
        rows = list(self._prefilling) + list(self._batch.rows)
        self._prefilling.clear()
        self._batch = Batch()
        self._ahead = None
        for request in queued + [r.request for r in rows]:
            request.send(Event(finish="error", error=exc))


def _context_full(row: _Row, context_len: int | None) -> ContextFull | None:
    """Why a row that ends by length ended early: where the context, not its max_tokens, bound it."""
    if not row.context_bound or context_len is None:
        return None
    return ContextFull(context_full_problem(len(row.request.prompt), len(row.generated), context_len,
                                            row.request.params.max_tokens))


# ---------------------------------------------------------------------- waiting for results

class Collector:
    """`emit` target that gathers a request's events; `wait()` returns them once it finished."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self._done = threading.Event()

    def __call__(self, event: Event) -> None:
        if self._done.is_set():
            return
        self.events.append(event)
        if event.finish is not None:
            self._done.set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    @property
    def finished(self) -> bool:
        return self._done.is_set()

    def tokens(self) -> list[int]:
        return [e.token for e in self.events if e.token is not None]

    def finish(self) -> Event | None:
        return self.events[-1] if self.events and self.events[-1].finish is not None else None


def run_all(scheduler: Scheduler, requests: Sequence[tuple[Request, Collector]], guard: loops.Guard) -> None:
    """Submit every request and wait for all, cancelling them where `guard` trips (it raises then)."""
    guard.check()
    scheduler.submit_all([request for request, _ in requests], bounded=False)
    try:
        for _, collector in requests:
            while not collector.wait(0.05):
                guard.check()
    except BaseException:
        for request, _ in requests:
            request.cancel()
        for _, collector in requests:
            collector.wait(5.0)
        raise

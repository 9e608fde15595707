"""The prompt cache of the metal backend: generation with a restored cache gives exactly the tokens of a
full prefill (plain caches, sliding-window layers, a context bound), hits skip the prefix's prefill,
the LRU bounds, files round-trip and files of other models are refused.

The rotating-cache property test states what `RotatingKVCache.prefix` promises: without sinks, a
restored state followed by any chunks shows every query exactly its window; with sinks, the same as
a cache that saw the prefix in one chunk; and the source cache is never changed.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reliability.hostile_safetensors import CASE_IDS, write_case, write_safetensors
from reliability.subproc import run_case

import pymlxc
import pymlxc.core as mx
from pymlxc.backends.metal import generate as loops
from pymlxc.backends.metal.cache import CONTEXT_KEEP, RotatingKVCache
from pymlxc.backends.metal.prompt_cache import PromptCache, PromptCacheError
from pymlxc.backends.metal.sample import make_sampler
from pymlxc.testing import write_tiny_model
from pymlxc.types import ContextLengthError

CTX = 24  # the context bound of the "llama_ctx" case: shorter than the prompts
WINDOW = 8  # gemma3's sliding window in these tests
PREFIX = ("Once upon a time there was a small town by the river, and in that town lived a baker who woke "
          "before the sun every morning")
REST = " and baked bread, cakes and little pastries for the whole street"
OTHER = " and counted the coins in her drawer before she locked the door"
GREEDY = make_sampler(0.0, 0, 0.0, 0.0)


# ---------------------------------------------------------------------- RotatingKVCache.prefix

def _feed(cache: RotatingKVCache, start: int, n: int, window: int | None) -> list[set[int]]:
    """Feed positions start..start+n-1 (keys hold their position); what each query may attend to."""
    pos = np.arange(start, start + n, dtype=np.float32)[None, None, :, None]
    mask = cache.make_mask(n, window)
    keys, _ = cache.update_and_fetch(mx.array(pos), mx.array(-pos))
    held = np.rint(np.asarray(keys)[0, 0, :, 0]).astype(int)
    s = len(held)
    if mask is None:
        allowed = np.ones((n, s), bool)
    elif isinstance(mask, str):
        allowed = np.arange(s)[None, :] <= np.arange(s - n, s)[:, None]
    else:
        allowed = np.broadcast_to(np.asarray(mask).reshape(-1, s), (n, s))
    return [set(held[allowed[i]].tolist()) for i in range(n)]


def _run(cache: RotatingKVCache, start: int, chunks: list[int], window: int | None) -> list[set[int]]:
    seen = []
    for n in chunks:
        seen += _feed(cache, start, n, window)
        start += n
    return seen


chunk_lists = st.lists(st.integers(1, 12), min_size=1, max_size=5)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(max_size=st.integers(2, 10), keep=st.sampled_from([0, 2]), first=chunk_lists, then=chunk_lists, data=st.data())
def test_rotating_prefix_restores_a_state_later_chunks_cannot_tell_apart(max_size: int, keep: int, first: list[int],
                                                                        then: list[int], data: Any) -> None:
    keep = min(keep, max_size - 1)
    window = max_size if keep == 0 else None  # a sliding layer (no sinks), or a context-bounded one
    source = RotatingKVCache(max_size, keep)
    _run(source, 0, first, window)
    p = source.offset
    before = [np.asarray(a).copy() for a in source.state]
    assert keep or source.prefix(p) is not None  # without sinks the current state can always be taken
    n = data.draw(st.integers(1, p))
    restored = source.prefix(n)
    if source._idx == p and n <= max_size:  # nothing evicted yet: every prefix is there
        assert restored is not None
    if restored is None:
        return
    assert restored.offset == n
    got = _run(restored, n, then, window)
    if keep == 0:  # exactly the window, however the tokens were chunked
        q = np.arange(n, n + sum(then))
        assert got == [set(range(max(0, x - max_size + 1), x + 1)) for x in q]
    else:  # as after the prefix in one chunk
        reference = RotatingKVCache(max_size, keep)
        _run(reference, 0, [n], window)
        assert got == _run(reference, n, then, window)
    assert all(np.array_equal(a, b) for a, b in zip(before, (np.asarray(x) for x in source.state), strict=True))


# ---------------------------------------------------------------------- models

CASES: dict[str, tuple[str, dict[str, Any], int]] = {
    # name: (architecture, extra config, context_len)
    "llama": ("llama", {}, 131072),
    "gemma3": ("gemma3_text", {"sliding_window": WINDOW}, 131072),
    "llama_ctx": ("llama", {}, CTX),
}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("prompt-cache")
    return {
        "llama": write_tiny_model(root / "llama", "llama", seed=3),
        "gemma3": write_tiny_model(root / "gemma3", "gemma3_text", seed=3, extra_config={"sliding_window": WINDOW}),
        "llama_other": write_tiny_model(root / "llama-other", "llama", seed=4),
        "qwen3": write_tiny_model(root / "qwen3", "qwen3", seed=3),
    }


@pytest.fixture(scope="module")
def models(dirs: dict[str, Path]):
    """Per case: (a model with the prompt cache, the same model without it)."""
    opened: dict[str, Any] = {}

    def get(case: str) -> tuple[Any, Any]:
        if case not in opened:
            path = str(dirs["gemma3" if case == "gemma3" else "llama"])
            ctx = CASES[case][2]
            opened[case] = (pymlxc.load_model(path, backend="metal", context_len=ctx),
                            pymlxc.load_model(path, backend="metal", context_len=ctx, prompt_cache_entries=0))
        cached, plain = opened[case]
        cached.prompt_cache.clear()
        return cached, plain

    yield get
    for pair in opened.values():
        for m in pair:
            m.close()


def ids(stream) -> list[int]:
    return [t.id for t in stream]


def test_the_prompts_cross_the_window_and_the_context_bound(models) -> None:
    m, _ = models("llama")
    prefix = m.encode(PREFIX)
    assert len(prefix) > WINDOW and len(prefix) > CTX
    assert m.encode(PREFIX + REST)[: len(prefix)] == prefix  # REST starts a new word: the tokens add up


@pytest.mark.parametrize("case", list(CASES))
def test_restoring_a_generation_state_gives_the_tokens_of_a_full_prefill(models, case: str) -> None:
    """The state a generation leaves (prompt + generated tokens, decode steps included) restored
    for a prompt that continues it; a rotating cache that cannot go back is a miss."""
    m, _ = models(case)
    net, ctx = m.model, CASES[case][2]
    prompt = m.encode(PREFIX)
    cache, sampled = net.make_cache(ctx), []
    list(loops.generate_ids(net, prompt, cache=cache, sampler=GREEDY, max_tokens=12, sampled_ids=sampled))
    seen = (prompt + sampled)[: cache[0].offset]
    store = PromptCache()
    # Past the context bound with sinks nothing can come back: such a state is not even kept.
    assert store.store(seen, cache) == (case != "llama_ctx")
    for full in (seen + m.encode(REST), prompt[:20] + m.encode(OTHER)):
        reference = list(loops.generate_ids(net, full, cache=net.make_cache(ctx), sampler=GREEDY, max_tokens=12))
        found = store.lookup(full, len(full) - 1)
        common = 20 if full[20] != seen[20] else len(seen)
        if case == "llama":  # plain caches trim to any prefix
            assert found is not None and found[1] == common
        elif case == "gemma3":  # the sliding layers hold the last window only: only the end comes back
            assert (found is not None) == (common == len(seen))
        else:
            assert found is None
        restored, cached = found if found is not None else (net.make_cache(ctx), 0)
        got = list(loops.generate_ids(net, full, cache=restored, cached=cached, sampler=GREEDY, max_tokens=12))
        assert got == reference
    assert [n for n, _ in store.entries()] == ([len(seen)] if case != "llama_ctx" else [])  # entries unchanged


@pytest.mark.parametrize("case", list(CASES))
def test_a_warm_prefix_gives_the_tokens_of_generation_without_the_cache(models, case: str) -> None:
    m, plain = models(case)
    short = PREFIX.split(" by the river")[0]  # fewer tokens than the context bound
    assert len(m.encode(short)) < CTX
    # With the context bound, prompts that fit it after `short` (words: the tokens add up).
    rests = (REST, OTHER) if case != "llama_ctx" else (REST[:10], OTHER[:12])
    for prefix in (PREFIX, short):
        m.prompt_cache.clear()
        n = m.warm_prompt_cache(prefix)
        restorable = case != "llama_ctx" or len(m.encode(prefix)) <= CTX
        # What was cached: nothing for a prefix past the context bound (such states are not kept).
        assert n == (len(m.encode(prefix)) if restorable else 0)
        assert [t for t, _ in m.prompt_cache.entries()] == ([n] if restorable else [])
        for rest in rests:
            if m.prompt_length(prefix + rest) > CASES[case][2]:  # refused before the prompt cache is looked at
                with pytest.raises(ContextLengthError):
                    m.generate(prefix + rest, max_tokens=16)
                assert not restorable
                continue
            got = ids(m.generate(prefix + rest, max_tokens=16))
            assert m.err() is None
            assert got == ids(plain.generate(prefix + rest, max_tokens=16))
            metrics = m.metrics()
            assert metrics.prompt_cache_hits == (1 if restorable else 0)
            assert metrics.prompt_cache_misses == (0 if restorable else 1)
            assert metrics.prompt_cache_hit_tokens >= (n if restorable else 0)


@pytest.mark.parametrize("prefix, message", [
    # None used to raise "'NoneType' object is not iterable".
    (None, "^prefix must be text, token ids, or chat messages, not NoneType"),
    (b"abc", "^prefix must be text, token ids, or chat messages, not bytes"),
    ({"role": "user", "content": "x"}, "^prefix must be .* not dict"),  # one message, not a list of them
    ([1, {"role": "user", "content": "x"}], "^prefix must be text, token ids, or chat messages, not a mix"),
])
def test_a_bad_warm_prefix_raises_naming_it(models, prefix, message) -> None:
    m, _ = models(next(iter(CASES)))
    with pytest.raises(TypeError, match=message):
        m.warm_prompt_cache(prefix)
    assert m.warm_prompt_cache([1, 2, 3]) == 3


def test_an_empty_warm_prefix_is_named(models) -> None:
    m, _ = models(next(iter(CASES)))
    with pytest.raises(ValueError, match=r"^the prefix encodes to no tokens"):
        m.warm_prompt_cache([])


def test_chat_reuses_the_conversation_so_far(models) -> None:
    m, plain = models("llama")
    history = [{"role": "system", "content": PREFIX}, {"role": "user", "content": "What is two plus two?"}]
    assert m.warm_prompt_cache(history[:1]) > 0
    first = list(m.chat(history, max_tokens=10))
    assert m.metrics().prompt_cache_hits == 1
    assert [t.id for t in first] == ids(plain.chat(history, max_tokens=10))
    follow = [*history, {"role": "assistant", "content": "".join(t.text for t in first)},
              {"role": "user", "content": "And three plus three?"}]
    assert ids(m.chat(follow, max_tokens=10)) == ids(plain.chat(follow, max_tokens=10))
    assert m.metrics().prompt_cache_hit_tokens > len(m.encode(PREFIX))


class CountingModel:
    """The model, counting the tokens of multi-token forward passes (prefill chunks)."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.prefilled = inner, 0

    def __call__(self, inputs: Any, cache: Any = None, mask: Any = None, **kw: Any) -> Any:
        if inputs.shape[1] > 1:
            self.prefilled += inputs.shape[1]
        return self.inner(inputs, cache=cache, mask=mask, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_a_hit_skips_the_prefill_of_the_prefix(models, monkeypatch: pytest.MonkeyPatch) -> None:
    from pymlxc.backends.metal.decode import prefill

    m, _ = models("llama")
    counting = CountingModel(m.model)
    m._model = counting
    # The segmented decode's prefill (a GPU's default) runs the chunks without the model's forward.
    run = prefill.PrefillRunner.__call__

    def counted(self: Any, tokens: Any, *args: Any) -> Any:
        counting.prefilled += tokens.shape[1]
        return run(self, tokens, *args)

    monkeypatch.setattr(prefill.PrefillRunner, "__call__", counted)
    try:
        prefix, prompt = m.encode(PREFIX), m.encode(PREFIX + REST)
        list(m.generate(PREFIX + REST, max_tokens=4))
        miss = m.metrics()
        assert (miss.prompt_cache_misses, miss.prompt_cache_hit_tokens) == (1, 0)
        assert counting.prefilled == len(prompt)  # the first token is sampled from the prefill's logits
        m.prompt_cache.clear()
        counting.prefilled = 0
        m.warm_prompt_cache(PREFIX)
        assert counting.prefilled == len(prefix)
        counting.prefilled = 0
        list(m.generate(PREFIX + REST, max_tokens=4))
        hit = m.metrics()
        assert (hit.prompt_cache_hits, hit.prompt_cache_hit_tokens) == (1, len(prefix))
        assert counting.prefilled == len(prompt) - len(prefix)
        assert hit.prompt_tokens == len(prompt) and hit.prompt_cache_restore_duration > 0
    finally:
        m._model = counting.inner


def test_lru_eviction_by_entries_and_bytes(models) -> None:
    m, _ = models("llama")
    cache = m.prompt_cache
    prompts = {name: f"{name} {PREFIX}" for name in ("Alpha", "Bravo", "Charlie")}

    def hit_tokens(name: str) -> int:
        list(m.generate(prompts[name], max_tokens=4))
        return m.metrics().prompt_cache_hit_tokens

    full = {name: len(m.encode(p)) - 1 for name, p in prompts.items()}
    try:
        cache.resize(2, 1 << 30)
        for name in ("Alpha", "Bravo", "Alpha", "Charlie"):  # Alpha used again: Bravo is the least recent
            hit_tokens(name)
        assert len(cache) == 2
        assert hit_tokens("Alpha") == full["Alpha"]
        assert hit_tokens("Charlie") == full["Charlie"]
        assert hit_tokens("Bravo") < full["Bravo"]  # evicted: at most the shared first token
        one = max(b for _, b in cache.entries())
        cache.resize(8, one + one // 2)  # bytes for one entry: the older ones go now
        assert len(cache) == 1 and cache.nbytes <= one + one // 2
        assert hit_tokens("Bravo") == full["Bravo"]
        cache.resize(8, one - 1)  # nothing fits: nothing is kept
        hit_tokens("Alpha")
        assert len(cache) == 0
    finally:
        cache.resize(8, 2 << 30)


@pytest.mark.parametrize("case", ["llama", "gemma3"])
def test_abandoned_and_stopped_streams_leave_usable_entries(models, case: str) -> None:
    m, plain = models(case)
    expected = ids(plain.generate(PREFIX, max_tokens=20))
    stream = m.generate(PREFIX, max_tokens=20)
    assert [next(stream).id for _ in range(3)] == expected[:3]
    stream.close()
    assert ids(m.generate(PREFIX, max_tokens=20)) == expected
    # The entry went past the prompt; sliding-window layers cannot go back to its end.
    assert m.metrics().prompt_cache_hits == (case == "llama")
    stop = expected[6]
    cut = expected[: expected.index(stop)]
    assert ids(m.generate(PREFIX, max_tokens=20, stop_tokens=[stop])) == cut
    assert ids(m.generate(PREFIX + REST, max_tokens=20)) == ids(plain.generate(PREFIX + REST, max_tokens=20))


def test_off_and_changed_weights(models, dirs) -> None:
    _, plain = models("llama")
    assert plain.warm_prompt_cache(PREFIX) == 0
    list(plain.generate(PREFIX, max_tokens=2))
    metrics = plain.metrics()
    assert (metrics.prompt_cache_hits, metrics.prompt_cache_misses, len(plain.prompt_cache)) == (0, 0, 0)
    with pymlxc.load_model(str(dirs["llama"]), backend="metal") as m:
        m.warm_prompt_cache(PREFIX)
        m.apply_lora()  # other weights (even with B = 0): the entries are dropped
        list(m.generate(PREFIX + REST, max_tokens=2))
        assert m.metrics().prompt_cache_misses == 1


def test_save_and_load_round_trip(models, dirs, tmp_path: Path) -> None:
    m, plain = models("gemma3")
    m.warm_prompt_cache(PREFIX)
    list(m.generate(PREFIX + OTHER, max_tokens=8))
    file = tmp_path / "cache.safetensors"
    assert m.save_prompt_cache(file) == len(m.prompt_cache) == 2
    _, metadata = mx.load_safetensors(str(file))
    assert metadata["model_type"] == "gemma3_text" and len(metadata["fingerprint"]) == 64
    saved = json.loads(metadata["entries"])
    assert [len(e["tokens"]) for e in saved] == [n for n, _ in m.prompt_cache.entries()]
    assert saved[0]["tokens"] == m.encode(PREFIX)
    with pymlxc.load_model(str(dirs["gemma3"]), backend="metal") as fresh:
        assert fresh.load_prompt_cache(file) == 2
        assert fresh.prompt_cache.entries() == m.prompt_cache.entries()
        assert ids(fresh.generate(PREFIX + REST, max_tokens=12)) == ids(plain.generate(PREFIX + REST, max_tokens=12))
        assert fresh.metrics().prompt_cache_hit_tokens == len(m.encode(PREFIX))


def test_a_file_of_another_model_is_refused(models, dirs, tmp_path: Path) -> None:
    m, _ = models("llama")
    m.warm_prompt_cache(PREFIX)
    file = tmp_path / "llama.safetensors"
    m.save_prompt_cache(file)
    refusals = [("qwen3", {}, "made by a 'llama' model; this model is 'qwen3'"),
                ("llama_other", {}, "another llama model"),
                ("llama", {"context_len": CTX}, "context_len")]
    for name, options, message in refusals:
        with pymlxc.load_model(str(dirs[name]), backend="metal", **options) as other:
            other.warm_prompt_cache("hello")
            before = other.prompt_cache.entries()
            with pytest.raises(PromptCacheError, match=message):
                other.load_prompt_cache(file)
            assert other.prompt_cache.entries() == before
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file")
    with pytest.raises(PromptCacheError, match=rf"^prompt cache file {re.escape(str(junk))}: not a safetensors file"):
        m.load_prompt_cache(junk)


# A prompt cache file's safetensors header is checked before MLX's reader opens it: MLX took a dimension
# past int32 as its low 32 bits, and failed on other bad headers with a message naming no tensor.

def test_a_hostile_prompt_cache_file_is_refused_by_name_and_changes_nothing(models, tmp_path: Path) -> None:
    m, _ = models("llama")
    m.warm_prompt_cache(PREFIX)
    before = m.prompt_cache.entries()
    for case in CASE_IDS:
        file = tmp_path / f"{case}.safetensors"
        expected = write_case(file, case, "prompt cache file")
        with pytest.raises(PromptCacheError) as info:
            m.load_prompt_cache(file)
        assert str(info.value).startswith(expected), (case, str(info.value))
        assert m.prompt_cache.entries() == before


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(wraps=st.lists(st.integers(-1, 2), min_size=4, max_size=4), part=st.sampled_from(["keys", "values"]))
def test_a_cache_tensor_loads_with_its_header_shape_or_is_refused(models, tmp_path_factory: pytest.TempPathFactory,
                                                                  wraps: list[int], part: str) -> None:
    """A saved cache whose header adds multiples of 2**32 to a tensor's dimensions (its bytes
    unchanged): MLX's reader took the old shape and the entry loaded. Now it is refused, naming the
    file and the tensor, unless nothing was added."""
    m, _ = models("llama")
    m.warm_prompt_cache(PREFIX[:40])
    root = tmp_path_factory.mktemp("wrapped")
    file = root / "cache.safetensors"
    m.save_prompt_cache(file)
    name = f"0.0.{part}"
    raw = file.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    header[name]["shape"] = [d + k * 2**32 for d, k in zip(header[name]["shape"], wraps, strict=True)]
    write_safetensors(file, header, raw[8 + n:])
    m.prompt_cache.clear()
    if not any(wraps):
        assert m.load_prompt_cache(file) == 1
        return
    with pytest.raises(PromptCacheError, match=rf"^tensor '{name}' in {re.escape(str(file))} has a "):
        m.load_prompt_cache(file)
    assert len(m.prompt_cache) == 0


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs (POSIX)")
def test_special_files_are_refused_as_prompt_caches_unread(dirs, tmp_path: Path) -> None:
    """A FIFO would block MLX's open forever, /dev/zero never ends: in a child, so that a hang fails
    one test, each (and a directory) is a PromptCacheError naming the file."""
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "dir").mkdir()
    (tmp_path / "zero").symlink_to("/dev/zero")
    kinds = {"fifo": "FIFO (named pipe)", "dir": "directory", "zero": "character device"}
    got = run_case(f"""
import pymlxc
out = []
with pymlxc.load_model({str(dirs["llama"])!r}, backend="metal") as m:
    for name in {list(kinds)!r}:
        try:
            m.load_prompt_cache({str(tmp_path)!r} + "/" + name)
            out.append("read")
        except Exception as exc:
            out.append([type(exc).__name__, str(exc)])
report(out)
""", timeout=120)
    assert got == [["PromptCacheError", f"prompt cache file {tmp_path / k} is a {kind}, not a regular file"]
                   for k, kind in kinds.items()]


def _tampered(arrays: dict[str, Any], name: str, how: str) -> Any:
    a = arrays[name]
    b, h, n, d = a.shape
    if how == "head_dim":
        return mx.zeros((b, h, n, 999), a.dtype)
    if how == "heads":
        return mx.zeros((b, 7, n, d), a.dtype)
    if how == "batch":
        return mx.zeros((3, h, n, d), a.dtype)
    if how == "rank":
        return mx.zeros((h, n, d), a.dtype)
    return mx.astype(a, {"int8": mx.int8, "float16": mx.float16}[how])


@pytest.mark.parametrize("case", ["llama", "gemma3"])
@pytest.mark.parametrize("how", ["head_dim", "heads", "batch", "rank", "int8", "float16"])
def test_a_tensor_unlike_the_models_is_refused_and_changes_nothing(models, dirs, tmp_path: Path, case: str,
                                                                    how: str) -> None:
    m, plain = models(case)
    m.warm_prompt_cache(PREFIX)
    good = tmp_path / "good.safetensors"
    m.save_prompt_cache(good)
    arrays, metadata = mx.load_safetensors(str(good))
    layers = len(json.loads(metadata["entries"])[0]["layers"])
    for name in ("0.0.keys", f"0.{layers - 1}.values"):
        bad = tmp_path / f"bad-{how}.safetensors"
        mx.save_safetensors(str(bad), {**arrays, name: _tampered(arrays, name, how)}, metadata)
        with pymlxc.load_model(str(dirs[case]), backend="metal") as fresh:
            fresh.warm_prompt_cache(OTHER)
            before = fresh.prompt_cache.entries()
            with pytest.raises(PromptCacheError, match=f"tensor {name}"):
                fresh.load_prompt_cache(bad)
            assert fresh.prompt_cache.entries() == before
            assert fresh.load_prompt_cache(good) == 1  # the untouched file still loads
            assert ids(fresh.generate(PREFIX + REST, max_tokens=8)) == ids(plain.generate(PREFIX + REST, max_tokens=8))
            assert fresh.err() is None and fresh.metrics().prompt_cache_hits == 1


def _poisoned(a: Any, spot: float, value: float) -> Any:
    """`a` with one element, at fraction `spot` of its elements, set to `value`."""
    flat = mx.reshape(a, (-1,))
    at = mx.arange(flat.shape[0]) == int(spot * flat.shape[0])
    return mx.reshape(mx.where(at, mx.array(value, a.dtype), flat), a.shape)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=st.sampled_from(["llama", "gemma3", "llama_ctx"]), value=st.sampled_from([np.nan, np.inf, -np.inf]),
       part=st.sampled_from(["keys", "values"]), layer=st.floats(0, 1, exclude_max=True),
       spot=st.floats(0, 1, exclude_max=True))
def test_a_nan_or_infinity_in_a_tensor_is_refused_by_name(models, dirs, tmp_path_factory: pytest.TempPathFactory,
                                                          case: str, value: float, part: str, layer: float,
                                                          spot: float) -> None:
    """A cache tensor holding NaN or infinity used to load silently (then every answer restoring it
    was garbage): it is refused, naming the file and the tensor, and the cache is unchanged."""
    m, _ = models(case)
    m.warm_prompt_cache(PREFIX[:40])
    root = tmp_path_factory.mktemp("nonfinite")
    good = root / "good.safetensors"
    m.save_prompt_cache(good)
    arrays, metadata = mx.load_safetensors(str(good))
    name = f"0.{int(layer * len(json.loads(metadata['entries'])[0]['layers']))}.{part}"
    bad = root / "bad.safetensors"
    mx.save_safetensors(str(bad), {**arrays, name: _poisoned(arrays[name], spot, value)}, metadata)
    m.prompt_cache.clear()
    message = f"^{re.escape(str(bad))}: the tensor {name} holds NaN or infinite values"
    with pytest.raises(PromptCacheError, match=message):
        m.load_prompt_cache(bad)
    assert len(m.prompt_cache) == 0
    assert m.load_prompt_cache(good) == 1  # the untouched file still loads


# ---------------------------------------------------------------------- files: where and what is read

def test_warm_returns_zero_when_nothing_could_be_kept(dirs) -> None:
    """warm_prompt_cache says how many tokens it cached: it used to give the prefix's length for
    an entry over prompt_cache_bytes, which the cache refused."""
    with pymlxc.load_model(str(dirs["llama"]), backend="metal", prompt_cache_bytes=1000) as m:
        assert m.warm_prompt_cache(PREFIX) == 0
        assert m.prompt_cache.entries() == []
    with pymlxc.load_model(str(dirs["llama"]), backend="metal") as m:
        n = m.warm_prompt_cache(PREFIX)
        assert n == len(m.encode(PREFIX)) == m.prompt_cache.entries()[0][0]
        assert m.warm_prompt_cache(PREFIX) == n  # held already


def test_save_writes_exactly_the_path_given(models, tmp_path: Path) -> None:
    """MLX appends ".safetensors" to a name without it: the file used to land beside the path
    asked for (a directory's sibling for a directory), and a FIFO there blocked the save forever."""
    m, _ = models("llama")
    m.warm_prompt_cache(PREFIX)
    file = tmp_path / "cache.bin"
    assert m.save_prompt_cache(file) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache.bin"]  # no temporary left either
    assert m.load_prompt_cache(file) == 0  # the same entry: kept already
    folder = tmp_path / "folder"
    folder.mkdir()
    with pytest.raises(OSError, match="is a directory, not a regular file"):
        m.save_prompt_cache(folder)
    with pytest.raises(FileNotFoundError, match="no directory"):
        m.save_prompt_cache(tmp_path / "missing" / "cache.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache.bin", "folder"]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs (POSIX)")
def test_save_to_a_fifo_is_refused_without_blocking(dirs, tmp_path: Path) -> None:
    fifo = tmp_path / "cache.safetensors"
    os.mkfifo(fifo)
    kind, message = run_case(f"""
import pymlxc
with pymlxc.load_model({str(dirs["llama"])!r}, backend="metal") as m:
    m.warm_prompt_cache("hello there")
    try:
        m.save_prompt_cache({str(fifo)!r})
        report(["saved", ""])
    except Exception as exc:
        report([type(exc).__name__, str(exc)])
""", timeout=120)
    assert kind == "UnsafeFileError"
    assert message == f"prompt cache file {fifo} is a FIFO (named pipe), not a regular file"


def _edit_entries(src: Path, dst: Path, edit: Any) -> Path:
    arrays, metadata = mx.load_safetensors(str(src))
    entries = json.loads(metadata["entries"])
    edit(entries)
    mx.save_safetensors(str(dst), dict(arrays), {**metadata, "entries": json.dumps(entries)})
    return dst


def _set_meta(entries: list[Any], meta: list[int]) -> None:
    for layer in entries[0]["layers"]:
        layer["meta"] = meta


@pytest.mark.parametrize("edit, message", [
    # Used to be rounded to ints (float, bool) and kept: the caches then answered other tokens.
    (lambda e: e[0].update(tokens=[t + 0.5 for t in e[0]["tokens"]]), "the token ids must be a list of integers"),
    (lambda e: e[0].update(tokens=[True] * len(e[0]["tokens"])), "the token ids must be a list of integers"),
    # Used to escape as OverflowError / AttributeError.
    (lambda e: e[0]["tokens"].__setitem__(0, 10**30), "outside the vocabulary"),
    (lambda e: e[0].update(layers="x"), "layers must be a list of objects"),
    (lambda e: e[0].update(layers=[1, 2]), "layers must be a list of objects"),
    (lambda e: e.__setitem__(0, 5), "entries must be a list of objects"),
    (lambda e: e[0]["layers"][0].update(meta=[1e300]), "meta must be a list of integers"),
    # Rotating states that do not describe the buffer: used to load and give other tokens.
    (lambda e: _set_meta(e, [CONTEXT_KEEP, CTX, len(e[0]["tokens"]), 0]), "rotating cache state"),
    (lambda e: _set_meta(e, [0, CTX, len(e[0]["tokens"]), len(e[0]["tokens"])]), "rotating cache state"),
    (lambda e: _set_meta(e, [CONTEXT_KEEP, CTX - 1, len(e[0]["tokens"]), len(e[0]["tokens"])]), "rotating cache state"),
])
def test_damaged_entries_are_refused_and_change_nothing(models, tmp_path: Path, edit: Any, message: str) -> None:
    m, plain = models("llama_ctx")
    m.warm_prompt_cache(PREFIX[:40])
    good = tmp_path / "good.safetensors"
    m.save_prompt_cache(good)
    bad = _edit_entries(good, tmp_path / "bad.safetensors", edit)
    m.prompt_cache.clear()
    with pytest.raises(PromptCacheError, match=message):
        m.load_prompt_cache(bad)
    assert len(m.prompt_cache) == 0
    fits = PREFIX[:40] + REST[:10]  # within the context bound
    assert ids(m.generate(fits, max_tokens=6)) == ids(plain.generate(fits, max_tokens=6))


def test_a_file_larger_than_the_cache_is_not_read_whole(dirs, tmp_path: Path) -> None:
    """Only the newest entries that fit the cache's bounds are read; the rest are checked, never
    loaded (a file of many entries used to be read whole before all but the last were dropped)."""
    file = tmp_path / "many.safetensors"
    prompts = [f"{PREFIX} number {n} {REST}" * 3 for n in range(8)]
    with pymlxc.load_model(str(dirs["llama"]), backend="metal") as m:
        for p in prompts:
            m.warm_prompt_cache(p)
        assert m.save_prompt_cache(file) == 8
        entry_bytes = max(b for _, b in m.prompt_cache.entries())
    with pymlxc.load_model(str(dirs["llama"]), backend="metal", prompt_cache_entries=1) as m:
        mx.eval(list(m.model.parameters().values()))
        active = mx.get_active_memory()
        mx.reset_peak_memory()
        assert m.load_prompt_cache(file) == 1
        assert mx.get_peak_memory() - active < 3 * entry_bytes
        assert m.prompt_cache.entries()[0][0] == len(m.encode(prompts[-1]))  # the newest one
        list(m.generate(prompts[-1] + " and", max_tokens=2))
        assert m.metrics().prompt_cache_hits == 1
    with pymlxc.load_model(str(dirs["llama"]), backend="metal", prompt_cache_entries=0) as m:
        assert m.load_prompt_cache(file) == 0

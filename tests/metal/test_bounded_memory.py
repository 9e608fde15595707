"""Memory bounded by a chunk and by what a generation holds so far, not by its options.

* classify and inspect_attention prefill as generate does: in chunks, into caches of `context_len`
  (their logits and keys are generate's, padding or not; their peak follows the chunk);
* the compiled decoder's buffers grow as tokens arrive: a short generation's peak does not depend
  on `max_tokens`, and a long one traces once per buffer size with the uncompiled loop's tokens;
* the memory check's estimate of the caches is what they hold.
"""
from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pymlxc
import pymlxc.core as mx
from pymlxc.backends.metal import generate as loops
from pymlxc.backends.metal import memory_check
from pymlxc.backends.metal.decode.decoder import CompiledDecoder
from pymlxc.backends.metal.decode.rings import BUFFER_PAD, BUFFER_STEP, decode_capacity, first_capacity, grown_capacity
from pymlxc.backends.metal.inspection import inspect_attention
from pymlxc.backends.metal.loader import LoadedModel, load_weights_and_config
from pymlxc.backends.metal.sample import greedy
from pymlxc.testing import write_tiny_model

_loaded: dict[str, LoadedModel] = {}
_paths: dict[str, Path] = {}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("bounded")

    def get(arch: str) -> LoadedModel:
        if arch not in _loaded:
            extra = {"sliding_window": 8} if arch.startswith("gemma") else None
            _paths[arch] = write_tiny_model(root / arch, arch, seed=2, extra_config=extra)
            _loaded[arch] = load_weights_and_config(_paths[arch])
        return _loaded[arch]

    yield get
    for m in _loaded.values():
        m.free()
    _loaded.clear()


def ids_of(n: int, seed: int = 0) -> list[int]:
    return [int(i) for i in np.random.default_rng(seed).integers(16, 500, size=n)]


def alone(model: Any, prompt: list[int], context_len: int | None, step: int) -> np.ndarray:
    """The logits generate samples its first token from: prefill of this prompt alone."""
    out = loops.prefill(model, mx.array([prompt], dtype=mx.int32), model.make_cache(context_len), step=step,
                        finish=lambda logits: logits)
    return np.asarray(out.astype(mx.float32))[0]


def one_pass(model: Any, prompt: list[int]) -> np.ndarray:
    """The last position's logits of the whole prompt in one forward pass, no cache bound."""
    return np.asarray(model(mx.array([prompt], dtype=mx.int32)).astype(mx.float32))[0, -1]


# ---------------------------------------------------------------------- classify

@settings(max_examples=12, deadline=None)
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=6), step=st.sampled_from([4, 16, 64]),
       context_len=st.sampled_from([None, 12, 30]), arch=st.sampled_from(["llama", "gemma3_text"]))
def test_classify_gives_each_prompt_its_own_prefill(models, lengths: list[int], step: int, context_len: int | None,
                                                    arch: str) -> None:
    """Batched (left-padded) or alone, chunked at `step`, bounded by `context_len` (gemma3: also a
    window of 8): each row's logits are those of prefilling its prompt alone, as generate does."""
    model = models(arch).model
    prompts = [ids_of(n, seed=i) for i, n in enumerate(lengths)]
    ids, logits = loops.classify_ids(model, prompts, sampler=greedy, return_logits=True, context_len=context_len,
                                     step=step)
    for p, row, token in zip(prompts, logits, ids, strict=True):
        want = alone(model, p, context_len, step)
        np.testing.assert_allclose(row, want, rtol=2e-4, atol=2e-4)
        assert token == int(np.argmax(row))


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(1, 100), min_size=1, max_size=30), step=st.integers(1, 64),
       context_len=st.one_of(st.none(), st.integers(1, 80)))
def test_classify_groups_share_a_chunk_or_go_alone(lengths: list[int], step: int, context_len: int | None) -> None:
    groups = loops._classify_groups(lengths, step, context_len)  # noqa: SLF001
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        width = max(lengths[i] for i in g)
        if len(g) > 1:  # padded together: one chunk, no eviction
            assert len(g) * width <= step and (context_len is None or width <= context_len)


def test_classify_stops_on_its_guard(models) -> None:
    import threading

    from pymlxc.model import GenerationCancelled

    event = threading.Event()
    event.set()
    with pytest.raises(GenerationCancelled):
        loops.classify_ids(models("llama").model, [ids_of(5)], sampler=greedy, guard=loops.Guard.make(event, None))


def test_classify_honours_context_len_as_generate_does(models) -> None:
    model = models("llama").model
    prompt = ids_of(300)
    ids, logits = loops.classify_ids(model, [prompt], sampler=greedy, return_logits=True, context_len=64, step=100)
    first = list(loops.generate_ids(model, prompt, cache=model.make_cache(64), sampler=greedy, max_tokens=1,
                                    prefill_step=100))
    assert ids == first
    np.testing.assert_allclose(logits[0], alone(model, prompt, 64, 100), rtol=1e-5, atol=1e-5)
    # The bound is real: the unbounded one-pass logits differ (the caches kept 64 of 300 tokens).
    assert not np.allclose(logits[0], one_pass(model, prompt), atol=1e-3)
    # Within the bound, chunking changes nothing: the one-pass logits (the old classify's).
    _, short = loops.classify_ids(model, [prompt[:60]], sampler=greedy, return_logits=True, context_len=64, step=16)
    np.testing.assert_allclose(short[0], one_pass(model, prompt[:60]), rtol=2e-4, atol=2e-4)


def peak_of(fn: Any) -> int:
    gc.collect()
    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    fn()
    return mx.get_peak_memory() - base


def test_classify_peak_follows_the_chunk_not_the_prompt(models) -> None:
    model = models("llama").model
    n, step, heads = 3000, 128, model.args.num_attention_heads
    prompt = ids_of(n)
    classify = lambda: loops.classify_ids(model, [prompt], sampler=greedy, step=step)  # noqa: E731
    classify()
    peak = peak_of(classify)
    whole = heads * n * n * 4  # one pass: one layer's float32 scores [heads, n, n]
    chunk = heads * step * n * 4
    assert peak < whole / 4, (peak, whole)
    assert peak < 4 * chunk, (peak, chunk)


# ---------------------------------------------------------------------- inspect_attention

@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_inspect_attention_in_chunks_equals_one_pass(models, arch: str) -> None:
    """Chunked (gemma3's window layers evict as they go) or not, every position's keys and queries."""
    model = models(arch).model
    prompt = ids_of(45)
    whole = inspect_attention(model, prompt, architecture=arch, include_queries=True, step=64)
    chunked = inspect_attention(model, prompt, architecture=arch, include_queries=True, step=8)
    assert chunked.seq_len == 45 and chunked.num_layers == whole.num_layers
    for got, want in ((chunked.keys, whole.keys), (chunked.queries, whole.queries)):
        for layer_got, layer_want in zip(got, want, strict=True):
            for a, b in zip(layer_got, layer_want, strict=True):
                assert a.shape == (45, chunked.head_dim)
                np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-4)
    keys_only = inspect_attention(model, prompt, architecture=arch, step=8)
    assert keys_only.queries is None
    np.testing.assert_allclose(keys_only.keys[-1][0], chunked.keys[-1][0], rtol=1e-5, atol=1e-5)


def test_inspect_attention_honours_context_len(models) -> None:
    model = models("llama").model
    prompt = ids_of(200)
    bounded = inspect_attention(model, prompt, architecture="llama", context_len=32, step=50)
    free = inspect_attention(model, prompt, architecture="llama", step=50)
    # Layer 0's keys come before any attention: the same; layer 1's follow attention over what the
    # caches kept, so after the first chunk they differ.
    np.testing.assert_allclose(bounded.keys[0][0], free.keys[0][0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(bounded.keys[1][0][:32], free.keys[1][0][:32], rtol=1e-4, atol=1e-4)
    assert not np.allclose(bounded.keys[1][0][100:], free.keys[1][0][100:], atol=1e-3)


# ---------------------------------------------------------------------- compiled decode buffers

@settings(max_examples=60, deadline=None)
@given(prompt=st.integers(1, 5000), max_tokens=st.integers(1, 200000))
def test_buffers_grow_in_doubling_steps_to_what_the_generation_needs(prompt: int, max_tokens: int) -> None:
    full = decode_capacity(prompt + 1, max_tokens)
    last = prompt + max_tokens - 1  # the last position a decode step writes
    size = first_capacity(prompt + 1, max_tokens)
    assert prompt < size <= full and size <= decode_capacity(prompt + 1, 0)
    sizes = [size]
    while size <= last:  # the step at position `size` does not fit: grow
        size = grown_capacity(size, size + 1, full)
        assert sizes[-1] < size <= full
        sizes.append(size)
    assert all(s % BUFFER_STEP == BUFFER_PAD for s in sizes)
    steps = -(-(last + 1) // BUFFER_STEP)
    assert len(sizes) <= steps.bit_length() + 1  # doubling: a trace per size stays few


def test_long_compiled_generation_grows_with_one_trace_per_size(models) -> None:
    model = models("llama").model
    decoder = CompiledDecoder(model, mode="graph")
    prompt = ids_of(21)
    run = lambda dec: list(loops.generate_ids(model, prompt, cache=model.make_cache(None), sampler=greedy,  # noqa: E731
                                              max_tokens=1100, decoder=dec))
    assert run(decoder) == run(None)
    assert decoder.stats["compiled"] == 1
    assert decoder.stats["traces"] == 4  # 264, 520, 1032, 1288 slots


def test_short_generation_peak_does_not_depend_on_max_tokens(models) -> None:
    """Ten tokens from the public API (compiled decode on, the default context_len): the peak with
    max_tokens 10, 100000 and 10**9 within 2x (the full-size reservation made it 0.7 against 67.7 MB)."""
    models("llama")
    with pymlxc.load_model(str(_paths["llama"]), backend="metal", prompt_cache_entries=0) as m:
        def ten(max_tokens: int) -> list[int]:
            out = []
            for token in m.generate("The river town had a baker", max_tokens=max_tokens):
                out.append(token.id)
                if len(out) == 10:
                    break
            assert m.err() is None
            return out

        want = ten(10)  # traced before measuring
        peaks = {}
        for max_tokens in (10, 100000, 10**9):
            assert ten(max_tokens) == want
            peaks[max_tokens] = peak_of(lambda: ten(max_tokens))  # noqa: B023
        assert max(peaks.values()) <= 2 * peaks[10], peaks


# ---------------------------------------------------------------------- the memory check's estimate

@settings(max_examples=10, deadline=None)
@given(arch=st.sampled_from(["llama", "qwen3", "gemma3_text"]), prompt=st.integers(1, 300),
       new=st.integers(0, 300), context_len=st.sampled_from([None, 100]))
def test_the_estimate_is_what_the_caches_hold(models, arch: str, prompt: int, new: int,
                                              context_len: int | None) -> None:
    """The caches after a generation hold the estimated bytes, up to their 256-position steps."""
    model = models(arch).model
    cache = model.make_cache(context_len)
    est = memory_check.estimate(model, cache, batch=1, prompt_len=prompt, new_tokens=new)
    assert est is not None
    list(loops.generate_ids(model, ids_of(prompt), cache=cache, sampler=greedy, max_tokens=new))
    shapes = memory_check.layer_shapes(model, cache)
    held = sum(c.nbytes for c in cache)
    assert held <= est.kv + sum(256 * s.kv_bytes for s in shapes)  # KVCache: 256-position steps
    if context_len is None and arch != "gemma3_text":  # nothing bounded: every position is held
        # (the last token sampled is never fed back: one position fewer at most)
        assert held >= est.kv - sum(s.kv_bytes for s in shapes)


@settings(max_examples=8, deadline=None)
@given(arch=st.sampled_from(["qwen3_5", "qwen3_next"]), prompt=st.integers(1, 150), new=st.integers(0, 40),
       step=st.sampled_from([16, 64, 2048]))
def test_the_estimate_counts_linear_attention_caches(models, arch: str, prompt: int, new: int, step: int) -> None:
    """Qwen 3.5 / Qwen3-Next: linear layers have no self_attn; their caches (conv window and
    recurrent state, plus the prompt cache's snapshots) are counted, the attention layers' KV too."""
    model = models(arch).model
    cache = model.make_cache(None)
    shapes = memory_check.layer_shapes(model, cache)
    assert shapes is not None
    linear = [i for i, s in enumerate(shapes) if s.state_bytes]
    assert 0 < len(linear) < len(shapes) and all(shapes[i].kv_bytes == 0 for i in linear)
    est = memory_check.estimate(model, cache, batch=1, prompt_len=prompt, new_tokens=new, step=step)
    assert est is not None
    list(loops.generate_ids(model, ids_of(prompt), cache=cache, sampler=greedy, max_tokens=new, prefill_step=step))
    for i in linear:  # one state is exactly the layer's state_bytes
        assert cache[i].conv.nbytes + cache[i].recurrent.nbytes == shapes[i].state_bytes
    held = sum(c.nbytes for c in cache)
    assert held <= est.kv + sum(256 * s.kv_bytes for s in shapes)
    kv_est = sum((prompt + new) * s.kv_bytes for s in shapes)  # the attention layers, unbounded
    assert est.kv - kv_est >= sum(cache[i].nbytes for i in linear) >= len(linear) * shapes[linear[0]].state_bytes


def test_linear_attention_models_are_checked(models) -> None:
    """A Qwen 3.5 call that cannot fit is refused before anything is allocated (its layers were
    once unknown to the check, which then let everything through)."""
    model = models("qwen3_5").model
    assert memory_check.device_memory() > 0
    with pytest.raises(memory_check.DeviceMemoryError, match="max_tokens"):
        memory_check.check(model, model.make_cache(None), batch=1, prompt_len=10, new_tokens=10**12)
    memory_check.check(model, model.make_cache(None), batch=1, prompt_len=10, new_tokens=10)  # fits

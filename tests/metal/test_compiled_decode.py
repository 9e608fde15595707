"""The compiled decode step (backends/metal/decode/decoder.py) gives the tokens of the uncompiled loop.

Every architecture decodes greedily with and without the compiled step from the same prompt; the
prompt and the generation cross the tiny models' sliding windows (16 tokens), so the ring buffers
of window layers wrap. The decoder's counters prove which path ran. Then: samplers and processors
outside the graph, caches handed back (a later call continues from them), fallbacks (batches,
context-bounded caches that evict, PYMLXC_COMPILE=0), LoRA adapters, retracing only per ring size.
"""
from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pymlxc.core as mx
from pymlxc.backends.metal import generate as loops
from pymlxc.backends.metal.decode.decoder import CompiledDecoder, decode_capacity
from pymlxc.backends.metal.loader import LoadedModel, load_weights_and_config
from pymlxc.backends.metal.sample import greedy, make_logits_processors, make_sampler
from pymlxc.testing import ARCHITECTURES, write_tiny_model

PROMPT_LEN, STEPS = 21, 24

_loaded: dict[Any, LoadedModel] = {}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("compiled")

    def get(arch: str, bits: int | None = None) -> LoadedModel:
        key = (arch, bits)
        if key not in _loaded:
            path = write_tiny_model(root / f"{arch}-{bits}", arch, quantize_bits=bits, num_layers=3)
            _loaded[key] = load_weights_and_config(path)
        return _loaded[key]

    yield get
    for m in _loaded.values():
        m.free()
    _loaded.clear()


def prompt(n: int = PROMPT_LEN, seed: int = 1) -> list[int]:
    return [int(i) for i in np.random.default_rng(seed).integers(16, 500, size=n)]


def run(model: Any, ids: list[int], decoder: CompiledDecoder | None, *, steps: int = STEPS,
        context_len: int | None = None, cache: list[Any] | None = None, cached: int = 0, **kw: Any) -> list[int]:
    cache = model.make_cache(context_len) if cache is None else cache
    kw.setdefault("sampler", greedy)
    return list(loops.generate_ids(model, ids, cache=cache, max_tokens=steps, decoder=decoder, cached=cached, **kw))


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_tokens_match_uncompiled(models, arch: str) -> None:
    model = models(arch).model
    decoder = CompiledDecoder(model)
    ids = prompt()
    expected = run(model, ids, None)
    assert run(model, ids, decoder) == expected
    assert decoder.stats["compiled"] == 1 and decoder.stats["fallback"] == 0
    # A second generation of another length reuses the trace when the rings keep their sizes.
    assert run(model, ids[:15], decoder, steps=8) == run(model, ids[:15], None, steps=8)
    assert decoder.stats["traces"] == 1
    decoder.close()


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_models(models, bits: int) -> None:
    model = models("llama", bits).model
    decoder = CompiledDecoder(model)
    ids = prompt()
    assert run(model, ids, decoder) == run(model, ids, None)
    assert decoder.stats["compiled"] == 1


def test_one_trace_per_ring_size(models) -> None:
    model = models("llama").model
    decoder = CompiledDecoder(model, mode="graph")
    ids = prompt()
    run(model, ids, decoder, steps=4)
    run(model, ids, decoder, steps=200)  # 221 slots still fit the first 264-slot buffers
    assert decoder.stats["traces"] == 1
    assert decode_capacity(len(ids), 300) == 512 + 8  # never a multiple of 256 (see BUFFER_PAD)
    assert run(model, ids, decoder, steps=300) == run(model, ids, None, steps=300)
    assert decoder.stats["traces"] == 2


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_samplers_and_processors(models, arch: str) -> None:
    """Non-greedy sampling and the repeat penalty run on the step's logits, outside the graph."""
    model = models(arch).model
    decoder = CompiledDecoder(model)
    ids = prompt()
    for options in ({"temperature": 0.8, "top_k": 20}, {"temperature": 1.0, "top_p": 0.9, "min_p": 0.05}):
        got = run(model, ids, decoder, sampler=make_sampler(**options, key=7))
        want = run(model, ids, None, sampler=make_sampler(**options, key=7))
        assert got == want
    penalty = make_logits_processors(1.3)
    assert run(model, ids, decoder, processors=penalty) == run(model, ids, None, processors=penalty)
    assert decoder.stats["fallback"] == 0


def test_stop_ids_and_early_stop(models) -> None:
    model = models("llama").model
    decoder = CompiledDecoder(model)
    ids = prompt()
    full = run(model, ids, None)
    stop = full[5]
    got = run(model, ids, decoder, stop_ids=frozenset({stop}))
    assert got == full[:full.index(stop)]
    # Reading only part of the stream and closing it hands the rings back without error.
    cache = model.make_cache(None)
    stream = loops.generate_ids(model, ids, cache=cache, sampler=greedy, max_tokens=STEPS, decoder=decoder)
    assert [next(stream) for _ in range(3)] == full[:3]
    stream.close()
    assert all(c.offset >= len(ids) + 2 for c in cache)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "qwen3_moe"])
def test_caches_continue_after_compiled_decode(models, arch: str) -> None:
    """The caches get the rings back in their own layout: a later call that reuses them (as the
    prompt cache does) continues exactly as after an uncompiled decode."""
    model = models(arch).model
    decoder = CompiledDecoder(model)
    assert generate_then_continue(model, decoder) == generate_then_continue(model, None)
    assert decoder.stats["compiled"] == 2


def generate_then_continue(model: Any, decoder: CompiledDecoder | None) -> tuple[list[int], list[int]]:
    """Tokens of a generation, then of one continuing its caches after five more prompt tokens."""
    ids = prompt()
    cache = model.make_cache(None)
    first = run(model, ids, decoder, cache=cache)
    seen = ids + first  # the cache holds every fed token: the prompt and all but the last sampled
    assert all(c.offset == len(seen) - 1 for c in cache)
    return first, run(model, seen + prompt(5, seed=2), decoder, cache=cache, cached=len(seen) - 1)


def test_fallbacks(models, monkeypatch: pytest.MonkeyPatch) -> None:
    model = models("llama").model
    decoder = CompiledDecoder(model)
    ids = prompt()
    # A context bound the generation runs past: the rotating cache would evict (keeping sinks).
    assert run(model, ids, decoder, context_len=32) == run(model, ids, None, context_len=32)
    assert decoder.stats == {"compiled": 0, "fallback": 1, "traces": 0}
    # A context bound that is never reached decodes compiled.
    assert run(model, ids, decoder, context_len=64) == run(model, ids, None, context_len=64)
    assert decoder.stats["compiled"] == 1
    # A one-token prompt is prefilled too (the first token comes from the prefill's logits), so
    # its decode starts from a filled cache and is compiled.
    assert run(model, ids[:1], decoder) == run(model, ids[:1], None)
    assert (decoder.stats["compiled"], decoder.stats["fallback"]) == (2, 1)


def test_batches_use_the_uncompiled_loop(models) -> None:
    model = models("llama").model
    decoder = CompiledDecoder(model)
    cache = model.make_cache(None)
    start = decoder.start(cache, 0, 4, sampler=greedy, batch=2)
    assert start is None


def test_lora_adapter_retraces(models) -> None:
    from pymlxc.backends.metal import lora

    model = models("qwen3").model
    decoder = CompiledDecoder(model)
    ids = prompt()
    before = run(model, ids, decoder)
    paths = lora.select_modules(model, ["q_proj", "v_proj"], None)
    lora.attach(model, [lora.LoRASpec(p, 4, 2.0) for p in paths], seed=3)
    try:
        for layer in lora.lora_layers(model).values():
            layer.lora_b = mx.random.normal(layer.lora_b.shape, key=mx.random.key(5)) * 0.5
        with_adapter = run(model, ids, decoder)
        assert with_adapter == run(model, ids, None)
        assert with_adapter != before
        assert decoder.stats["traces"] == 2
    finally:
        lora.detach(model)
    assert run(model, ids, decoder) == before


def test_textmodel_default_and_the_compile_setting(tmp_path: Path, switches: Any) -> None:
    from pymlxc.backends.metal import BACKEND
    from pymlxc.options import LoadConfig
    from pymlxc.settings import Settings

    path = write_tiny_model(tmp_path / "m", "llama", num_layers=2)
    import pymlxc

    with pymlxc.load_model(str(path), backend="metal", settings=Settings(compile=False)) as plain:
        off = [t.id for t in plain.generate("The baker", max_tokens=12)]
        assert plain._decoder.stats["compiled"] == plain._decoder.stats["fallback"] == 0  # noqa: SLF001
    switches(compile=False)  # the process's settings: read by a model at load, not at each generation
    with BACKEND.load(str(path), LoadConfig(settings=Settings())) as tm:
        on = [t.id for t in tm.generate("The baker", max_tokens=12)]
        assert tm._decoder.stats["compiled"] == 1  # noqa: SLF001
        assert on == off
        tm.compiled_decode = False
        assert [t.id for t in tm.generate("The baker", max_tokens=12)] == on
        assert tm._decoder.stats["compiled"] == 1  # noqa: SLF001
        # batch_generate and classify are not compiled and agree with generate.
        tm.compiled_decode = True
        batch = tm.batch_generate(["The baker"], max_tokens=12)
        assert [t.id for t in batch[0].tokens] == on
    assert tm._decoder._model is None  # noqa: SLF001 - close() dropped the traces


def test_untraceable_forward_falls_back(models, monkeypatch: pytest.MonkeyPatch) -> None:
    """A forward that needs the position as a Python int cannot be traced: the decoder falls back
    (once, remembering it), the caches keep their tokens, and the tokens are the uncompiled ones."""
    model = models("mistral").model
    ids = prompt()
    want = run(model, ids, None)
    forward = type(model).__call__

    def needs_int_offset(self: Any, inputs: Any, cache: Any = None, mask: Any = None, **kw: Any) -> Any:
        if cache is not None:
            int(cache[0].offset)  # fails on the traced position (an Array)
        return forward(self, inputs, cache=cache, mask=mask, **kw)

    monkeypatch.setattr(type(model), "__call__", needs_int_offset)
    decoder = CompiledDecoder(model, mode="graph")  # the segmented step does not call the model's forward
    assert run(model, ids, decoder) == want
    assert decoder.stats["fallback"] == 1 and decoder.stats["compiled"] == 0
    assert run(model, ids, decoder) == want  # remembered: no second trace
    assert decoder.stats["traces"] == 1


def test_decode_peak_memory_has_one_kv_cache(models) -> None:
    """The rings are written in place: decoding holds one KV cache, not two (as the uncompiled
    loop); the caches hand their buffers to the session instead of keeping them."""
    model = models("llama").model
    ids = prompt()
    peaks = []
    decoder = CompiledDecoder(model)
    run(model, ids, decoder, steps=200)  # traced and compiled before measuring
    kv = 0
    for dec in (decoder, None, decoder):
        gc.collect()
        mx.clear_cache()
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        cache = model.make_cache(None)
        run(model, ids, dec, steps=200, cache=cache)
        peaks.append(mx.get_peak_memory() - base)
        kv = sum(c.nbytes for c in cache)
        del cache  # before the next baseline
    # On a GPU, MLX keeps a step's inputs until the device has run that step, so a ring write encoded
    # before the previous step finished copies the buffer instead of writing in place (measured on
    # an H100: up to three copies in flight with the evaluation thread). The CPU bound is the claim.
    slack = kv // 4 if mx.default_device().type == "cpu" else 4 * kv
    assert max(peaks[0], peaks[2]) <= peaks[1] + slack, (peaks, kv)


# ---------------------------------------------------------------------- PYMLXC_DECODE=segmented

def declares_segments(arch: str) -> bool:
    """Whether the architecture's model declares that its blocks run in halves (segments.py)."""
    from pymlxc.backends.metal.models import MODEL_TYPES

    return getattr(MODEL_TYPES[arch].Model, "segmented_decode", False) is True


LLAMA_FAMILY = tuple(a for a in ARCHITECTURES if declares_segments(a))


def test_the_llama_family_declares_the_segments() -> None:
    """Every architecture built on Llama's blocks takes the segmented path; MoE and Gemma do not."""
    assert {"llama", "mistral", "qwen2", "qwen3"} <= set(LLAMA_FAMILY)
    assert not {"qwen2_moe", "qwen3_moe", "gemma2", "gemma3", "qwen3_next"} & set(LLAMA_FAMILY)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_segments_take_exactly_the_declaring_architectures(models, arch: str) -> None:
    """`segments.plan` follows the declaration (full attention given); where it plans, the
    segmented decode runs (a segment plan is made) with the uncompiled loop's greedy tokens."""
    from pymlxc.backends.metal.decode import segments

    model = models(arch).model
    windows = model.layer_windows() if hasattr(model, "layer_windows") else [None]
    planned = segments.plan(model) is not None
    assert planned == (declares_segments(arch) and all(w is None for w in windows))
    decoder = CompiledDecoder(model, "segmented")
    ids = prompt()
    assert run(model, ids, decoder) == run(model, ids, None)
    assert bool(decoder._plans) == planned and decoder.stats["compiled"] == 1  # noqa: SLF001
    decoder.close()


@pytest.fixture
def segmented(switches: Any) -> None:
    switches(decode="segmented")


@pytest.mark.parametrize("arch", LLAMA_FAMILY)
def test_segmented_tokens_match_uncompiled(models, segmented: None, arch: str) -> None:
    from pymlxc.backends.metal.decode import segments

    model = models(arch).model
    assert segments.plan(model) is not None
    decoder = CompiledDecoder(model)
    ids = prompt()
    assert run(model, ids, decoder) == run(model, ids, None)
    assert run(model, ids[:15], decoder, steps=300) == run(model, ids[:15], None, steps=300)
    # One trace for every buffer size; with the RoPE kernel (kernels/rope_kv.py, on CUDA) the segments
    # take the buffers as inputs, so one per size (two here).
    rope_kv = any(plan.rope_kv for plan in decoder._plans.values())  # noqa: SLF001
    assert decoder.stats == {"compiled": 2, "fallback": 0, "traces": 2 if rope_kv else 1}
    sampler = make_sampler(temperature=0.9, top_k=30, key=3)
    assert run(model, ids, decoder, sampler=sampler) == run(model, ids, None, sampler=make_sampler(
        temperature=0.9, top_k=30, key=3))


def test_segmented_quantized_and_continuing_caches(models, segmented: None) -> None:
    model = models("llama", 4).model
    decoder = CompiledDecoder(model)
    assert generate_then_continue(model, decoder) == generate_then_continue(model, None)
    assert decoder.stats["compiled"] == 2


def test_segmented_falls_back_to_the_graph_where_it_does_not_apply(models, segmented: None) -> None:
    """Sliding windows (Gemma) and processors are decoded by the whole-step graph instead."""
    from pymlxc.backends.metal.decode import segments

    model = models("gemma3_text").model
    assert segments.plan(model) is None
    decoder = CompiledDecoder(model)
    ids = prompt()
    assert run(model, ids, decoder) == run(model, ids, None)
    llama_model = models("llama").model
    llama_decoder = CompiledDecoder(llama_model)
    penalty = make_logits_processors(1.3)
    assert run(llama_model, ids, llama_decoder, processors=penalty) == run(llama_model, ids, None, processors=penalty)
    assert decoder.stats["compiled"] == 1 and llama_decoder.stats["compiled"] == 1


@pytest.mark.parametrize("bits", [None, 4])
def test_segmented_fuses_projections_into_views(tmp_path: Path, segmented: None, bits: int | None) -> None:
    """q/k/v and gate/up become one matmul each over a concatenated weight that the projections
    view (no extra memory); every path keeps its tokens; a replaced weight is fused again."""
    path = write_tiny_model(tmp_path / "m", "qwen2", quantize_bits=bits, num_layers=3)  # q/k/v biases too
    loaded = load_weights_and_config(path)
    model = loaded.model
    ids = prompt()
    want = run(model, ids, None)
    gc.collect()
    mx.clear_cache()
    before = mx.get_active_memory()
    decoder = CompiledDecoder(model)
    assert run(model, ids, decoder) == want
    fusions = [entry[1:] for entry in decoder._fusions.values()]  # noqa: SLF001
    assert len(fusions) == 3 and all(q is not None and g is not None for q, g in fusions)
    gc.collect()
    mx.clear_cache()
    assert mx.get_active_memory() <= before + 64 * 1024  # views, not copies (the rings are freed)
    assert run(model, ids, None) == want  # the uncompiled path on the views
    attn = model.layers[1].self_attn
    attn.k_proj.weight = attn.k_proj.weight + 0  # a new array: the block's fusion is stale
    mx.eval(attn.k_proj.weight)
    old = decoder._fusions[id(model.layers[1])][1]  # noqa: SLF001
    assert not old.valid()
    assert run(model, ids, decoder) == want
    assert decoder._fusions[id(model.layers[1])][1] is not old  # noqa: SLF001
    decoder.close()
    loaded.free()


def test_segmented_with_lora_runs_unfused(models, segmented: None) -> None:
    from pymlxc.backends.metal import lora

    model = models("llama").model
    decoder = CompiledDecoder(model)
    ids = prompt()
    assert run(model, ids, decoder) == run(model, ids, None)  # fused first
    paths = lora.select_modules(model, ["q_proj"], 1)  # the last block only
    lora.attach(model, [lora.LoRASpec(p, 4, 2.0) for p in paths], seed=3)
    try:
        for layer in lora.lora_layers(model).values():
            layer.lora_b = mx.random.normal(layer.lora_b.shape, key=mx.random.key(5)) * 0.5
        assert run(model, ids, decoder) == run(model, ids, None)  # the adapter is seen: unfused
        assert decoder.stats["compiled"] == 2
    finally:
        lora.detach(model)
    assert run(model, ids, decoder) == run(model, ids, None)


def test_decode_mode_follows_the_setting_then_the_device(models: Any) -> None:
    import pymlxc.core as mx
    from pymlxc.backends.metal.decode.decoder import decode_mode
    from pymlxc.settings import Settings

    for mode in ("segmented", "graph"):
        assert decode_mode(mode) == mode
        assert CompiledDecoder(models("llama").model, settings=Settings(decode=mode)).mode == mode
    with mx.stream_scope("cpu"):
        assert decode_mode("auto") == "segmented"  # less work per token on a CPU too (decoder.decode_mode)
    with pytest.raises(ValueError, match="decode setting"):
        decode_mode("fast")


@settings(max_examples=25, deadline=None)
@given(st.sampled_from(["bfloat16", "float16", "float32"]), st.integers(1, 6), st.integers(1, 4),
       st.sampled_from([32, 64, 128]), st.floats(1e-6, 1e-2), st.integers(0, 2**31 - 1))
def test_joint_qk_norm_is_the_two_norms_bit_for_bit(dtype: str, hq: int, hkv: int, d: int, eps: float,
                                                      seed: int) -> None:
    from pymlxc.backends.metal import nn
    from pymlxc.backends.metal.decode.segments import FusedProjection, _join_qk_norms, joint_qk_norm

    rng = np.random.default_rng(seed)
    t = getattr(mx, dtype)
    draw = lambda *shape: mx.array(rng.normal(0, 2, shape).astype(np.float32)).astype(t)  # noqa: E731
    q_norm, k_norm = nn.RMSNorm(d, eps=eps), nn.RMSNorm(d, eps=eps)
    q_norm.weight, k_norm.weight = draw(d), draw(d)
    fused = FusedProjection([hq * d, hkv * d, hkv * d])
    _join_qk_norms(fused, (q_norm, k_norm), [hq * d, hkv * d, hkv * d])
    qk = draw(2, hq + hkv, 1, d)
    want = mx.concatenate([q_norm(qk[:, :hq]), k_norm(qk[:, hq:])], axis=1)
    got = joint_qk_norm(qk, fused)
    assert got.dtype == want.dtype
    assert np.array_equal(np.asarray(got.astype(mx.float32)), np.asarray(want.astype(mx.float32)))


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_segmented_qwen3_joins_its_q_and_k_norms(tmp_path: Path, segmented: None, dtype: str) -> None:
    """The segments run Qwen3's two head norms as one over the joint heads, with one RoPE call;
    the tokens stay the uncompiled loop's; norms given new weights are joined again."""
    loaded = load_weights_and_config(write_tiny_model(tmp_path / "m", "qwen3", dtype=dtype, num_layers=3))
    model = loaded.model
    ids = prompt()
    want = run(model, ids, None)
    decoder = CompiledDecoder(model)
    assert run(model, ids, decoder) == want
    fusions = [entry[1] for entry in decoder._fusions.values()]  # noqa: SLF001
    assert len(fusions) == 3 and all(f.fused.qk_norm_weight is not None for f in fusions)
    attn = model.layers[1].self_attn
    attn.k_norm.weight = attn.k_norm.weight * 3  # new weights: the block's fusion is stale
    mx.eval(attn.k_norm.weight)
    old = decoder._fusions[id(model.layers[1])][1]  # noqa: SLF001
    assert not old.valid()
    assert run(model, ids, decoder) == run(model, ids, None)
    new = decoder._fusions[id(model.layers[1])][1]  # noqa: SLF001
    assert new is not old and new.fused.qk_norm_weight is not None
    head_dim = attn.head_dim
    assert np.array_equal(np.asarray(new.fused.qk_norm_weight[-1, 0].astype(mx.float32)),
                          np.asarray(attn.k_norm.weight.astype(mx.float32)).reshape(head_dim))
    decoder.close()
    loaded.free()


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_last_only_forward_is_the_full_forward_last_row(models, arch: str) -> None:
    """`last_only` (prefill's first token): the last position's logits and the same caches as the
    whole forward, with a sliding window cut into by the prompt (the tiny models' window is 16)."""
    model = models(arch).model
    ids = mx.array([prompt(23, seed=4)], dtype=mx.int32)
    full_cache, last_cache = model.make_cache(None), model.make_cache(None)
    full = model(ids, cache=full_cache)
    last = model(ids, cache=last_cache, last_only=True)
    assert last.shape == (1, 1, full.shape[-1])
    np.testing.assert_allclose(np.asarray(last[0, 0]), np.asarray(full[0, -1]), rtol=1e-5, atol=1e-5)
    for a, b in zip(full_cache, last_cache, strict=True):
        assert a.offset == b.offset
        for x, y in zip(a.state, b.state, strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # An explicit mask (left-padded rows of a batch): the last query keeps its own row of it.
    ids2 = mx.array([prompt(23, seed=5), prompt(23, seed=6)], dtype=mx.int32)
    mask = loops.left_padded_mask(mx.array([0, 6], dtype=mx.int32), 0, 23)
    full = model(ids2, cache=model.make_cache(None), mask=mask)
    last = model(ids2, cache=model.make_cache(None), mask=mask, last_only=True)
    np.testing.assert_allclose(np.asarray(last[:, 0]), np.asarray(full[:, -1]), rtol=1e-5, atol=1e-5)

"""The whole decode step as one compiled graph, with each layer's attention as CUDA kernels that
read the position on the device (backends/metal/kernels/decode_attention.py, segments._trace_whole).

Everywhere: the setting is read by name; off CUDA `auto` keeps the segments and `1` runs the whole
step with MLX's masked attention, with the segments' tokens on both sides of the one-pass kernel's
1024 keys (each side its own trace); the check rejects kernels that differ from MLX's attention in
any bit.

The L2 prefetch (`segments.prefetch_spans`, the kernels' prefetching form): its setting is read by
name; the ranges cover o_proj's arrays, then the fronts of the gate and up halves, within the
budget; ranges outside an array are refused; the check rejects a prefetching form that differs.

On CUDA: the kernels equal MLX's attention bit for bit over head layouts, types, scales and
lengths, with or without prefetched ranges, and models decoded on them keep the uncompiled loop's
greedy tokens past 1024 positions, the prefetch on or off.
"""
from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pymlxc.core as mx
from pymlxc.backends.metal.decode import segments
from pymlxc.backends.metal.decode.decoder import CompiledDecoder
from pymlxc.backends.metal.kernels import decode_attention as attention_kernel

from .cuda_decode_helpers import (
    ON_CUDA,
    check_the_setting_is_read_by_name,
    cuda_only,
    forget_verdicts,
    greedy_ids,
)

fresh_checks = forget_verdicts(attention_kernel.checks)  # each test sees its own verdicts


# Head size 64: a size MLX's one-token kernels (and so these) take.
WIDE = {"hidden_size": 256}


def _attention(decoder: CompiledDecoder) -> set[Any]:
    return {plan.attention for plan in decoder._plans.values()}  # noqa: SLF001


def test_the_decoder_reads_the_setting_by_name(tiny, switches: Any) -> None:
    check_the_setting_is_read_by_name(tiny(), switches, "PYMLXC_CUDA_DECODE_ATTENTION", "cuda_decode_attention",
                                      "attention", off=None)


def test_the_kernels_take_mlx_one_token_shapes() -> None:
    assert attention_kernel.applies(mx.bfloat16, 32, 8, 64, 64)
    assert attention_kernel.applies(mx.float32, 8, 8, 128, 128)
    assert not attention_kernel.applies(mx.float16, 32, 8, 80, 80)  # MLX has no one-token kernel for 80
    assert not attention_kernel.applies(mx.float16, 32, 8, 64, 128)  # values of another size
    assert not attention_kernel.applies(mx.float16, 6, 4, 64, 64)  # groups of unequal size
    assert not attention_kernel.applies(mx.int32, 8, 8, 64, 64)
    assert attention_kernel.one_pass(1024) and not attention_kernel.one_pass(1025)


@pytest.mark.skipif(ON_CUDA, reason="off CUDA only: there the kernels cannot run")
def test_off_cuda_auto_keeps_the_segments_and_1_masks(tiny, switches: Any) -> None:
    model = tiny()
    blocks = segments.plan(model)
    assert segments.use_decode_attention(model, blocks, None, "auto") is None
    assert segments.use_decode_attention(model, blocks, None, "0") is None
    assert segments.use_decode_attention(model, blocks, None, "1") == "mlx"


@pytest.mark.parametrize("arch,bits", [("llama", None), ("llama", 4), ("qwen3", None)])
def test_the_whole_step_keeps_the_tokens(tiny, switches: Any, arch: str, bits: int | None) -> None:
    """The whole step (MLX's masked attention where the kernels cannot run) gives the uncompiled
    loop's greedy ids, traced once per buffer size."""
    model = tiny(arch, bits, **WIDE)
    switches.env("PYMLXC_CUDA_DECODE_ATTENTION", "1")
    want = greedy_ids(model, None, n=40)
    decoder = CompiledDecoder(model, "segmented")
    assert greedy_ids(model, decoder, n=40) == want
    assert _attention(decoder) == {"kernel" if ON_CUDA else "mlx"}
    assert decoder.stats == {"compiled": 1, "fallback": 0, "traces": 1}
    decoder.close()


def test_the_whole_step_past_the_one_pass_length(tiny, switches: Any) -> None:
    """A generation that crosses 1024 positions switches from the one-pass graph to the two-pass
    one (a trace each, besides the buffer sizes) and keeps the tokens of the segments on MLX's
    attention; a second generation reuses the traces. (On CUDA the uncompiled loop is no reference
    this far: over its 256-slot caches MLX attends with cuDNN past 256 keys, and a tiny random
    model's greedy tokens left the segments' at token 457.)"""
    model = tiny(**WIDE)
    switches.env("PYMLXC_CUDA_DECODE_ATTENTION", "0")
    segmented = CompiledDecoder(model, "segmented")
    want = greedy_ids(model, segmented, n=1040)
    assert _attention(segmented) == {None}
    segmented.close()
    if not ON_CUDA:
        assert want == greedy_ids(model, None, n=1040)
    switches.env("PYMLXC_CUDA_DECODE_ATTENTION", "1")
    decoder = CompiledDecoder(model, "segmented")
    assert greedy_ids(model, decoder, n=1040) == want
    traces = decoder.stats["traces"]
    assert traces >= 2
    assert _attention(decoder) == {"kernel" if ON_CUDA else "mlx"}
    assert greedy_ids(model, decoder, n=1040) == want and decoder.stats["traces"] == traces
    decoder.close()


@pytest.mark.parametrize("fault", ["one pass", "two passes", "prefetch"])
def test_the_check_rejects_any_difference(monkeypatch: pytest.MonkeyPatch, fault: str) -> None:
    """The check compares with MLX's attention on both kernels' lengths, and the prefetching form
    with the plain one: one off by a unit in the last place is rejected with a warning naming the
    length; MLX's attention itself passes."""
    def stand_in(q: Any, keys: Any, values: Any, pos: Any, scale: float, single: bool, prefetch: Any = ()) -> Any:
        out = attention_kernel.reference(q, keys, values, pos, scale)
        if fault == "prefetch" and prefetch and not single:
            out = mx.view(mx.view(out, mx.int16) + mx.array(1, dtype=mx.int16), mx.float16)
        elif fault != "none" and fault != "prefetch" and single == (fault == "one pass"):
            out = mx.view(mx.view(out, mx.int16) + mx.array(1, dtype=mx.int16), mx.float16)
        return out

    monkeypatch.setattr(attention_kernel, "attend", stand_in)
    first = 1 if fault == "one pass" else 1025
    form = "its prefetching form's output" if fault == "prefetch" else "its output"
    with pytest.warns(RuntimeWarning, match=f"{form} over {first} keys differs"):
        assert not attention_kernel.check(mx.float16, 4, 2, 64, 0.125)
    fault = "none"
    attention_kernel.checks.forget()
    assert attention_kernel.check(mx.float16, 4, 2, 64, 0.125)


def test_the_decoder_reads_the_prefetch_setting_by_name(tiny, switches: Any) -> None:
    switches.env("PYMLXC_CUDA_DECODE_ATTENTION", "1")
    check_the_setting_is_read_by_name(tiny(**WIDE), switches, "PYMLXC_CUDA_L2_PREFETCH", "cuda_l2_prefetch",
                                      "l2_prefetch")


def test_the_prefetch_needs_the_kernels() -> None:
    assert segments.use_l2_prefetch("kernel", "auto") and segments.use_l2_prefetch("kernel", "1")
    assert not segments.use_l2_prefetch("kernel", "0")
    assert not segments.use_l2_prefetch("mlx", "1") and not segments.use_l2_prefetch(None, "auto")


def _block_and_gate_up(model: Any) -> tuple[Any, Any]:
    blocks = segments.plan(model)
    fusions = segments.fusions_for(blocks, {})
    assert fusions is not None and fusions[0][1] is not None
    return blocks[0], fusions[0][1].fused


@settings(max_examples=20, deadline=None)
@given(budget=st.integers(0, 1 << 20), paired=st.booleans())
def test_the_prefetch_ranges(tiny_4bit: Any, budget: int, paired: bool) -> None:
    """o_proj's arrays whole first, then equal shares of the front of each gate/up array (with
    `paired` of its gate half and its up half, where the paired kernel starts), never past the
    budget or an array's end."""
    block, gate_up = tiny_4bit
    o_arrays = [block.self_attn.o_proj.weight, block.self_attn.o_proj.scales, block.self_attn.o_proj.biases]
    spans = segments.prefetch_spans(block, gate_up, paired, budget)
    assert sum(size for _, _, size in spans) <= budget
    assert all(size > 0 and 0 <= start and start + size <= a.nbytes for a, start, size in spans)
    o_bytes = sum(a.nbytes for a in o_arrays)
    firsts = [a for a, _, _ in spans[:3]]
    if budget >= o_bytes:
        assert all(a is b for a, b in zip(firsts, o_arrays, strict=True))
        assert [(start, size) for _, start, size in spans[:3]] == [(0, a.nbytes) for a in o_arrays]
        rest = spans[3:]
        weight, scales, biases = gate_up.quantized_arrays()
        assert {id(a) for a, _, _ in rest} <= {id(weight), id(scales), id(biases)}
        if paired:  # each array twice: its gate rows and its up rows, the same share of each
            for a in (weight, scales, biases):
                mine = [(start, size) for b, start, size in rest if b is a]
                assert mine == [] or (len(mine) == 2 and mine[0][0] == 0 and mine[1][0] == a.nbytes // 2
                                      and mine[0][1] == mine[1][1] <= a.nbytes // 2)
        else:
            assert all(start == 0 for _, start, _ in rest)
        left = budget - o_bytes
        total = weight.nbytes + scales.nbytes + biases.nbytes
        if left >= total:  # all of it fits: every byte of the gate/up product is asked for
            assert sum(size for _, _, size in rest) >= total - 6
    else:  # the budget ends inside o_proj's arrays: only they, in order, from their starts
        assert all(a is b and start == 0 for (a, start, _), b in zip(spans, o_arrays, strict=False))


@pytest.fixture(scope="module")
def tiny_4bit(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from .cuda_decode_helpers import tiny_models

    models = tiny_models(tmp_path_factory.mktemp("prefetch"))
    load = next(models)
    yield _block_and_gate_up(load("llama", quantize_bits=4, **WIDE))
    next(models, None)


def test_ranges_outside_an_array_are_refused() -> None:
    q = mx.zeros((1, 4, 1, 64), mx.float16)
    keys = mx.zeros((1, 2, 8, 64), mx.float16)
    pos = mx.array([0] * 4, dtype=mx.int32)
    for start, size in ((0, keys.nbytes + 1), (-16, 32), (keys.nbytes, 16), (8, -1)):
        with pytest.raises(ValueError, match=f"outside an array of {keys.nbytes} bytes"):
            attention_kernel.attend(q, keys, keys, pos, 0.125, True, prefetch=[(keys, start, size)])


# ---------------------------------------------------------------------- on CUDA

@cuda_only
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hq=st.sampled_from([1, 4, 8, 16, 32]), group=st.sampled_from([1, 2, 4, 8]), d=st.sampled_from([64, 96, 128]),
       dtype=st.sampled_from(["bfloat16", "float16", "float32"]), scale=st.sampled_from([0.125, 0.0883883, 1.0]),
       length=st.integers(1, 5000), seed=st.integers(0, 2**16))
def test_the_kernels_are_mlx_attention(hq: int, group: int, d: int, dtype: str, scale: float, length: int,
                                       seed: int) -> None:
    hkv = max(1, hq // group)
    rng = np.random.default_rng(seed)
    t = getattr(mx, dtype)

    def rand(*shape: int) -> Any:
        return mx.astype(mx.array(rng.standard_normal(shape).astype(np.float32)), t)

    slots = length + 7 if (length + 7) % 256 else length + 8  # never whole 256-slot caches (cuDNN's)
    q, keys, values = rand(1, hq, 1, d), rand(1, hkv, slots, d), rand(1, hkv, slots, d)
    pos = mx.array([length - 1] * 4, dtype=mx.int32)
    got = attention_kernel.attend(q, keys, values, pos, scale, attention_kernel.one_pass(length))
    want = attention_kernel.reference(q, keys, values, pos, scale)
    assert bool(mx.array_equal(got, want).item())
    # The flat form o_proj takes [1, 1, heads * D]: the same values.
    flat = attention_kernel.attend(q, keys, values, pos, scale, attention_kernel.one_pass(length), flat=True)
    assert flat.shape == (1, 1, hq * d) and bool(mx.array_equal(flat, mx.reshape(want, (1, 1, hq * d))).item())
    # Prefetching ranges of other arrays (uneven starts and ends) changes no bit.
    other = rand(3, 1000 + seed % 77)
    spans = [(other, seed % 100, other.nbytes // 2), (keys, 0, keys.nbytes), (other, other.nbytes - 48, 48)]
    fetched = attention_kernel.attend(q, keys, values, pos, scale, attention_kernel.one_pass(length), prefetch=spans)
    assert bool(mx.array_equal(fetched, want).item())


@cuda_only
@pytest.mark.parametrize("arch,bits", [("llama", None), ("llama", 4), ("qwen3", None)])
def test_decoding_on_the_kernels_keeps_the_tokens(tiny, arch: str, bits: int | None) -> None:
    model = tiny(arch, bits, **WIDE)
    want = greedy_ids(model, None, n=40)
    decoder = CompiledDecoder(model, "segmented")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # every kernel passes its check here
        assert greedy_ids(model, decoder, n=40) == want
    assert decoder.stats["compiled"] == 1 and _attention(decoder) == {"kernel"}
    assert {plan.l2_prefetch for plan in decoder._plans.values()} == {True}  # noqa: SLF001
    decoder.close()


@cuda_only
@pytest.mark.parametrize("bits", [None, 4])
def test_the_prefetch_keeps_the_tokens_past_the_one_pass_length(tiny, switches: Any, bits: int | None) -> None:
    """The whole step on the kernels with the prefetch on gives the tokens it gives with it off,
    on both sides of 1024 positions (the one-pass form, then the first of two)."""
    model = tiny("llama", bits, **WIDE)
    runs = {}
    for setting in ("0", "1"):
        switches.env("PYMLXC_CUDA_L2_PREFETCH", setting)
        decoder = CompiledDecoder(model, "segmented")
        runs[setting] = greedy_ids(model, decoder, n=1040)
        assert {plan.l2_prefetch for plan in decoder._plans.values()} == {setting == "1"}  # noqa: SLF001
        decoder.close()
    assert runs["0"] == runs["1"]

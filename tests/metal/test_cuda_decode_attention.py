"""The whole decode step as one compiled graph, with each layer's attention as CUDA kernels that
read the position on the device (backends/metal/kernels/decode_attention.py, segments._trace_whole).

Everywhere: the setting is read by name; off CUDA `auto` keeps the segments and `1` runs the whole
step with MLX's masked attention, with the segments' tokens on both sides of the one-pass kernel's
1024 keys (each side its own trace); the check rejects kernels that differ from MLX's attention in
any bit.

On CUDA: the kernels equal MLX's attention bit for bit over head layouts, types, scales and
lengths, and models decoded on them keep the uncompiled loop's greedy tokens past 1024 positions.
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


@pytest.mark.parametrize("fault", ["one pass", "two passes"])
def test_the_check_rejects_any_difference(monkeypatch: pytest.MonkeyPatch, fault: str) -> None:
    """The check compares with MLX's attention on both kernels' lengths: one off by a unit in the
    last place is rejected with a warning naming the length; MLX's attention itself passes."""
    def stand_in(q: Any, keys: Any, values: Any, pos: Any, scale: float, single: bool) -> Any:
        out = attention_kernel.reference(q, keys, values, pos, scale)
        if fault != "none" and single == (fault == "one pass"):
            out = mx.view(mx.view(out, mx.int16) + mx.array(1, dtype=mx.int16), mx.float16)
        return out

    monkeypatch.setattr(attention_kernel, "attend", stand_in)
    first = 1 if fault == "one pass" else 1025
    with pytest.warns(RuntimeWarning, match=f"over {first} keys differs"):
        assert not attention_kernel.check(mx.float16, 4, 2, 64, 0.125)
    fault = "none"
    attention_kernel.checks.forget()
    assert attention_kernel.check(mx.float16, 4, 2, 64, 0.125)


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
    decoder.close()

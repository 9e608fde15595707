"""A block's fused gate/up product and the SiLU product after it as one CUDA kernel (the paired form
of backends/metal/kernels/matvec.py, `FusedProjection.silu_product`) in the segmented decode.

Everywhere: the setting is read by name; off CUDA the plan keeps MLX's SiLU; what the pairing
needs of a fusion; the check rejects a kernel that differs from MLX's `silu(gate) * up` in any bit.
On CUDA: the kernel equals MLX's SiLU product of the unpaired products over shapes, types and
group sizes, and 4-bit models decoded with it keep the uncompiled loop's greedy tokens.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pymlxc.core as mx
from pymlxc.backends.metal import kernel_choice
from pymlxc.backends.metal.decode import segments
from pymlxc.backends.metal.decode.decoder import CompiledDecoder

from .cuda_decode_helpers import (
    ON_CUDA,
    check_the_setting_is_read_by_name,
    cuda_only,
    forget_verdicts,
    greedy_ids,
    plan_flags,
)

fresh_checks = forget_verdicts(kernel_choice.pair_checks)  # each test sees its own verdicts


def test_the_decoder_reads_the_setting_by_name(tiny, switches: Any) -> None:
    check_the_setting_is_read_by_name(tiny(bits=4), switches, "PYMLXC_CUDA_GATE_UP", "cuda_gate_up", "pair_silu")


def test_what_the_pairing_needs(tiny) -> None:
    """4-bit gate/up fusions on pymlxc's matvec kernel; dense ones, or none, keep MLX's SiLU, and a
    projection whose plan did not set `pair_silu` returns None (the caller multiplies)."""
    dense = tiny()
    fusions = segments.fusions_for(segments.plan(dense), {})
    assert not segments.use_pair_silu(fusions, "1") and not segments.use_pair_silu(None, "1")
    gate_up = fusions[0][1].fused
    assert gate_up.pairable() is None
    x = mx.zeros((1, 1, dense.layers[0].mlp.gate_proj.weight.shape[1]), mx.float16)
    assert gate_up.silu_product(x) is None
    gate_up.pair_silu = True
    assert gate_up.silu_product(x) is None  # dense weights: no kernel
    if not ON_CUDA:  # 4-bit, but MLX's kernel (pymlxc's cannot run here)
        quantized = segments.fusions_for(segments.plan(tiny(bits=4)), {})
        assert quantized[0][1].fused.pairable() is None
        assert not segments.use_pair_silu(quantized, "auto") and not segments.use_pair_silu(quantized, "1")


def test_the_segments_pair_their_own_copies(tiny, monkeypatch: pytest.MonkeyPatch, switches: Any) -> None:
    """The paired kernel stood in for by MLX's operations: a plan that pairs hands every block's
    gate/up (the trace's copy) to it at the traces, the tokens are the uncompiled loop's, and the model's
    own fused projections are left unpaired (another plan, or the prefill, decides for itself)."""
    model = tiny(bits=4)
    want = greedy_ids(model, None)
    calls: list[tuple[int, ...]] = []

    def paired(x: Any, w: Any, s: Any, b: Any, group: int, bits: int, cuda_matvec: bool) -> Any:
        calls.append(tuple(x.shape))
        gate, up = mx.split(mx.quantized_matmul(x, w, s, b, True, group, bits), [w.shape[0] // 2], axis=-1)
        return gate * mx.sigmoid(gate) * up

    monkeypatch.setattr(segments.FusedProjection, "pairable", lambda self: (mx.float16, 32))
    monkeypatch.setattr(segments, "pair_ready", lambda *a: True)
    monkeypatch.setattr(segments, "kernel_silu_product", paired)
    switches.env("PYMLXC_CUDA_GATE_UP", "1")
    decoder = CompiledDecoder(model, "segmented")
    assert greedy_ids(model, decoder) == want
    assert plan_flags(decoder, "pair_silu") == {True}
    assert calls == [(1, 1, model.args.hidden_size)] * 2  # one trace of the middle segment, one of the last
    fusions = segments.fusions_for(segments.plan(model), decoder._fusions)  # noqa: SLF001 - the decoder's own
    assert not any(gate_up.fused.pair_silu for _, gate_up in fusions)
    decoder.close()


@pytest.mark.parametrize("fault", [True, False])
def test_the_check_rejects_any_difference(monkeypatch: pytest.MonkeyPatch, fault: bool) -> None:
    """The kernel stood in for by MLX's operations: one unit in the last place off is rejected with
    a warning; exact, the check passes."""
    def product(x: Any, w: Any, s: Any, b: Any, group: int, bits: int, cuda_matvec: bool = False) -> Any:
        return mx.quantized_matmul(x, w, s, b, True, group, bits)

    def paired(x: Any, w: Any, s: Any, b: Any, group: int, bits: int, cuda_matvec: bool) -> Any:
        gate, up = mx.split(product(x, w, s, b, group, bits), [w.shape[0] // 2], axis=-1)
        out = gate * mx.sigmoid(gate) * up
        return mx.view(mx.view(out, mx.int16) + mx.array(1, dtype=mx.int16), mx.float16) if fault else out

    monkeypatch.setattr(kernel_choice, "quantized_matmul", product)
    monkeypatch.setattr(kernel_choice, "silu_product", paired)
    if fault:
        with pytest.warns(RuntimeWarning, match=r"1 row\(s\) differs from MLX's silu"):
            assert not kernel_choice.pair_ready(mx.float16, 64)
    else:
        assert kernel_choice.pair_ready(mx.float16, 64)


# ---------------------------------------------------------------------- on CUDA

@cuda_only
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.integers(1, 8), k=st.sampled_from([256, 1024, 2048]), half=st.sampled_from([64, 320, 1000]),
       group=st.sampled_from([32, 64, 128]), dtype=st.sampled_from(["bfloat16", "float16"]), seed=st.integers(0, 2**16))
def test_the_paired_kernel_is_mlx_silu_of_the_products(rows: int, k: int, half: int, group: int, dtype: str,
                                                       seed: int) -> None:
    rng = np.random.default_rng(seed)
    t = getattr(mx, dtype)
    w, s, b = mx.quantize(mx.array(rng.standard_normal((2 * half, k)).astype(np.float32) * 0.05).astype(t), group, 4)
    x = mx.array(rng.standard_normal((rows, k)).astype(np.float32)).astype(t)
    got = kernel_choice.silu_product(x, w, s, b, group, 4, True)
    gate, up = mx.split(kernel_choice.quantized_matmul(x, w, s, b, group, 4, True), [half], axis=-1)
    assert got is not None and bool(mx.array_equal(got, gate * mx.sigmoid(gate) * up).item())


@cuda_only
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_decoding_with_the_paired_kernel_keeps_the_tokens(tiny, switches: Any, arch: str) -> None:
    switches.env("PYMLXC_CUDA_MATVEC", "1")
    model = tiny(arch, 4)
    want = greedy_ids(model, None, n=40)
    decoder = CompiledDecoder(model, "segmented")
    assert greedy_ids(model, decoder, n=40) == want
    assert plan_flags(decoder, "pair_silu") == {True}
    decoder.close()

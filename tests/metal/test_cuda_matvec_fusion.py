"""The residual adds and block RMSNorms inside the 4-bit products of the segmented decode step
(backends/metal/kernels/matvec.py's residual and normalized forms, `kernel_choice.residual_product`
and `normed_product`, `segments.use_matvec_fusion`).

Everywhere: the setting is read by name; off CUDA the plan keeps the separate kernels and a
forced setting warns; what the plan needs of a model; the check rejects a form that differs from
MLX's add or rms_norm around the plain products in any bit; with the two forms stood in for by
MLX's operations the restructured step gives the uncompiled loop's tokens.
On CUDA: each form equals MLX's operations around the plain kernel bit for bit over shapes, types
and group sizes, and 4-bit models decoded with them keep the uncompiled loop's greedy tokens.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import pymlxc.core as mx
from pymlxc.backends.metal import kernel_choice, nn
from pymlxc.backends.metal.decode import segments
from pymlxc.backends.metal.decode.decoder import CompiledDecoder
from pymlxc.backends.metal.kernels import add_rms_norm as cuda_norm
from pymlxc.backends.metal.kernels import rope_kv as cuda_rope_kv

from .cuda_decode_helpers import (
    ON_CUDA,
    StandIns,
    check_the_setting_is_read_by_name,
    cuda_only,
    forget_verdicts,
    greedy_ids,
    plan_flags,
)

fresh_checks = forget_verdicts(kernel_choice.fusion_checks, kernel_choice.pair_checks)


def _quantized(model: Any) -> list[Any]:
    return [m for _, m in model.named_modules() if isinstance(m, nn.QuantizedLinear)]


def test_the_decoder_reads_the_setting_by_name(tiny, switches: Any) -> None:
    check_the_setting_is_read_by_name(tiny(bits=4), switches, "PYMLXC_CUDA_MATVEC_FUSION", "cuda_matvec_fusion",
                                      "matvec_fusion", off="")


@pytest.mark.skipif(ON_CUDA, reason="off CUDA only: there the kernel cannot run")
def test_off_cuda_the_plan_keeps_the_separate_kernels(tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    """`auto` and `0` leave it off; `1` with every other condition met runs the check, which cannot
    run the kernel here: a warning, and off."""
    model = tiny(bits=4)
    blocks = segments.plan(model)
    fusions = segments.fusions_for(blocks, {})
    assert not segments.use_matvec_fusion(model, blocks, fusions, True, "auto")
    assert not segments.use_matvec_fusion(model, blocks, fusions, True, "0")
    for m in _quantized(model):
        m.use_cuda_matvec(True)
    fusions = segments.fusions_for(blocks, {})
    with pytest.warns(RuntimeWarning, match="residual add and the RMSNorm inside"):
        assert not segments.use_matvec_fusion(model, blocks, fusions, True, "1")


def test_what_the_plan_needs(tiny) -> None:
    """Paired gate/up products, 4-bit layers on pymlxc's kernel, q/k/v fusions without a tail,
    RMSNorms: without any one of them in any layer the plan keeps the separate kernels (before any
    check runs); a layer without them keeps them in that layer alone (`fused_layers`)."""
    dense = tiny()
    blocks = segments.plan(dense)
    assert not segments.use_matvec_fusion(dense, blocks, segments.fusions_for(blocks, {}), True, "1")
    model = tiny(bits=4)
    blocks = segments.plan(model)
    fusions = segments.fusions_for(blocks, {})
    assert not segments.use_matvec_fusion(model, blocks, fusions, True, "1")  # MLX's kernel marked
    assert not segments.use_matvec_fusion(model, blocks, None, True, "1")
    for m in _quantized(model):
        m.use_cuda_matvec(True)
    fusions = segments.fusions_for(blocks, {})
    assert all(f[0].fused.normable() == (mx.float16, 32) for f in fusions)
    assert not segments.use_matvec_fusion(model, blocks, fusions, False, "1")  # not paired
    both, o_only = segments.END_BOTH, segments.END_O
    assert segments.fused_layers(model, blocks, fusions) == ((True,) * 3, (both,) * 3)
    blocks[1].mlp.down_proj.use_cuda_matvec(False)  # o_proj's form and the normalized gate/up stay
    assert segments.fused_layers(model, blocks, fusions) == ((True,) * 3, (both, o_only, both))
    # "ends" has no normalized gate/up product: an END_O block keeps MLX's add + norm there
    assert segments.ends_in("ends", (both, o_only, "")) == (both, "", "")
    assert segments.ends_in("all", (both, o_only, "")) == (both, o_only, "")
    blocks[2].self_attn.v_proj.use_cuda_matvec(False)  # q/k/v then fuse on MLX's kernel
    fusions = segments.fusions_for(blocks, {})
    assert segments.fused_layers(model, blocks, fusions) == ((True, True, False), (both, o_only, both))
    blocks[0].self_attn.o_proj.use_cuda_matvec(False)
    assert segments.fused_layers(model, blocks, fusions) == ((True, True, False), ("", o_only, both))
    for b in blocks:
        b.mlp.down_proj.use_cuda_matvec(False)
        b.self_attn.v_proj.use_cuda_matvec(False)
        b.self_attn.o_proj.use_cuda_matvec(False)
    fusions = segments.fusions_for(blocks, {})
    assert segments.fused_layers(model, blocks, fusions) == ((False,) * 3, ("",) * 3)
    assert not segments.use_matvec_fusion(model, blocks, fusions, True, "1")
    qwen3 = tiny("qwen3", bits=4)  # q and k normalized: only where their norms joined the fusion
    for m in _quantized(qwen3):
        m.use_cuda_matvec(True)
    blocks = segments.plan(qwen3)
    fusions = segments.fusions_for(blocks, {})
    assert all(f[0].fused.qk_norm_weight is not None for f in fusions)
    fusions[1][0].fused.qk_norm_weight = None
    assert segments.fused_layers(qwen3, blocks, fusions) == ((True, False, True), (segments.END_BOTH,) * 3)
    assert kernel_choice.fusion_checks.known() == {}


def test_auto_takes_models_up_to_the_size_bound(tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    """`auto` (as on CUDA, the check stood in for) takes every form for a model of few 4-bit bytes a
    block, and past FUSION_MAX_BYTES_PER_LAYER (where the device bounds the step and the normalized
    gate/up product's repeated norms cost more than the kernel it saves) the q/k/v and down_proj
    forms only; `1` takes every form at both sizes, `ends` the two."""
    model = tiny(bits=4)
    for m in _quantized(model):
        m.use_cuda_matvec(True)
    blocks = segments.plan(model)
    fusions = segments.fusions_for(blocks, {})
    monkeypatch.setattr(segments.kernel_check, "on_cuda", lambda: True)
    monkeypatch.setattr(segments, "fusion_ready", lambda *a: True)
    assert segments.use_matvec_fusion(model, blocks, fusions, True, "auto") == "all"
    assert segments.use_matvec_fusion(model, blocks, fusions, True, "ends") == "ends"
    size = nn.bytes_per_block(model, _quantized(model))
    monkeypatch.setattr(segments, "FUSION_MAX_BYTES_PER_LAYER", size - 1)
    assert segments.use_matvec_fusion(model, blocks, fusions, True, "auto") == "ends"
    assert segments.use_matvec_fusion(model, blocks, fusions, True, "1") == "all"


@pytest.mark.parametrize("rows", [9, 16])
def test_more_rows_than_the_kernel_serves_take_mlx_operations(rows: int) -> None:
    """A batch past the kernel's rows (or its shared memory) gets the same results from MLX's norm,
    add and products instead of a launch that cannot run."""
    rng = np.random.default_rng(rows)
    d, n, group = 256, 96, 64

    def random(*shape: int, scale: float = 1.0) -> Any:
        return mx.array(rng.standard_normal(shape).astype(np.float32) * scale).astype(mx.float16)

    w, s, b = mx.quantize(random(2 * n, d, scale=0.05), group, 4)
    wo, so, bo = mx.quantize(random(d, d, scale=0.05), group, 4)
    h, x, nw = random(rows, 1, d), random(rows, 1, d), random(d)
    assert not kernel_choice.normed_takes(h, w, s, b, group, 4)
    product = mx.quantized_matmul(mx.fast.rms_norm(h, nw, 1e-5), w, s, b, True, group, 4)
    gate, up = mx.split(product, [n], axis=-1)
    assert mx.array_equal(kernel_choice.normed_product(h, w, s, b, group, nw, 1e-5), product).item()
    assert mx.array_equal(kernel_choice.normed_product(h, w, s, b, group, nw, 1e-5, pair=True),
                          gate * mx.sigmoid(gate) * up).item()
    want = h + mx.quantized_matmul(x, wo, so, bo, True, group, 4)
    assert mx.array_equal(kernel_choice.residual_product(x, wo, so, bo, group, h), want).item()


def test_a_residual_or_norm_of_another_type_takes_mlx_operations() -> None:
    """One row (the kernel's shapes), but a float32 residual or norm weight beside float16 x: MLX's
    add and norm with their type promotion, not the kernel (which writes x's type)."""
    rng = np.random.default_rng(3)
    d, group = 256, 64
    w, s, b = mx.quantize(mx.array(rng.standard_normal((d, d)).astype(np.float32) * 0.05).astype(mx.float16), group, 4)
    x = mx.array(rng.standard_normal((1, 1, d)).astype(np.float32)).astype(mx.float16)
    h32 = mx.array(rng.standard_normal((1, 1, d)).astype(np.float32))
    nw32 = mx.array(rng.standard_normal(d).astype(np.float32))
    with kernel_choice.mlx_kernels_only():  # the plain products too: MLX's (this runs on CPU as well)
        got = kernel_choice.residual_product(x, w, s, b, group, h32)
        assert got.dtype == mx.float32
        assert mx.array_equal(got, h32 + mx.quantized_matmul(x, w, s, b, True, group, 4)).item()
        got = kernel_choice.normed_product(x, w, s, b, group, nw32, 1e-5)
    assert mx.array_equal(got, mx.quantized_matmul(mx.fast.rms_norm(x, nw32, 1e-5), w, s, b, True, group, 4)).item()


def test_the_check_rejects_any_difference(monkeypatch: pytest.MonkeyPatch) -> None:
    """The forms stood in for by MLX's operations: exact, the check passes; one unit in the last
    place off in either form is rejected with a warning naming it."""
    def product(x: Any, w: Any, s: Any, b: Any, group: int, bits: int, cuda_matvec: bool = False) -> Any:
        return mx.quantized_matmul(x, w, s, b, True, group, bits)

    def residual(x: Any, w: Any, s: Any, b: Any, group: int, res: Any) -> Any:
        return res + product(x, w, s, b, group, 4)

    def normed(h: Any, w: Any, s: Any, b: Any, group: int, nw: Any, eps: float, pair: bool = False) -> Any:
        y = product(mx.fast.rms_norm(h, nw, eps), w, s, b, group, 4)
        if pair:
            gate, up = mx.split(y, [w.shape[0] // 2], axis=-1)
            y = gate * mx.sigmoid(gate) * up
        return y

    def off_by_one(fn: Any) -> Any:
        return lambda *a, **k: mx.view(mx.view(fn(*a, **k), mx.int16) + mx.array(1, dtype=mx.int16), mx.float16)

    monkeypatch.setattr(kernel_choice, "quantized_matmul", product)
    monkeypatch.setattr(kernel_choice, "kernel_takes", lambda *a: True)
    monkeypatch.setattr(kernel_choice, "normed_takes", lambda *a: True)
    monkeypatch.setattr(kernel_choice, "residual_product", residual)
    monkeypatch.setattr(kernel_choice, "normed_product", normed)
    assert kernel_choice.fusion_ready(mx.float16, 64, 1024, 1e-5)
    for name, fn, form in (("residual_product", residual, "residual form"), ("normed_product", normed,
                                                                              "normalized form")):
        kernel_choice.fusion_checks.forget()
        with monkeypatch.context() as patch:
            patch.setattr(kernel_choice, name, off_by_one(fn))
            with pytest.warns(RuntimeWarning, match=f"its {form} for 1 row"):
                assert not kernel_choice.fusion_ready(mx.float16, 64, 1024, 1e-5)


@pytest.mark.parametrize(("arch", "setting"), [("llama", "1"), ("qwen3", "1"), ("llama", "ends"), ("qwen3", "ends")])
def test_the_restructured_step_keeps_the_tokens(tiny, monkeypatch: pytest.MonkeyPatch, switches: Any,
                                                arch: str, setting: str) -> None:
    """The two forms and the paired product stood in for by MLX's operations: a plan with the fusion
    gives the uncompiled loop's tokens (the residual stream through the products is right), and each
    traced segment calls the forms as the step needs them: per layer a normalized q/k/v and gate/up
    product and two residual products; with `ends` a normalized q/k/v product, the plain pair and
    one residual product (down_proj)."""
    model = tiny(arch, bits=4)
    want = greedy_ids(model, None)
    for m in _quantized(model):
        m.use_cuda_matvec(True)
    stand_ins = StandIns()
    stand_ins.install(monkeypatch)
    switches.env("PYMLXC_CUDA_MATVEC_FUSION", setting)
    switches.env("PYMLXC_CUDA_ROPE_IN_PRODUCT", "0")  # the q/k/v products as the normalized form alone
    switches.env("PYMLXC_CUDA_GATE_UP", "1")
    decoder = CompiledDecoder(model, "segmented")
    assert greedy_ids(model, decoder) == want
    mode = "all" if setting == "1" else "ends"
    assert decoder.stats["compiled"] == 1 and plan_flags(decoder, "matvec_fusion") == {mode}
    # Traces: the first segment (one normalized q/k/v), the middle (a layer's end and the next's
    # q/k/v), the last (a layer's end).
    end = ["residual", "pair", "residual"] if mode == "all" else ["plain pair", "residual"]
    assert stand_ins.calls == ["normed", *end, "normed", *end]
    decoder.close()


@pytest.mark.parametrize(("setting", "whole"), [("1", "0"), ("ends", "0"), ("1", "1")])
def test_layers_that_cannot_take_the_forms_keep_mlx_operations(tiny, monkeypatch: pytest.MonkeyPatch,
                                                                switches: Any, setting: str, whole: str) -> None:
    """A model whose layers differ (a GGUF Q4_K_M file's Q6_K value and down projections): block 1's
    down_proj and block 2's q/k/v off pymlxc's kernel. The other layers still take the forms; block 1
    keeps its o_proj's residual form and its normalized gate/up product with "all" (END_O), its down
    product and the add after it MLX's; block 2's heads keep MLX's norm; the tokens are the uncompiled
    loop's. The middle segments of
    blocks 0-1 and 1-2 have arrays of the same shapes but different forms: each gets its own trace.
    `whole`: the step as one graph (PYMLXC_CUDA_DECODE_ATTENTION=1, MLX's attention here), whose
    one trace runs every segment's body with its own flags."""
    model = tiny(bits=4)
    want = greedy_ids(model, None)
    for m in _quantized(model):
        m.use_cuda_matvec(True)
    blocks = segments.plan(model)
    blocks[1].mlp.down_proj.use_cuda_matvec(False)
    blocks[2].self_attn.v_proj.use_cuda_matvec(False)
    stand_ins = StandIns()
    stand_ins.install(monkeypatch)
    switches.env("PYMLXC_CUDA_MATVEC_FUSION", setting)
    switches.env("PYMLXC_CUDA_ROPE_IN_PRODUCT", "0")
    switches.env("PYMLXC_CUDA_GATE_UP", "1")
    switches.env("PYMLXC_CUDA_DECODE_ATTENTION", whole)
    decoder = CompiledDecoder(model, "segmented")
    assert greedy_ids(model, decoder) == want
    mode = "all" if setting == "1" else "ends"
    assert plan_flags(decoder, "matvec_fusion") == {mode}
    assert plan_flags(decoder, "layers") == {((True, True, False), (segments.END_BOTH, segments.END_O,
                                                                     segments.END_BOTH))}
    assert plan_flags(decoder, "attention") == {"mlx" if whole == "1" else None}
    end = ["residual", "pair", "residual"] if mode == "all" else ["plain pair", "residual"]
    # first: block 0's normalized q/k/v; middle 0-1: block 0's end, block 1's q/k/v; middle 1-2:
    # block 1's end (with "all": o_proj's residual form and the normalized pair, then MLX's down_proj
    # and add; with "ends": the plain pair, MLX's down_proj and adds), block 2's q/k/v (MLX's); last:
    # block 2's end
    end_o = ["residual", "pair"] if mode == "all" else ["plain pair"]
    assert stand_ins.calls == ["normed", *end, "normed", *end_o, *end]
    decoder.close()


@pytest.mark.parametrize("rope_setting", ["auto", "0"])
def test_the_rope_form_keeps_the_tokens(tiny, monkeypatch: pytest.MonkeyPatch, switches: Any,
                                        rope_setting: str) -> None:
    """The forms, the RoPE kernel and the RoPE form stood in for by MLX's operations: with the RoPE
    form each q/k/v step of the first and middle traces is one call of it (no separate normalized
    product, no RoPE kernel), `0` keeps the normalized product and the RoPE kernel, and the tokens
    are the uncompiled loop's either way."""
    model = tiny(bits=4)
    want = greedy_ids(model, None)
    for m in _quantized(model):
        m.use_cuda_matvec(True)
    stand_ins = StandIns()
    stand_ins.install(monkeypatch)
    monkeypatch.setattr(cuda_rope_kv, "check", lambda *a: True)
    monkeypatch.setattr(cuda_rope_kv, "rope_write_kv", stand_ins.rope_kernel)
    for variable in ("PYMLXC_CUDA_MATVEC_FUSION", "PYMLXC_CUDA_GATE_UP", "PYMLXC_CUDA_ROPE_KV"):
        switches.env(variable, "1")
    switches.env("PYMLXC_CUDA_ROPE_IN_PRODUCT", rope_setting)
    decoder = CompiledDecoder(model, "segmented")
    assert greedy_ids(model, decoder) == want
    assert plan_flags(decoder, "rope_in_product") == {rope_setting == "auto"}
    step = ["rope form"] if rope_setting == "auto" else ["normed", "rope kernel"]
    end = ["residual", "pair", "residual"]
    assert stand_ins.calls == [*step, *end, *step, *end]
    decoder.close()


# ---------------------------------------------------------------------- on CUDA

@cuda_only
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.integers(1, 4), d=st.sampled_from([64, 512, 1152, 2048, 4096]), n=st.sampled_from([64, 320, 1000]),
       group=st.sampled_from([32, 64, 128]), dtype=st.sampled_from(["bfloat16", "float16"]),
       eps=st.sampled_from([1e-5, 1e-6]), seed=st.integers(0, 2**16))
def test_the_forms_are_mlx_around_the_plain_kernel(rows: int, d: int, n: int, group: int, dtype: str, eps: float,
                                                   seed: int) -> None:
    assume(d % group == 0)
    rng = np.random.default_rng(seed)
    t = getattr(mx, dtype)

    def random(*shape: int, scale: float = 1.0) -> Any:
        return mx.array(rng.standard_normal(shape).astype(np.float32) * scale).astype(t)

    w_in = mx.quantize(random(2 * n, d, scale=0.05), group, 4)
    w_out = mx.quantize(random(d, 2 * n, scale=0.05), group, 4) if (2 * n) % group == 0 else None
    h, nw = random(rows, 1, d), random(d)
    assert kernel_choice.normed_takes(h, *w_in, group, 4) == cuda_norm.applies(d, t)
    if not kernel_choice.normed_takes(h, *w_in, group, 4):
        return
    normed = mx.fast.rms_norm(h, nw, eps)
    both = kernel_choice.quantized_matmul(normed, *w_in, group, 4, True)
    assert mx.array_equal(kernel_choice.normed_product(h, *w_in, group, nw, eps), both).item()
    gate, up = mx.split(both, [n], axis=-1)
    paired = kernel_choice.normed_product(h, *w_in, group, nw, eps, pair=True)
    assert mx.array_equal(paired, gate * mx.sigmoid(gate) * up).item()
    if w_out is not None:
        x = random(rows, 1, 2 * n)
        want = h + kernel_choice.quantized_matmul(x, *w_out, group, 4, True)
        assert mx.array_equal(kernel_choice.residual_product(x, *w_out, group, h), want).item()


@cuda_only
@pytest.mark.parametrize(("arch", "hidden", "setting"), [("llama", 1024, "auto"), ("qwen3", 512, "auto"),
                                                        ("llama", 64, "auto"), ("llama", 1024, "ends")])
def test_decoding_with_the_forms_keeps_the_tokens(tiny, switches: Any, arch: str, hidden: int, setting: str) -> None:
    switches.env("PYMLXC_CUDA_MATVEC", "1")
    switches.env("PYMLXC_CUDA_MATVEC_FUSION", setting)
    model = tiny(arch, bits=4, hidden_size=hidden, intermediate_size=2 * hidden)
    want = greedy_ids(model, None, n=40)
    decoder = CompiledDecoder(model, "segmented")
    assert greedy_ids(model, decoder, n=40) == want
    assert plan_flags(decoder, "matvec_fusion") == {"all" if setting == "auto" else "ends"}
    assert plan_flags(decoder, "rope_in_product") == {arch == "llama"}  # Qwen 3 normalizes q and k first
    decoder.close()


@cuda_only
@pytest.mark.parametrize(("hq", "hkv", "dh", "d", "group"), [(32, 8, 64, 2048, 64), (8, 2, 128, 1024, 32),
                                                            (4, 4, 64, 512, 128)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("freqs", [False, True])
def test_the_rope_form_is_the_normalized_product_and_the_rope_kernel(hq: int, hkv: int, dh: int, d: int, group: int,
                                                                     dtype: str, freqs: bool) -> None:
    """The check itself (bit for bit at positions 0 to 8191) passes for Llama-like RoPEs, by base and
    by a frequency table."""
    table = mx.array((10000.0 ** (np.arange(0, dh, 2) / dh)).astype(np.float32)) if freqs else None
    rope = cuda_rope_kv.rope_table(dims=dh, traditional=False, base=None if freqs else 500000.0, scale=1.0,
                                   freqs=table, head_dim=dh)
    assert rope is not None
    assert kernel_choice.rope_fusion_ready(getattr(mx, dtype), group, d, 1e-5, hq, hkv, dh, rope)

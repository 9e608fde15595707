"""The matvec kernel's dense form for 16-bit models (backends/metal/kernels/matvec.py with `dense`,
`kernel_choice.dense_matmul` and the forms with `scales` None, `nn.choose_dense_matvec`).

Everywhere: the launch geometry covers every row once; the load-time choice marks the block
linears only on CUDA, within the size bound of `auto`, and once the kernel's check passes; a
16-bit model's plan takes the residual, normalized and paired forms as a 4-bit model's does, and
with them stood in for by MLX's operations its step gives the uncompiled loop's tokens.
On CUDA: the dense kernel agrees with float64, its forms equal MLX's operations around it bit for
bit, and 16-bit models decoded with them keep the uncompiled loop's greedy tokens.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pymlxc.core as mx
from pymlxc.backends.metal import kernel_choice, nn
from pymlxc.backends.metal.decode import segments
from pymlxc.backends.metal.decode.decoder import CompiledDecoder
from pymlxc.backends.metal.kernels import add_rms_norm as cuda_norm
from pymlxc.backends.metal.kernels import matvec as cuda_matvec
from pymlxc.backends.metal.kernels import rope_kv as cuda_rope_kv
from pymlxc.backends.metal.loader import load_weights_and_config
from pymlxc.testing import write_tiny_model

from .cuda_decode_helpers import ON_CUDA, StandIns, cuda_only, forget_verdicts, greedy_ids, plan_flags

fresh_checks = forget_verdicts(kernel_choice.fusion_checks, kernel_choice.pair_checks, kernel_choice.dense_checks)


def _mark(model: Any, on: bool = True) -> list[Any]:
    linears = nn.block_linears(model)
    for m in linears:
        m.use_cuda_matvec(on)
    return linears


@given(n=st.integers(1, 200_000), k=st.sampled_from([64, 512, 520, 1024, 2048, 4096, 14336]), m=st.integers(1, 8),
       norm=st.booleans())
def test_the_dense_launch_covers_every_row_once(n: int, k: int, m: int, norm: bool) -> None:
    geo = cuda_matvec.launch(m, k, n, mx.bfloat16, 0, norm=(128, 1, 0) if norm else None, dense=True)
    template = dict(geo["template"])
    blocks, rem = divmod(geo["grid"][0], cuda_matvec.THREADS_PER_BLOCK)
    assert rem == 0 and geo["threadgroup"] == (cuda_matvec.THREADS_PER_BLOCK, 1, 1)
    # chunks of 8 weights: two row groups where a row has at most 64 of them
    groups = 2 if k // 8 <= 64 else 1
    assert cuda_matvec.row_groups(k, dense=True) == template["S"] == groups
    per_block = groups * template["U"]
    assert per_block == cuda_matvec.units_per_block(k, norm, dense=True)
    assert blocks * per_block >= -(-n // 2) > (blocks - 1) * per_block
    assert template["KC"] == k // 8 and template["M"] == m and "G" not in template and not template["PAIR"]
    assert ("D" in template) == norm


def test_the_dense_source_is_the_four_bit_kernel_with_its_own_product() -> None:
    """One kernel body: the dense form differs from the 4-bit one in the chunk's product alone (no
    scales, chunks of 8 weights), and each form adds the same prologue and epilogue to both."""
    for form in ("plain", "residual", "norm", "rope"):
        dense, quantized = cuda_matvec._source(form, dense=True), cuda_matvec._source(form)
        assert "scales" not in dense and "scales[" in quantized
        assert "constexpr int K = KC * 8;" in dense and "constexpr int K = KC * 32;" in quantized
        tail = "__shared__ float part[WARPS][M][RB];"
        assert dense[dense.index(tail):] == quantized[quantized.index(tail):]
    assert cuda_matvec._source("plain", dense=True) == cuda_matvec.DENSE_SOURCE


def test_what_the_dense_kernel_applies_to() -> None:
    d = cuda_matvec.dense_applies
    assert d(1, 2048, 2) and d(8, 8, 2)
    assert not d(9, 2048, 2)  # prefill rows: MLX's matmul
    assert not d(1, 2048, 4)  # float32
    assert not d(1, 2044, 2)  # K not a multiple of 8
    x = mx.zeros((1, 1, 64), mx.float16)
    assert kernel_choice.dense_takes(x, mx.zeros((32, 64), mx.float16))
    assert not kernel_choice.dense_takes(x, mx.zeros((32, 64), mx.bfloat16))  # another type than x
    assert not kernel_choice.dense_takes(x, mx.zeros((32, 128), mx.float16))


def test_the_choice_marks_block_linears_only_on_cuda(tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    """Off CUDA nothing is marked; on CUDA (stood in for, the check passing) `auto` and `1` mark the
    block linears of the compute type, not the head; `0` none; a check that fails leaves them
    unmarked, and a mark set before is taken back."""
    model = tiny()
    linears = nn.block_linears(model)
    assert len(linears) == 3 * 7 and all(type(m) is nn.Linear for m in linears)
    assert model.lm_head is None or model.lm_head not in linears
    assert not nn.choose_dense_matvec(model, "1", mx.float16) or ON_CUDA
    monkeypatch.setattr(nn, "on_cuda", lambda: True)
    monkeypatch.setattr(nn, "dense_ready", lambda dtype: True)
    assert nn.choose_dense_matvec(model, "auto", mx.float16)
    assert all(m.cuda_matvec for m in linears)
    assert not nn.choose_dense_matvec(model, "auto", mx.bfloat16)  # not the weights' type
    assert not any(m.cuda_matvec for m in linears)
    assert nn.choose_dense_matvec(model, "1", mx.float16)
    assert not nn.choose_dense_matvec(model, "0", mx.float16) and not any(m.cuda_matvec for m in linears)
    assert nn.choose_dense_matvec(model, "auto", mx.float16)
    gemma = tiny("gemma3")  # no segmented decode: the kernel's product alone would gain nothing
    assert nn.block_linears(gemma) and not nn.choose_dense_matvec(gemma, "1", mx.float16)
    with monkeypatch.context() as patch:
        patch.setattr(model, "layer_windows", lambda: [None, 64, None])  # a sliding window: no segments
        assert not nn.choose_dense_matvec(model, "1", mx.float16) and not any(m.cuda_matvec for m in linears)
    assert nn.choose_dense_matvec(model, "1", mx.float16) and all(m.cuda_matvec for m in linears)
    monkeypatch.setattr(nn, "dense_ready", lambda dtype: False)
    assert not nn.choose_dense_matvec(model, "1", mx.float16) and not any(m.cuda_matvec for m in linears)
    with pytest.raises(ValueError, match="cuda_dense_matvec"):
        nn.choose_dense_matvec(model, "yes", mx.float16)


def test_the_loader_chooses_for_a_model_without_quantized_layers(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The load-time choice runs for a 16-bit model too (not only where layers are quantized): with
    CUDA and the kernel's check stood in for, its block linears come marked; by default off CUDA none."""
    path = write_tiny_model(tmp_path / "m", "llama", num_layers=2, dtype="float16")
    loaded = load_weights_and_config(path)
    try:
        assert not any(m.cuda_matvec for m in nn.block_linears(loaded.model)) or ON_CUDA
    finally:
        loaded.model.free()
    monkeypatch.setattr(nn, "on_cuda", lambda: True)
    monkeypatch.setattr(nn, "dense_ready", lambda dtype: True)
    loaded = load_weights_and_config(path)
    try:
        linears = nn.block_linears(loaded.model)
        assert len(linears) == 2 * 7 and all(m.cuda_matvec for m in linears)
    finally:
        loaded.model.free()


@pytest.mark.skipif(ON_CUDA, reason="off CUDA only: there the kernel cannot run")
def test_off_cuda_a_forced_choice_warns_and_keeps_mlx(tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check itself, with the machine taken for CUDA: the kernel cannot run on this CPU, so it
    warns, names the kernel, and nothing is marked; the products stay MLX's."""
    model = tiny()
    monkeypatch.setattr(nn, "on_cuda", lambda: True)
    with pytest.warns(RuntimeWarning, match="dense matvec"):
        assert not nn.choose_dense_matvec(model, "1", mx.float16)
    assert not any(m.cuda_matvec for m in nn.block_linears(model))


def test_marked_linears_outside_the_kernel_s_reach_are_mlx_s_product(tiny) -> None:
    """A marked linear computes MLX's product where the kernel does not run: many rows (a prefill
    chunk), or inside `mlx_kernels_only` (traces, gradients)."""
    model = tiny()
    layer = _mark(model)[0]
    rng = np.random.default_rng(0)
    for rows in (1, 12):
        x = mx.array(rng.standard_normal((rows, layer.weight.shape[1])).astype(np.float32)).astype(mx.float16)
        want = mx.matmul(x, mx.transpose(layer.weight))
        with kernel_choice.mlx_kernels_only():
            assert mx.array_equal(layer(x), want).item()
        if rows > cuda_matvec.MAX_X_ROWS:
            assert mx.array_equal(layer(x), want).item()


def test_a_16_bit_plan_takes_the_forms_where_its_linears_are_marked(tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fusions of marked dense linears are normable and pairable at group 0 (the dense key of
    the checks), every layer can take the forms, and `auto` chooses all of them for a model under
    the size bound (the checks stood in for); unmarked, none."""
    model = tiny()
    blocks = segments.plan(model)
    fusions = segments.fusions_for(blocks, {})
    assert all(f[0].fused.normable() is None for f in fusions)
    assert segments.fused_layers(model, blocks, fusions) == ((False,) * 3, ("",) * 3)
    _mark(model)
    fusions = segments.fusions_for(blocks, {})
    assert all(f[0].fused.normable() == (mx.float16, 0) and f[1].fused.pairable() == (mx.float16, 0)
               for f in fusions)
    assert segments.fused_layers(model, blocks, fusions) == ((True,) * 3, (segments.END_BOTH,) * 3)
    monkeypatch.setattr(segments.kernel_check, "on_cuda", lambda: True)
    asked: list[tuple[Any, ...]] = []
    monkeypatch.setattr(segments, "fusion_ready", lambda *a: asked.append(a) or True)
    assert segments.use_matvec_fusion(model, blocks, fusions, True, "auto") == "all"
    assert {a[1] for a in asked} == {0}
    dense_weights = sum(m.weight.size for m in nn.block_linears(model)) / 3
    monkeypatch.setattr(segments, "FUSION_MAX_BYTES_PER_LAYER", dense_weights / 2 - 1)
    assert segments.use_matvec_fusion(model, blocks, fusions, True, "auto") == "ends"


@pytest.mark.parametrize(("arch", "rope"), [("llama", "0"), ("qwen3", "0"), ("llama", "1")])
def test_a_16_bit_step_with_the_forms_keeps_the_tokens(tiny, monkeypatch: pytest.MonkeyPatch, switches: Any,
                                                       arch: str, rope: str) -> None:
    """A float16 model's marked linears, the forms stood in for by MLX's operations: the plan takes
    every form, each traced segment calls them as a 4-bit model's does, and the tokens are the
    uncompiled loop's."""
    model = tiny(arch)
    want = greedy_ids(model, None)
    _mark(model)
    stand_ins = StandIns()
    stand_ins.install(monkeypatch)
    if rope == "1":
        monkeypatch.setattr(cuda_rope_kv, "check", lambda *a: True)
        monkeypatch.setattr(cuda_rope_kv, "rope_write_kv", stand_ins.rope_kernel)
    for variable in ("PYMLXC_CUDA_MATVEC_FUSION", "PYMLXC_CUDA_GATE_UP"):
        switches.env(variable, "1")
    switches.env("PYMLXC_CUDA_ROPE_KV", rope)
    switches.env("PYMLXC_CUDA_ROPE_IN_PRODUCT", "auto" if rope == "1" else "0")
    decoder = CompiledDecoder(model, "segmented")
    assert greedy_ids(model, decoder) == want
    assert plan_flags(decoder, "matvec_fusion") == {"all"}
    step = ["rope form"] if rope == "1" else ["normed"]
    end = ["residual", "pair", "residual"]
    assert stand_ins.calls == [*step, *end, *step, *end]
    decoder.close()


# ---------------------------------------------------------------------- on CUDA

@cuda_only
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_dense_kernel_passes_its_check(dtype: str) -> None:
    assert kernel_choice.dense_ready(getattr(mx, dtype))
    assert kernel_choice.pair_ready(getattr(mx, dtype), 0)
    assert kernel_choice.fusion_ready(getattr(mx, dtype), 0, 2048, 1e-5)


@cuda_only
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.integers(1, 4), d=st.sampled_from([64, 512, 1152, 2048, 4096]), n=st.sampled_from([64, 320, 1000]),
       dtype=st.sampled_from(["bfloat16", "float16"]), eps=st.sampled_from([1e-5, 1e-6]), seed=st.integers(0, 2**16))
def test_the_dense_forms_are_mlx_around_the_plain_kernel(rows: int, d: int, n: int, dtype: str, eps: float,
                                                         seed: int) -> None:
    rng = np.random.default_rng(seed)
    t = getattr(mx, dtype)

    def random(*shape: int, scale: float = 1.0) -> Any:
        return mx.array(rng.standard_normal(shape).astype(np.float32) * scale).astype(t)

    w_in, w_out = random(2 * n, d, scale=0.05), random(d, 2 * n, scale=0.05)
    h, nw, x = random(rows, 1, d), random(d), random(rows, 1, 2 * n)
    plain = kernel_choice.dense_matmul(x, w_out, True)
    want = np.asarray(x.astype(mx.float32)).astype(np.float64) @ np.asarray(w_out.astype(mx.float32)).T
    assert np.allclose(np.asarray(plain.astype(mx.float32)), want, rtol=2e-2, atol=2e-2)
    assert mx.array_equal(kernel_choice.residual_product(x, w_out, None, None, 0, h), h + plain).item()
    assert kernel_choice.normed_takes(h, w_in, None, None, 0, 4) == cuda_norm.applies(d, t)
    if not kernel_choice.normed_takes(h, w_in, None, None, 0, 4):
        return
    both = kernel_choice.dense_matmul(mx.fast.rms_norm(h, nw, eps), w_in, True)
    assert mx.array_equal(kernel_choice.normed_product(h, w_in, None, None, 0, nw, eps), both).item()
    paired = kernel_choice.normed_product(h, w_in, None, None, 0, nw, eps, pair=True)
    assert mx.array_equal(paired, kernel_choice.silu_of_pair(both)).item()
    plain_pair = kernel_choice.silu_product(h, w_in, None, None, 0, 16, True)
    assert plain_pair is not None
    assert mx.array_equal(plain_pair, kernel_choice.silu_of_pair(kernel_choice.dense_matmul(h, w_in, True))).item()


@cuda_only
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_dense_rope_form_passes_its_check(dtype: str) -> None:
    rope = cuda_rope_kv.rope_table(dims=64, traditional=False, base=500000.0, scale=1.0, freqs=None, head_dim=64)
    assert rope is not None
    assert kernel_choice.rope_fusion_ready(getattr(mx, dtype), 0, 2048, 1e-5, 32, 8, 64, rope)


@cuda_only
@pytest.mark.parametrize(("arch", "hidden"), [("llama", 1024), ("qwen3", 512), ("llama", 64)])
def test_decoding_16_bit_models_with_the_forms_keeps_the_tokens(tiny, switches: Any, arch: str, hidden: int) -> None:
    switches.env("PYMLXC_CUDA_DENSE_MATVEC", "1")
    model = tiny(arch, hidden_size=hidden, intermediate_size=2 * hidden)
    assert all(m.cuda_matvec for m in nn.block_linears(model))
    want = greedy_ids(model, None, n=40)
    decoder = CompiledDecoder(model, "segmented")
    assert greedy_ids(model, decoder, n=40) == want
    assert plan_flags(decoder, "matvec_fusion") == {"all"}
    assert plan_flags(decoder, "rope_in_product") == {arch == "llama"}
    decoder.close()

"""pymlxc's 4-bit tensor-core prefill product (backends/metal/kernels/qmm.py) and its choice at load.

Everywhere: the launch covers every output tile; `mark_qmm_products` marks no
layer where the kernel cannot run (a CPU), with a warning naming why, and marks none when told not to;
large blocks take prompt chunks off the compiled prefill so that they reach the kernel, small ones not.

On CUDA (MLX's CUDA build): the product matches a float64 reference on MLX's dequantized weights as
closely as MLX's own `quantized_matmul`, for row counts, widths, depths, group sizes and dtypes
that are not whole tiles; its load-time check passes; a model marked for it prefills into the
same greedy tokens as with it off, with logits close.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pymlxc.core as mx
from pymlxc.backends.metal import kernel_choice, nn
from pymlxc.backends.metal.kernels import qmm
from pymlxc.backends.metal.loader import load_weights_and_config
from pymlxc.testing import write_tiny_model

ON_CUDA = mx.cuda_available()
cuda_only = pytest.mark.skipif(not ON_CUDA, reason="the kernel needs MLX's CUDA build (run on the GPU machine)")


@pytest.mark.parametrize(("m", "k", "n"), [(128, 2048, 2048), (1, 64, 1), (65, 4096, 129)])
def test_the_launch_covers_every_tile(m: int, k: int, n: int) -> None:
    geo = qmm.launch(m, k, n, mx.float16, 32)
    threads, rows, depth = geo["grid"]
    assert geo["threadgroup"] == (qmm.THREADS, 1, 1)
    assert (threads // qmm.THREADS) * qmm.TILE_N >= n > (threads // qmm.THREADS - 1) * qmm.TILE_N
    assert rows * qmm.TILE_M >= m > (rows - 1) * qmm.TILE_M
    assert depth == 1
    assert dict(geo["template"]) == {"T": mx.float16, "G": 32}


@pytest.mark.parametrize(("rows", "k", "bits", "group", "size", "takes"), [
    (128, 2048, 4, 32, 2, True), (128, 2048, 4, 64, 2, True), (16, 4096, 4, 128, 2, True),
    (128, 2048, 8, 64, 2, False), (128, 2048, 4, 64, 4, False), (128, 96, 4, 32, 2, False),
    (128, 2048, 4, 16, 2, False), (0, 2048, 4, 64, 2, False)])
def test_what_the_kernel_takes(rows: int, k: int, bits: int, group: int, size: int, takes: bool) -> None:
    assert qmm.applies(rows, k, bits, group, size) is takes


def _tiny(tmp_path: Any, group: int = 64) -> Any:
    path = write_tiny_model(tmp_path / "tiny", quantize_bits=4, group_size=group, hidden_size=128,
                            intermediate_size=256, num_layers=2, dtype="float16")
    return load_weights_and_config(path)


@pytest.mark.skipif(ON_CUDA, reason="the kernel runs on CUDA; this asks what happens where it cannot")
def test_no_layer_is_marked_where_the_kernel_cannot_run(tmp_path: Any) -> None:
    loaded = _tiny(tmp_path)
    layers = [m for _, m in loaded.model.named_modules() if isinstance(m, nn.QuantizedLinear)]
    assert layers and not any(m._qmm_rows for m in layers)  # the loader's `auto` is off without CUDA
    kernel_choice.qmm_checks.forget()
    with pytest.warns(RuntimeWarning, match="prefill product is not used: it cannot run here"):
        assert nn.mark_qmm_products(loaded.model, True, layers[0].scales.dtype) is False
    assert not any(m._qmm_rows for m in layers)
    assert nn.mark_qmm_products(loaded.model, False, layers[0].scales.dtype) is False


def test_a_marked_layer_routes_op_by_op_chunks_to_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows from QMM_MIN_ROWS, outside a shapeless trace (the compiled prefill) and outside
    `mlx_kernels_only()`, go to the kernel; fewer rows, a trace, or that scope keep MLX's product."""
    layer = nn.QuantizedLinear.from_linear(_linear(128, 64), group_size=64, bits=4)
    layer.scales, layer.biases = layer.scales.astype(mx.float16), layer.biases.astype(mx.float16)
    layer._qmm_rows = nn.QMM_MIN_ROWS
    calls: list[tuple[int, ...]] = []

    def recorded(x: Any, *args: Any) -> Any:
        calls.append(tuple(x.shape))
        return mx.quantized_matmul(x, *args[:3], True, args[3], 4)

    monkeypatch.setattr(nn, "qmm_product", recorded)
    for rows in (1, nn.QMM_MIN_ROWS - 1, nn.QMM_MIN_ROWS, 100):
        layer(mx.zeros((1, rows, 128), mx.float16))
    with nn.shapeless_trace():
        layer(mx.zeros((1, 100, 128), mx.float16))
    with kernel_choice.mlx_kernels_only():
        layer(mx.zeros((1, 100, 128), mx.float16))
    assert calls == [(1, nn.QMM_MIN_ROWS, 128), (1, 100, 128)]


def test_large_blocks_take_prompt_chunks_off_the_compiled_prefill(tmp_path: Any, monkeypatch: pytest.MonkeyPatch
                                                                   ) -> None:
    """Marked layers of a group size in QMM_OP_BY_OP_GROUPS (32: GGUF's layouts) holding
    QMM_OP_BY_OP_BLOCK_BYTES or more a block set the model's `qmm_rows`; smaller blocks, group 64
    (MLX's own 4-bit, marked all the same), or no marked layer, leave it 0."""
    monkeypatch.setattr(nn, "qmm_ready", lambda *a: True)  # the kernel's check stood in for (no CUDA here)
    for group, op_by_op in ((32, True), (64, False)):
        model = _tiny(tmp_path / str(group), group).model
        dtype = next(m for _, m in model.named_modules() if isinstance(m, nn.QuantizedLinear)).scales.dtype
        monkeypatch.setattr(nn, "QMM_OP_BY_OP_BLOCK_BYTES", 64 << 20)
        assert nn.mark_qmm_products(model, True, dtype) and model.qmm_rows == 0  # a tiny model's blocks
        monkeypatch.setattr(nn, "QMM_OP_BY_OP_BLOCK_BYTES", 1)
        assert nn.mark_qmm_products(model, True, dtype)  # the kernel takes op-by-op products either way
        assert model.qmm_rows == (nn.QMM_MIN_ROWS if op_by_op else 0), group
        assert not nn.mark_qmm_products(model, False, dtype) and model.qmm_rows == 0


def test_chunks_from_the_models_qmm_rows_skip_the_compiled_prefill(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The prefill's chunk forward calls the compiled runner below the model's `qmm_rows` and runs
    the model op by op from there (where the kernel can take the products)."""
    from pymlxc.backends.metal import generate  # noqa: PLC0415
    from pymlxc.backends.metal.decode import prefill  # noqa: PLC0415
    from pymlxc.backends.metal.decode.decoder import CompiledDecoder  # noqa: PLC0415

    model = _tiny(tmp_path).model
    model.qmm_rows = nn.QMM_MIN_ROWS  # the layers stay unmarked: op by op runs MLX's product here
    runner_rows: list[int] = []
    real = prefill.PrefillRunner.__call__
    monkeypatch.setattr(prefill.PrefillRunner, "__call__",
                        lambda self, chunk, *a: runner_rows.append(chunk.shape[1]) or real(self, chunk, *a))
    decoder = CompiledDecoder(model, "segmented")
    runner = decoder.prefill_runner(False)
    assert runner is not None
    forward = generate._chunk_forward(model, None, runner)
    cache = model.make_cache(None)
    for rows in (nn.QMM_MIN_ROWS - 1, nn.QMM_MIN_ROWS, 40):
        forward(mx.zeros((1, rows), mx.int32), cache, 0, None)
    assert runner_rows == [nn.QMM_MIN_ROWS - 1]
    assert cache[0].offset == 2 * nn.QMM_MIN_ROWS - 1 + 40  # every chunk wrote the cache
    decoder.close()


def _linear(k: int, n: int) -> Any:
    lin = nn.Linear(k, n)
    lin.weight = mx.array(np.random.default_rng(0).standard_normal((n, k)).astype(np.float32)).astype(mx.float16)
    return lin


# ---------------------------------------------------------------------- on CUDA

def _case(rng: np.random.Generator, m: int, k: int, n: int, group: int, dtype: Any) -> tuple[Any, ...]:
    dense = mx.array((rng.standard_normal((n, k)) * 0.05).astype(np.float32)).astype(dtype)
    w, s, b = mx.quantize(dense, group, 4)
    deq = np.asarray(mx.dequantize(w, s, b, group, 4).astype(mx.float32), dtype=np.float64)
    x = mx.array(rng.standard_normal((m, k)).astype(np.float32)).astype(dtype)
    return x, w, s, b, np.asarray(x.astype(mx.float32), np.float64), deq


@cuda_only
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(m=st.integers(1, 300), steps=st.integers(1, 40), n=st.integers(1, 700), group=st.sampled_from([32, 64, 128]),
       dtype=st.sampled_from(["bfloat16", "float16"]), seed=st.integers(0, 2**16))
def test_the_product_is_as_close_to_float64_as_mlx(m: int, steps: int, n: int, group: int, dtype: str,
                                                   seed: int) -> None:
    k = -(-steps * qmm.TILE_K // group) * group  # a multiple of the tile and of the group
    x, w, s, b, xf, deq = _case(np.random.default_rng(seed), m, k, n, group, getattr(mx, dtype))
    want = xf @ deq.T
    scale = float((np.abs(xf) @ np.abs(deq).T).max()) or 1.0
    ours = np.asarray(kernel_choice.qmm_product(x, w, s, b, group).astype(mx.float32))
    theirs = np.asarray(mx.quantized_matmul(x, w, s, b, True, group, 4).astype(mx.float32))
    assert ours.shape == (m, n)
    err_ours = float(np.abs(ours - want).max()) / scale
    err_theirs = float(np.abs(theirs - want).max()) / scale
    assert err_ours <= max(2 * err_theirs, 2.0 ** -9), (err_ours, err_theirs)


@cuda_only
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize(("m", "k", "n"), [(128, 2048, 2048), (128, 2048, 16384), (512, 4096, 1024), (16, 8192, 2048)])
def test_prefill_shapes(m: int, k: int, n: int, dtype: str) -> None:
    x, w, s, b, xf, deq = _case(np.random.default_rng(1), m, k, n, 64, getattr(mx, dtype))
    want = xf @ deq.T
    ours = np.asarray(kernel_choice.qmm_product(mx.reshape(x, (1, m, k)), w, s, b, 64).astype(mx.float32))
    assert ours.shape == (1, m, n)
    np.testing.assert_allclose(ours[0], want, rtol=0, atol=2.0 ** -7 * float((np.abs(xf) @ np.abs(deq).T).max()))


@cuda_only
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_the_load_time_check_passes(dtype: str, group: int) -> None:
    kernel_choice.qmm_checks.forget()
    assert kernel_choice.qmm_ready(getattr(mx, dtype), group)


@cuda_only
@pytest.mark.parametrize("group", [32, 64])
def test_a_marked_model_prefills_into_the_same_tokens(tmp_path: Any, group: int) -> None:
    from pymlxc.backends.metal import generate as loops  # noqa: PLC0415
    from pymlxc.backends.metal.sample import greedy  # noqa: PLC0415

    loaded = _tiny(tmp_path, group)
    model = loaded.model
    prompt = [(7 * i) % 90 + 3 for i in range(100)]

    def run(use: bool) -> tuple[list[int], np.ndarray]:
        assert nn.mark_qmm_products(model, use, model.compute_dtype) is use
        cache = model.make_cache()
        logits = model(mx.array([prompt]), cache=cache)[0, -1].astype(mx.float32)
        tokens = list(loops.generate_ids(model, prompt, cache=model.make_cache(), sampler=greedy, max_tokens=12))
        return tokens, np.asarray(logits)

    tokens_on, logits_on = run(True)
    tokens_off, logits_off = run(False)
    assert tokens_on == tokens_off
    np.testing.assert_allclose(logits_on, logits_off, rtol=0, atol=0.05 * float(np.abs(logits_off).max()))

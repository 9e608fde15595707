"""The kernels that read Q2_K/Q3_K/Q6_K blocks (backends/metal/kernels/gguf_blocks.py) and the block
layers that use them (backends/metal/gguf_layers.py).

Everywhere: the kernels' lane arithmetic, replayed in numpy from the same formulas, is
`gguf.quants.dequantize` bit for bit; a many-row product dequantizes bounded chunks and equals the
whole-matrix product; on a machine where a kernel cannot run the layers warn once and compute with
MLX ops; the CUDA sources compile with nvcc for sm_90.

On CUDA (MLX's CUDA build): the dequantization kernel equals the reference bit for bit, the
matvec kernel matches a float64 product within float32 summation error for varied shapes, row
counts and dtypes, the switch layer's kernel path equals its MLX path, and a tiny model with a
Q6_K head decodes the same tokens with the kernels as with MLX ops.
"""
from __future__ import annotations

import shutil
import subprocess
import warnings
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import pymlxc.core as mx
from pymlxc.backends.metal import generate as loops
from pymlxc.backends.metal import gguf_layers, kernel_choice
from pymlxc.backends.metal.formats.gguf_quants import dequantize_blocks
from pymlxc.backends.metal.gguf_layers import BlockEmbedding, BlockLinear, BlockSwitchLinear
from pymlxc.backends.metal.kernels import gguf_blocks
from pymlxc.backends.metal.loader import load_weights_and_config
from pymlxc.backends.metal.sample import greedy
from pymlxc.testing import write_tiny_model

from .cuda_decode_helpers import ON_CUDA, cuda_only, int16_rounding
from .gguf_export import export_gguf

TYPES = (Q.Q2_K, Q.Q3_K, Q.Q6_K)


@pytest.fixture(autouse=True)
def _quiet() -> None:
    warnings.simplefilter("ignore", DeprecationWarning)


# ---------------------------------------------------------------------- the lane arithmetic, in numpy

def _half(b: np.ndarray, at: int) -> np.float32:
    return np.float32(b[at:at + 2].view(np.float16)[0])


def values8(b: np.ndarray, p0: int, qtype: Q) -> np.ndarray:
    """`pymlxc_gguf::values8` transcribed: the 8 values from p0 of one block b (uint8), float32."""
    n, k, l, s = p0 >> 7, (p0 & 127) >> 5, p0 & 31, p0 >> 4
    out = np.empty(8, np.float32)
    for i in range(8):
        if qtype == Q.Q6_K:
            dl = _half(b, 208) * np.float32(np.int8(b[192 + s].view(np.int8)))
            q = ((int(b[64 * n + 32 * (k & 1) + l + i]) >> (4 * (k >> 1))) & 15) \
                | (((int(b[128 + 32 * n + l + i]) >> (2 * k)) & 3) << 4)
            out[i] = dl * (np.float32(q) - np.float32(32))
        elif qtype == Q.Q3_K:
            sc = (int(b[96 + s]) & 15) if s < 8 else (int(b[88 + s]) >> 4)
            sc |= ((int(b[104 + (s & 3)]) >> (2 * (s >> 2))) & 3) << 4
            dl = _half(b, 108) * (np.float32(sc) - np.float32(32))
            q = ((int(b[32 + 32 * n + l + i]) >> (2 * k)) & 3) - (0 if (int(b[l + i]) >> (p0 >> 5)) & 1 else 4)
            out[i] = dl * np.float32(q)
        else:
            sc = int(b[s])
            dl, ml = _half(b, 80) * np.float32(sc & 15), _half(b, 82) * np.float32(sc >> 4)
            out[i] = dl * np.float32((int(b[16 + 32 * n + l + i]) >> (2 * k)) & 3) - ml
    return out


@settings(max_examples=12, deadline=None)
@given(qtype=st.sampled_from(TYPES), seed=st.integers(0, 2**32 - 1), scale=st.sampled_from([2.0**-20, 0.02, 3.0]))
def test_lane_arithmetic_is_the_reference(qtype: Q, seed: int, scale: float) -> None:
    """32 lanes of 8 values each rebuild the block exactly as gguf.quants.dequantize does."""
    blocks = gguf_blocks.random_blocks(np.random.default_rng(seed), (2,), qtype, scale)
    for b in blocks:
        got = np.concatenate([values8(b, 8 * lane, qtype) for lane in range(32)])
        want = gguf.quants.dequantize(b.reshape(1, -1), qtype).reshape(-1)
        np.testing.assert_array_equal(got.view(np.uint32), want.astype(np.float32).view(np.uint32))


def _q6k_row_dot(row: np.ndarray, x: np.ndarray, align: int, integer: bool = False) -> float:
    """The CUDA Q6_K matvec's sum for one row of blocks [NB, 210] and x [NB * 256], replayed: each
    step's 4 blocks staged from the 16-byte boundary below them (the row starting `align` bytes past
    one), lane j of a block's 8 taking values 128 (j / 4) + 32 k + 8 (j % 4) + i from 32-bit words
    (two per 8 bytes, through the aligned words around them), codes and scales as the source forms them.
    `integer`: the 2-byte x arithmetic, the lane's 32 values of x (float32) rounded to int16 against
    their largest (xi = rint(x * 32767 / max |x|), one rounding as the kernel's FMA gives it) and
    integer sums of xi (q - 32) per scale, times d * sc * max |x| / 32767."""
    nb = row.shape[0]
    flat = np.concatenate([np.zeros(align, np.uint8), row.reshape(-1), np.zeros(16, np.uint8)])
    total = 0.0
    for step in range((nb + 3) // 4):
        start = align + step * 4 * 210
        base = start & ~15
        need = ((start - base) + min(4, nb - 4 * step) * 210 + 15) >> 4
        stage = np.zeros(54 * 16, np.uint8)
        stage[:need * 16] = flat[base:base + need * 16]
        at = start - base

        def word8(off: int, stage: np.ndarray = stage) -> tuple[int, int]:
            a = off & ~3
            w = [int(stage[a + 4 * j:a + 4 * j + 4].view(np.uint32)[0]) for j in range(3)]
            shift = (off & 3) * 8
            lo = ((w[0] | (w[1] << 32)) >> shift) & 0xFFFFFFFF
            hi = ((w[1] | (w[2] << 32)) >> shift) & 0xFFFFFFFF
            return lo, hi

        for lane in range(32):
            blk = 4 * step + (lane >> 3)
            if blk >= nb:
                continue
            sub = lane & 7
            half, l0 = sub >> 2, (sub & 3) * 8
            b = at + 210 * (lane >> 3)
            va, vb, vc, vs = (word8(b + 64 * half + l0), word8(b + 64 * half + 32 + l0),
                              word8(b + 128 + 32 * half + l0), word8(b + 192 + 8 * half))
            d = float(stage[b + 208:b + 210].view(np.float16)[0])
            xm = x[blk * 256 + 128 * half + l0:]
            dx = 1.0
            if integer:
                xi, dxs = int16_rounding(np.array([xm[32 * k + i] for k in range(4) for i in range(8)]))
                assert np.abs(xi).max() <= 32767
                xm = np.zeros(128)
                for k in range(4):
                    xm[32 * k:32 * k + 8] = xi[8 * k:8 * k + 8]
                dx = float(dxs[0])
            parts = [0.0] * 4
            for h in range(2):
                a_, b_, c_ = va[h], vb[h], vc[h]
                codes = [(a_ & 0x0F0F0F0F) | ((c_ << 4) & 0x30303030), (b_ & 0x0F0F0F0F) | ((c_ << 2) & 0x30303030),
                         ((a_ >> 4) & 0x0F0F0F0F) | (c_ & 0x30303030),
                         ((b_ >> 4) & 0x0F0F0F0F) | ((c_ >> 2) & 0x30303030)]
                for k in range(4):
                    for i in range(4):
                        parts[k] += float(xm[32 * k + 4 * h + i]) * (((codes[k] >> (8 * i)) & 0xFF) - 32)
            total_lane = 0.0
            for k in range(4):
                byte = 2 * k + (l0 >> 4)
                sc = (vs[byte >> 2] >> (8 * (byte & 3))) & 0xFF
                total_lane += (sc - 256 if sc >= 128 else sc) * parts[k]
            total += d * dx * total_lane
    return total


@settings(max_examples=8, deadline=None)
@given(nb=st.integers(1, 9), align=st.sampled_from([0, 2, 4, 14]), seed=st.integers(0, 2**32 - 1))
def test_q6k_kernel_staging_and_lanes_are_the_reference(nb: int, align: int, seed: int) -> None:
    """The CUDA Q6_K kernel's reading of a row (staged steps of 4 blocks from any 2-byte offset,
    a step short of 4 blocks at the row's end) gives the reference dequantization's product."""
    rng = np.random.default_rng(seed)
    row = gguf_blocks.random_blocks(rng, (nb,), Q.Q6_K)
    x = rng.standard_normal(nb * 256)
    want = float(x @ gguf.quants.dequantize(row.reshape(1, -1), Q.Q6_K).reshape(-1).astype(np.float64))
    got = _q6k_row_dot(row, x, align)
    assert abs(got - want) <= 1e-9 * (1 + float(np.abs(x).sum()))


@settings(max_examples=20, deadline=None)
@given(nb=st.integers(1, 3), data=st.data())
def test_the_rounding_step_groups_the_values_as_the_kernels_lanes(nb: int, data: st.DataObject) -> None:
    """One value of x set: `q6k_rounding_step` is half a step of it exactly at the 32 values that
    the kernel's lane holding it rounds together (`_q6k_row_dot`'s lanes: block, h = bit 7 and
    j = bits 3-4 of its index in the block; all k and i), and 0 elsewhere."""
    at = data.draw(st.integers(0, nb * 256 - 1))
    x = np.zeros(nb * 256)
    x[at] = 1.0
    block, h, j = at // 256, (at % 256) // 128, (at % 32) // 8
    lane = {256 * block + 128 * h + 32 * k + 8 * j + i for k in range(4) for i in range(8)}
    step = gguf_blocks.q6k_rounding_step(x[None])[0]
    assert set(np.flatnonzero(step)) == lane
    assert np.all(step[sorted(lane)] == 1.0 / 65534)


@settings(max_examples=30, deadline=None)
@given(nb=st.integers(1, 9), align=st.sampled_from([0, 2, 14]), seed=st.integers(0, 2**32 - 1),
       spread=st.sampled_from([0.0, 3.0]))
@example(nb=4, align=0, seed=239058, spread=3.0)  # outliers that the lane's k, not its h, groups together
def test_q6k_integer_products_stay_within_their_rounding_bound(nb: int, align: int, seed: int, spread: float) -> None:
    """With 2-byte x the CUDA Q6_K kernel rounds each lane's 32 values of x to int16: its product
    is the reference's within half a rounding step per value times |w| (`q6k_rounding_step`), for
    x with outliers inside a lane's values too (spread), where that rounding loses the most."""
    rng = np.random.default_rng(seed)
    row = gguf_blocks.random_blocks(rng, (nb,), Q.Q6_K)
    x = rng.standard_normal(nb * 256) * np.exp(spread * rng.standard_normal(nb * 256))
    xf = np.clip(x, -60000, 60000).astype(np.float16).astype(np.float64)
    w = gguf.quants.dequantize(row.reshape(1, -1), Q.Q6_K).reshape(-1).astype(np.float64)
    want = float(xf @ w)
    got = _q6k_row_dot(row, xf, align, integer=True)
    rounding = gguf_blocks.x_rounding_bound("cuda", Q.Q6_K, 2, xf[None, None], w[None, None])
    assert abs(got - want) <= float(rounding[0, 0, 0]) + 1e-12 * float(np.abs(xf) @ np.abs(w))
    # float32 x and the other kernels keep x as it is
    assert gguf_blocks.x_rounding_bound("cuda", Q.Q6_K, 4, xf[None, None], w[None, None]) == 0
    assert gguf_blocks.x_rounding_bound("metal", Q.Q6_K, 2, xf[None, None], w[None, None]) == 0


# ---------------------------------------------------------------------- the layers, on any device

def _layer(qtype: Q, n: int, nb: int, seed: int) -> tuple[BlockLinear, np.ndarray]:
    layer = BlockLinear(nb * 256, n, qtype)
    blocks = gguf_blocks.random_blocks(np.random.default_rng(seed), (n, nb), qtype)
    layer.weight = mx.array(blocks)
    dense = gguf.quants.dequantize(blocks.reshape(n, -1), qtype).astype(np.float64)
    return layer, dense


@pytest.mark.parametrize("qtype", TYPES)
def test_many_rows_in_chunks_against_float64(qtype: Q, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill-sized product over 5 chunks of rows (each dequantized for its own matmul) equals
    the float64 product."""
    n, nb, rows = 640, 4, 24
    layer, dense = _layer(qtype, n, nb, 1)
    x = np.random.default_rng(2).standard_normal((rows, nb * 256)).astype(np.float32)
    want = x.astype(np.float64) @ dense.T
    monkeypatch.setattr(gguf_layers, "chunk_weights", lambda: 128 * nb * 256)
    got = np.asarray(layer(mx.array(x)))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))


def test_a_gpu_dequantizes_larger_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU takes GPU_CHUNK_WEIGHTS a chunk (each chunk costs MLX host work), the CPU CHUNK_WEIGHTS; a
    layer's row ranges follow: they cover its rows in order, none past the chunk's weights (one
    chunk for Llama-3.1-8B's down projection on a GPU, four on the CPU)."""
    layer = BlockLinear(14336, 4096, Q.Q6_K)
    for kind, weights in ((None, gguf_layers.CHUNK_WEIGHTS), ("cuda", gguf_layers.GPU_CHUNK_WEIGHTS),
                          ("metal", gguf_layers.GPU_CHUNK_WEIGHTS)):
        monkeypatch.setattr(gguf_blocks, "device_kind", lambda kind=kind: kind)
        assert gguf_layers.chunk_weights() == weights
        chunks = layer.row_chunks()
        assert chunks[0][0] == 0 and chunks[-1][1] == 4096
        assert len(chunks) == (4 if kind is None else 1)
        assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:], strict=False))
        assert all((stop - start) * 14336 <= weights for start, stop in chunks)


def test_one_chunk_and_many_chunks_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    layer, _ = _layer(Q.Q6_K, 96, 2, 3)
    x = mx.array(np.random.default_rng(4).standard_normal((2, 5, 512)).astype(np.float32))
    whole = np.asarray(layer(x))
    monkeypatch.setattr(gguf_layers, "chunk_weights", lambda: 7 * 512)  # 14 chunks, the last one short
    # Equal on the CPU; cuBLAS sums a narrower matrix in another order (H100: 4e-4 on values up to 500).
    np.testing.assert_allclose(np.asarray(layer(x)), whole, rtol=1e-5, atol=1e-5 * float(np.abs(whole).max()))
    assert whole.shape == (2, 5, 96)


def test_a_kernel_that_cannot_run_warns_and_mlx_ops_compute(monkeypatch: pytest.MonkeyPatch) -> None:
    """A device claiming a GPU whose kernel fails (here the CPU build: MLX raises) is checked once,
    warns with the reason, and the layer's result is MLX's."""
    if ON_CUDA:
        pytest.skip("on CUDA the kernels run; tested below")
    monkeypatch.setattr(gguf_blocks, "device_kind", lambda: "cuda")
    gguf_blocks.checks.forget()
    layer, dense = _layer(Q.Q3_K, 40, 2, 5)
    x = np.random.default_rng(6).standard_normal((1, 512)).astype(np.float32)
    with pytest.warns(RuntimeWarning, match="GGUF Q2_K/Q3_K/Q6_K blocks is not used: it cannot run here"):
        got = np.asarray(layer(mx.array(x)))
    np.testing.assert_allclose(got, x @ dense.T, rtol=1e-4, atol=1e-4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # checked once: no second warning
        layer(mx.array(x))
    assert gguf_blocks.ready(Q.Q3_K, mx.float32) is None
    assert gguf_blocks.checks.known() == {("cuda", int(Q.Q3_K), str(mx.float32)): False}
    gguf_blocks.checks.forget()


def test_the_cpu_uses_mlx_ops() -> None:
    if ON_CUDA:
        pytest.skip("this machine has a GPU")
    assert gguf_blocks.device_kind() is None and gguf_blocks.ready(Q.Q6_K, mx.float16) is None


def test_cuda_sources_compile_for_sm90(tmp_path: Path) -> None:
    """Both CUDA kernels, in MLX's signature form, for every type, dtype and a few row counts."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not installed here")
    g = gguf_blocks
    lines = ["#include <cuda_fp16.h>", "#include <cuda_bf16.h>", "#include <cstdint>", g.CUDA_HEADER,
             "template <typename T, int M, int Q, int S, int R> __global__ void mv(const T* x, const uint8_t* w, "
             "const int32_t* w_shape, const int32_t* idx, T* out) {", g.CUDA_MATVEC_SOURCE, "}",
             "template <typename T, int Q, int S> __global__ void dq(const uint8_t* w, const int32_t* w_shape, T* out) {",
             g.CUDA_DEQUANT_SOURCE, "}",
             g.CUDA_Q6K_MATVEC_HEADER.replace(g.CUDA_HEADER, ""),
             "template <typename T, int M, int R, int W> __global__ void q6(const T* x, const uint8_t* w, "
             "const int32_t* w_shape, const int32_t* idx, T* out) {", g.CUDA_Q6K_MATVEC_SOURCE, "}",
             "template <typename T, int M, int R, int W> __global__ void q6p(const T* x, const uint8_t* w, "
             "const int32_t* w_shape, T* out) {", g.CUDA_Q6K_PLANES_SOURCE, "}"]
    for t in ("__half", "__nv_bfloat16", "float"):
        for m, w in ((1, 1), (1, 2), (8, 4)):
            lines.append(f"template __global__ void q6<{t},{m},2,{w}>(const {t}*, const uint8_t*, "
                         f"const int32_t*, const int32_t*, {t}*);")
            lines.append(f"template __global__ void q6p<{t},{m},4,{w}>(const {t}*, const uint8_t*, "
                         f"const int32_t*, {t}*);")
        for qtype in TYPES:
            q, s = g.TYPE_IDS[qtype], gguf.constants.GGML_QUANT_SIZES[qtype][1]
            for m in (1, 8):
                lines.append(f"template __global__ void mv<{t},{m},{q},{s},2>(const {t}*, const uint8_t*, "
                             f"const int32_t*, const int32_t*, {t}*);")
            lines.append(f"template __global__ void dq<{t},{q},{s}>(const uint8_t*, const int32_t*, {t}*);")
    src = tmp_path / "k.cu"
    src.write_text("\n".join(lines) + "\n")
    done = subprocess.run([nvcc, "-arch=sm_90", "-c", str(src), "-o", str(tmp_path / "k.o")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


# ---------------------------------------------------------------------- on CUDA

@cuda_only
@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_dequantization_kernel_is_the_reference(qtype: Q, dtype: Any) -> None:
    blocks = gguf_blocks.random_blocks(np.random.default_rng(7), (33, 3), qtype)
    want = gguf.quants.dequantize(blocks.reshape(33, -1), qtype).astype(np.float32)
    got = gguf_blocks.dequantize(mx.array(blocks), qtype, dtype, "cuda")
    np.testing.assert_array_equal(np.asarray(got.astype(mx.float32)), np.asarray(mx.array(want).astype(dtype)
                                                                                  .astype(mx.float32)))


@cuda_only
# Few row counts: NVRTC compiles the kernel once per (dtype, rows, type), about a second each.
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(qtype=st.sampled_from(TYPES), n=st.integers(1, 300), nb=st.integers(1, 9), m=st.sampled_from([1, 4, 8]),
       pairs=st.integers(1, 3), dtype=st.sampled_from(["float32", "float16", "bfloat16"]), seed=st.integers(0, 1000),
       warps=st.sampled_from([None, 1, 2, 4]))
def test_matvec_kernel_against_float64(qtype: Q, n: int, nb: int, m: int, pairs: int, dtype: str, seed: int,
                                       warps: int | None) -> None:
    """Every type's kernel (Q6_K's own CUDA kernel with each split of a row between warps)."""
    rng = np.random.default_rng(seed)
    dt = getattr(mx, dtype)
    experts = 2
    blocks = gguf_blocks.random_blocks(rng, (experts, n, nb), qtype)
    dense = gguf.quants.dequantize(blocks.reshape(experts * n, -1), qtype).reshape(experts, n, -1).astype(np.float64)
    x = mx.array(rng.standard_normal((pairs, m, nb * 256)).astype(np.float32)).astype(dt)
    idx = rng.integers(0, experts, pairs).astype(np.int32)
    got = np.asarray(gguf_blocks.matvec(x, mx.array(blocks), mx.array(idx), qtype, "cuda", warps=warps)
                     .astype(mx.float32))
    xf = np.asarray(x.astype(mx.float32)).astype(np.float64)
    want = np.einsum("pmk,pnk->pmn", xf, dense[idx])
    bound = np.einsum("pmk,pnk->pmn", np.abs(xf), np.abs(dense[idx]))
    out_round = 2.0**-8 if dtype != "float32" else 2.0**-23
    tol = (bound * 2.0**-20 + np.abs(want) * out_round + 1e-30
           + gguf_blocks.x_rounding_bound("cuda", qtype, dt.size, xf, dense[idx]))
    assert np.all(np.abs(got - want) <= tol)


@cuda_only
@pytest.mark.parametrize("qtype", TYPES)
def test_layers_on_the_kernels_equal_mlx_ops(qtype: Q) -> None:
    rng = np.random.default_rng(9)
    layer, dense = _layer(qtype, 130, 2, 10)
    emb = BlockEmbedding(130, 512, qtype)
    emb.weight = layer.weight
    ids = mx.array(np.array([[3, 129, 0]], np.int32))
    want_rows = np.asarray(dequantize_blocks(mx.take(layer.weight, mx.reshape(ids, (-1,)), axis=0), qtype))
    np.testing.assert_array_equal(np.asarray(emb(ids).astype(mx.float32)).reshape(3, -1),
                                  want_rows.reshape(3, -1).astype(np.float16).astype(np.float32))
    switch = BlockSwitchLinear(512, 130, 4, qtype)
    switch.weight = mx.array(gguf_blocks.random_blocks(rng, (4, 130, 2), qtype))
    x = mx.array(rng.standard_normal((1, 2, 1, 1, 512)).astype(np.float32))
    indices = mx.array(np.array([[[3, 1], [0, 3]]], np.int32).reshape(1, 2, 2))[:, :, :1]
    kernel = np.asarray(switch(x, indices))
    with kernel_choice.mlx_kernels_only():
        ops = np.asarray(switch(x, indices))
    np.testing.assert_allclose(kernel, ops, rtol=1e-5, atol=1e-5 * float(np.abs(ops).max()))


@cuda_only
def test_tiny_model_with_a_q6k_head_decodes_the_same_tokens(tmp_path: Path) -> None:
    """llama.cpp's default Q4_0 recipe keeps the tied embedding / head in Q6_K: greedy tokens with
    the matvec kernel equal those with MLX's ops (the dequantization kernel feeds both)."""
    model_dir = write_tiny_model(tmp_path / "hf", "llama", seed=3, hidden_size=256, intermediate_size=512,
                                 tie_word_embeddings=True)
    path = export_gguf(model_dir, tmp_path / "m.gguf", Q.Q4_0, extra_types={"token_embd.weight": Q.Q6_K})
    loaded = load_weights_and_config(path)
    model = loaded.model
    prompt = [3, 17, 260, 99, 5]
    fast = list(loops.generate_ids(model, prompt, cache=model.make_cache(64), sampler=greedy, max_tokens=12))
    with kernel_choice.mlx_kernels_only():
        slow = list(loops.generate_ids(model, prompt, cache=model.make_cache(64), sampler=greedy, max_tokens=12))
    assert fast == slow and len(fast) == 12

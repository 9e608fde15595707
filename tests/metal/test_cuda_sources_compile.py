"""pymlxc's CUDA kernel sources compile for sm_90 as MLX wraps them (tests/metal/nvrtc_compile.py), on a
machine without a GPU: every kernel the project registers (its `SharedKernel`s: the very names, sources and
headers it hands MLX), with the input and output dtypes and template arguments its call sites give, taken
from the modules' launch helpers and constants where they have them. Each source form compiles once or a few
times: every dtype, group size, block type and variant its module defines at least once across the cases. A
source that does not compile failed only on the GPU machine, at its first call. (Wrapping a body that does
not compile fails here too.)
"""
from __future__ import annotations

import math
import sys
from typing import Any

import pytest
from gguf import GGMLQuantizationType as QType
from gguf.constants import GGML_QUANT_SIZES

import pymlxc.core as mx
from pymlxc.backends.metal import kernel_choice
from pymlxc.backends.metal.kernels import (
    add_rms_norm,
    argmax,
    decode_attention,
    dequantize,
    gated_delta,
    gguf_blocks,
    matvec,
    prefill_attention,
    qmm,
    rope_kv,
)
from pymlxc.core.cuda_kernel import SharedKernel, float32_bits

from .nvrtc_compile import available, compile_source, wrap

pytestmark = pytest.mark.skipif(not available() and sys.platform != "linux",
                                reason="NVIDIA's NVRTC wheels are Linux's (the test extras install them there)")

BF16, F16, F32 = mx.bfloat16, mx.float16, mx.float32
Template = list[tuple[str, Any]]
# Llama-3.2-1B's attention heads (query, key/value, size) where a kernel's template names them.
HQ, HKV, DH = 32, 8, 64
# RoPE's template arguments (rope_kv.rope_write_kv's and kernel_choice.normed_rope_product's) by whether the
# frequencies come from a table (Llama 3's) or from a base.
ROPE: dict[bool, Template] = {
    True: [("FREQS", True), ("SCALE_BITS", float32_bits(1.0)), ("LOG2_BASE_BITS", 0)],
    False: [("FREQS", False), ("SCALE_BITS", float32_bits(1.0)), ("LOG2_BASE_BITS", float32_bits(math.log2(5e5)))]}


def _compiles(kernel: SharedKernel, dtype: Any, template: Template, **kinds: Any) -> None:
    """`kernel` compiles with `template`, each input and output of `dtype` but those `kinds` names (the
    dequantization's numbered ones by their stem: `w` for w0, w1, ...)."""
    name, inputs, outputs, source, header, _ = kernel._args  # noqa: SLF001 - what the project hands MLX

    def kind(arg: str) -> Any:
        return kinds.get(arg.rstrip("0123456789"), dtype)

    unit = wrap(name, source, header, [(n, kind(n)) for n in inputs], [(n, kind(n)) for n in outputs], template)
    log = compile_source(unit, name)
    assert log is None, log


# Every head size, query groups of 1 to 64 heads.
@pytest.mark.parametrize(("dtype", "heads", "kv_heads", "head_dim"), [
    (BF16, 32, 8, 64), (BF16, 28, 4, 128), (BF16, 40, 8, 112), (F16, 12, 4, 80), (F16, 64, 1, 96), (F16, 8, 8, 64)])
def test_prefill_attention(dtype: mx.Dtype, heads: int, kv_heads: int, head_dim: int) -> None:
    template = prefill_attention.launch(1, 37, heads, kv_heads, head_dim, dtype, head_dim ** -0.5)["template"]
    _compiles(kernel_choice._the_prefill_attention, dtype, template)  # noqa: SLF001
    # its left-padded form, with the rows' starts
    _compiles(kernel_choice._the_padded_prefill_attention, dtype, template, starts="int32")  # noqa: SLF001


# Every group size.
@pytest.mark.parametrize(("dtype", "group"), [*((BF16, g) for g in qmm.GROUP_SIZES), (F16, 64)])
def test_qmm(dtype: mx.Dtype, group: int) -> None:
    template = qmm.launch(128, 2048, 8192, dtype, group)["template"]
    _compiles(kernel_choice._the_qmm, dtype, template, w="uint32")  # noqa: SLF001


# One, three and MAX_WEIGHTS weights a call; every group size.
@pytest.mark.parametrize(("count", "dtype", "group"), [(1, BF16, 32), (dequantize.MAX_WEIGHTS, F16, 64),
                                                       (3, BF16, 128)])
def test_dequantize(count: int, dtype: mx.Dtype, group: int) -> None:
    template = dequantize.launch(1024, dtype, group)["template"]
    _compiles(kernel_choice._the_dequantize[count], dtype, template, w="uint32")  # noqa: SLF001


# kernel_choice's matvec forms, each over 4-bit and over dense weights: (form, dense, dtype, group size, rows of
# x, K, paired gate/up). K on both sides of `row_groups`' split; the rope form's rows are HQ + 2 HKV heads.
@pytest.mark.parametrize(("form", "dense", "dtype", "group", "rows", "k", "pair"), [
    ("plain", False, BF16, 32, 1, 4096, False), ("plain", False, F16, 64, 4, 2048, True),
    ("plain", False, BF16, 128, matvec.MAX_X_ROWS, 1024, False), ("residual", False, F16, 64, 2, 8192, False),
    ("norm", False, BF16, 32, 1, 2048, True), ("rope", False, F16, 128, 1, 3072, False),
    ("plain", True, BF16, 0, 1, 2048, True), ("residual", True, F16, 0, matvec.MAX_X_ROWS, 512, False),
    ("norm", True, F16, 0, 2, 4096, False), ("rope", True, BF16, 0, 1, 2048, False)])
def test_matvec(form: str, dense: bool, dtype: mx.Dtype, group: int, rows: int, k: int, pair: bool) -> None:
    norm = None
    if form in ("norm", "rope"):  # MLX's rms_norm geometry for rows of k and eps, as normed_product gives them
        geometry = add_rms_norm.geometry(k)
        assert geometry is not None
        norm = (*geometry, float32_bits(1e-5))
    n = (HQ + 2 * HKV) * DH
    template = matvec.launch(rows, k, n, dtype, group, pair=pair, norm=norm, dense=dense)["template"]
    if form == "rope":  # what normed_rope_product adds: the heads, the RoPE (a table here with 4-bit weights)
        template += [("HQ", HQ), ("HKV", HKV), ("DH", DH), *ROPE[not dense]]
    _compiles(kernel_choice._FORMS[form, dense], dtype, template,  # noqa: SLF001
              w=dtype if dense else "uint32", pos="int32", rope="float32")


# decode_attention.attend's kernels: one pass, or the two-pass pair (`part`, then `merge`); every head size.
@pytest.mark.parametrize(("kernel", "dtype", "d"), [
    ("one", BF16, 64), ("one", F32, 96), ("part", F16, 128), ("merge", BF16, 96)])
def test_decode_attention(kernel: str, dtype: mx.Dtype, d: int) -> None:
    single = kernel == "one"
    template = [("T", dtype), ("HQ", HQ), ("HKV", HKV), ("D", d),
                ("SCALE_LOG2_BITS", decode_attention._scale_bits(d ** -0.5, single))]  # noqa: SLF001
    shared = {"one": decode_attention._one_pass, "part": decode_attention._two_pass_1,  # noqa: SLF001
              "merge": decode_attention._two_pass_2}[kernel]  # noqa: SLF001
    _compiles(shared, dtype, template[:4] if kernel == "merge" else template, pos="int32",
              partials="float32", sums="float32", maxs="float32")


# argmax.argmax's two stages: the partial one at each logits dtype and Llama 3's, Qwen's, Llama 2's vocabularies.
@pytest.mark.parametrize(("dtype", "v"), [(BF16, 128256), (F16, 151936), (F32, 32000)])
def test_argmax_partial(dtype: mx.Dtype, v: int) -> None:
    template = [("T", dtype), ("V", v), ("SLICES", argmax.slices(v))]
    _compiles(argmax._partial, dtype, template, values="float32", indices="int32")  # noqa: SLF001


def test_argmax_final() -> None:
    _compiles(argmax._final, "int32", [("SLICES", argmax.slices(128256))], values="float32")  # noqa: SLF001


# Rows of MLX's rms_norm geometry: 128 threads of 2 loads, its unaligned form (Gemma-3-1B's), 64 threads of 1.
@pytest.mark.parametrize(("dtype", "d"), [(BF16, 2048), (F16, 1152), (BF16, 512)])
def test_add_rms_norm(dtype: mx.Dtype, d: int) -> None:
    geometry = add_rms_norm.geometry(d)
    assert geometry is not None
    template = [("T", dtype), ("BLOCK", geometry[0]), ("CHUNKS", geometry[1]), ("D", d),
                ("EPS_BITS", float32_bits(1e-5))]
    _compiles(add_rms_norm._the_kernel, dtype, template)  # noqa: SLF001


# rope_kv.rope_write_kv: the fused projection's output as it comes (JOINT) or heads apart; either RoPE.
@pytest.mark.parametrize(("dtype", "joint", "freqs", "d", "dv"), [(BF16, True, True, 128, 128),
                                                                  (F16, False, False, 64, 32)])
def test_rope_kv(dtype: mx.Dtype, joint: bool, freqs: bool, d: int, dv: int) -> None:
    template = [("T", dtype), ("HQ", HQ), ("HKV", HKV), ("D", d), ("DV", dv), ("JOINT", joint), *ROPE[freqs]]
    _compiles(rope_kv._the_kernel, dtype, template, pos="int32", rope="float32")  # noqa: SLF001


# gated_delta.run's kernel (its CUDA dialect) at (Dk, Dv, Hk, Hv, T): Qwen3-Next's heads, a small multi-token one.
@pytest.mark.parametrize(("dtype", "dims"), [(BF16, (128, 128, 16, 32, 1)), (F16, (64, 32, 2, 4, 7)),
                                             (F32, (128, 128, 16, 64, 1))])
def test_gated_delta(dtype: mx.Dtype, dims: tuple[int, int, int, int, int]) -> None:
    template = [("InT", dtype), *zip(("Dk", "Dv", "Hk", "Hv", "T"), dims, strict=True)]
    _compiles(gated_delta._cuda, dtype, template,  # noqa: SLF001
              g="float32", beta="float32", state_in="float32", state_out="float32")


# gguf_blocks.matvec's generic kernel (rows of x: 1 to MAX_X_ROWS) and gguf_blocks.dequantize, each block type.
GGUF_TYPES = [(QType.Q2_K, F16, 1), (QType.Q3_K, BF16, gguf_blocks.MAX_X_ROWS), (QType.Q6_K, F32, 2)]


@pytest.mark.parametrize(("qtype", "dtype", "m"), GGUF_TYPES)
def test_gguf_matvec(qtype: QType, dtype: mx.Dtype, m: int) -> None:
    template = [("T", dtype), ("M", m), ("Q", gguf_blocks.TYPE_IDS[qtype]), ("S", GGML_QUANT_SIZES[qtype][1]),
                ("R", gguf_blocks.ROWS_PER_WARP)]
    _compiles(gguf_blocks._cuda_matvec, dtype, template, w="uint8", idx="int32")  # noqa: SLF001


@pytest.mark.parametrize(("qtype", "dtype"), [(qtype, dtype) for qtype, dtype, _ in GGUF_TYPES])
def test_gguf_dequantize(qtype: QType, dtype: mx.Dtype) -> None:
    template = [("T", dtype), ("Q", gguf_blocks.TYPE_IDS[qtype]), ("S", GGML_QUANT_SIZES[qtype][1])]
    _compiles(gguf_blocks._cuda_dequant, dtype, template, w="uint8")  # noqa: SLF001


# gguf_blocks.matvec's Q6_K kernels, the file's layout and planes: each rows-per-warp (`q6k_rows` of rows of
# x) and warp split (`q6k_warps` of N rows of K / 256 blocks: 1, 4, 2).
@pytest.mark.parametrize(("planes", "dtype", "m", "n", "blocks"), [
    (False, BF16, 1, 128256, 8), (False, F32, gguf_blocks.MAX_X_ROWS, 4096, 56), (False, F16, 3, 2048, 8),
    (True, F16, 1, 128256, 8), (True, BF16, gguf_blocks.MAX_X_ROWS, 4096, 56)])
def test_gguf_q6k_matvec(planes: bool, dtype: mx.Dtype, m: int, n: int, blocks: int) -> None:
    template = [("T", dtype), ("M", m), ("R", gguf_blocks.q6k_rows(m)), ("W", gguf_blocks.q6k_warps(n, blocks))]
    shared = gguf_blocks._cuda_q6k_planes if planes else gguf_blocks._cuda_q6k_matvec  # noqa: SLF001
    _compiles(shared, dtype, template, w="uint8", idx="int32")


@pytest.mark.parametrize("dtype", [F16, BF16, F32])  # store8's 2- and 4-byte forms
def test_gguf_q6k_planes_lookup(dtype: mx.Dtype) -> None:
    _compiles(gguf_blocks._cuda_lookup_planes, dtype, [("T", dtype)], w="uint8", ids="int32")  # noqa: SLF001


def test_a_body_that_does_not_compile_is_caught() -> None:
    log = compile_source(wrap("broken", "  out[0] = undefined_name;", "", [("x", "float32")], [("out", "float32")], []))
    assert log is not None and "undefined_name" in log

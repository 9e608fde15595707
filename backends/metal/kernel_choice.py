"""Which kernel multiplies a few rows of x by a 4-bit weight on CUDA: MLX's `quantized_matmul` or pymlxc's
matrix-vector kernel (`kernels/matvec.py`).

pymlxc's 4-bit kernel reads the weights at about 1.8x the bandwidth of MLX's (H100,
`benchmarks/profile/probe_matvec.py`), but on small matrices a call of it costs more host time (10 against 6
us per call, as if MLX took longer to encode a custom-kernel node than its own). So it pays where the device
bounds a decode step: many weight bytes per layer, whose encoding costs the same whatever their size. Measured
on an H100 (decode tok/s, MLX's kernel -> pymlxc's): Llama-3.1-8B 4-bit 171 -> 262, Llama-3.2-1B 4-bit 677 ->
789, Qwen3-0.6B 4-bit 411 -> 398.

`nn.choose_cuda_matvec(model, setting)` decides once, at load, for the device in use then, and marks the
model's layers (`use_cuda_matvec`). It runs the kernel once there: NVRTC compiles it then (about 1.5 s on an
H100, once per process), not in the first generation, and a kernel that cannot run on this machine leaves the
model on MLX's kernel with a warning instead of failing a generation. `PYMLXC_CUDA_MATVEC` sets it: `auto`
(the default: when the model has at least `AUTO_MIN_BYTES_PER_LAYER` of 4-bit weights per transformer block,
its head and embedding included), `1` (any size) or `0` (never).

GGUF files: Q4_0, Q4_1 and Q4_K layers are repacked as 4 bits at group 32, which the kernel takes when x is in
the scales' float16, as in quantized files computing in float16 (`gguf_tensors.compute_dtype`); 5- and 8-bit
layers (Q5_0, Q5_1, Q5_K, Q8_0) stay on MLX's kernel (this one unpacks nibbles only), and Q2_K/Q3_K/Q6_K are
read by `kernels/gguf_blocks.py`. `kernel_takes` says which.

Inside `mlx_kernels_only()` every product goes to MLX: a shapeless trace (the compiled prefill) must not bake
in a row count, and gradients (training) need MLX's own transposes.
"""
from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import pymlxc.core as mx
from pymlxc.core import Array
from pymlxc.core.cuda_kernel import SharedKernel, float32_bits

from .kernels import add_rms_norm as norm_kernel
from .kernels import dequantize as dequantize_kernel
from .kernels import matvec as matvec_kernel
from .kernels import prefill_attention as attention_kernel
from .kernels import qmm as qmm_kernel
from .kernels import rope_kv as rope_kernel
from .kernels.check import CheckedOnce, on_cuda
from .thread_setting import ThreadSetting

# 4-bit bytes per block: Llama-3.1-8B 140 MB, Llama-3.2-1B 43 MB, Gemma-3-1B 22 MB, Qwen3-0.6B 12 MB.
AUTO_MIN_BYTES_PER_LAYER = 30_000_000
# Every residual and normalized form (`residual_product`, `normed_product`) by default only up to this
# many 4-bit bytes per block, past it the q/k/v and down_proj ones alone (`segments.use_matvec_fusion`'s
# "ends"): alternated on an H200 (`probe_host_split.py`, docs/performance.md) all of them took Llama-3.2-1B's
# host-bound step (43 MB a block) from 849 to 1029 tok/s by the medians, and Llama-3.1-8B's device-bound
# one (140 MB) from 314 to 304 (each of the gate/up product's 3584 blocks normalizes h again), where
# "ends" gave 318 against 310 off. The bound lies between those two sizes; none in between was measured.
FUSION_MAX_BYTES_PER_LAYER = 80_000_000
_mlx_only = ThreadSetting(False)
_the_kernel = SharedKernel(matvec_kernel.QUANTIZED_NAME, matvec_kernel.QUANTIZED_INPUTS,
                           matvec_kernel.OUTPUT_NAMES, matvec_kernel.QUANTIZED_SOURCE,
                           header=matvec_kernel.QUANTIZED_HEADER)
_the_residual = SharedKernel(matvec_kernel.RESIDUAL_NAME, matvec_kernel.RESIDUAL_INPUTS, matvec_kernel.OUTPUT_NAMES,
                             matvec_kernel.RESIDUAL_SOURCE, header=matvec_kernel.QUANTIZED_HEADER)
# The normalized forms' header: add_rms_norm's device functions (MLX's norm arithmetic), then the matvec's.
_NORM_HEADER = norm_kernel.HEADER + matvec_kernel.QUANTIZED_HEADER
_the_normed = SharedKernel(matvec_kernel.NORM_NAME, matvec_kernel.NORM_INPUTS, matvec_kernel.OUTPUT_NAMES,
                           matvec_kernel.NORM_SOURCE, header=_NORM_HEADER)
# Writes the key/value buffers in place through its inputs: they must reach it as they are (strided).
_the_rope = SharedKernel(matvec_kernel.ROPE_NAME, matvec_kernel.ROPE_INPUTS, matvec_kernel.OUTPUT_NAMES,
                         matvec_kernel.ROPE_SOURCE, header=_NORM_HEADER + rope_kernel.HEADER,
                         ensure_row_contiguous=False)
# The same kernels over dense weights of x's type (`dense_ready`; scales None in the functions below).
_the_dense = SharedKernel(matvec_kernel.DENSE_NAME, matvec_kernel.DENSE_INPUTS, matvec_kernel.OUTPUT_NAMES,
                          matvec_kernel.DENSE_SOURCE, header=matvec_kernel.QUANTIZED_HEADER)
_the_dense_residual = SharedKernel(matvec_kernel.DENSE_RESIDUAL_NAME, matvec_kernel.DENSE_RESIDUAL_INPUTS,
                                   matvec_kernel.OUTPUT_NAMES, matvec_kernel.DENSE_RESIDUAL_SOURCE,
                                   header=matvec_kernel.QUANTIZED_HEADER)
_the_dense_normed = SharedKernel(matvec_kernel.DENSE_NORM_NAME, matvec_kernel.DENSE_NORM_INPUTS,
                                 matvec_kernel.OUTPUT_NAMES, matvec_kernel.DENSE_NORM_SOURCE, header=_NORM_HEADER)
_the_dense_rope = SharedKernel(matvec_kernel.DENSE_ROPE_NAME, matvec_kernel.DENSE_ROPE_INPUTS,
                               matvec_kernel.OUTPUT_NAMES, matvec_kernel.DENSE_ROPE_SOURCE,
                               header=_NORM_HEADER + rope_kernel.HEADER, ensure_row_contiguous=False)
# Each form's kernel by (form, dense weights).
_FORMS = {("plain", False): _the_kernel, ("residual", False): _the_residual, ("norm", False): _the_normed,
          ("rope", False): _the_rope, ("plain", True): _the_dense, ("residual", True): _the_dense_residual,
          ("norm", True): _the_dense_normed, ("rope", True): _the_dense_rope}
_the_qmm = SharedKernel(qmm_kernel.NAME, qmm_kernel.INPUTS, qmm_kernel.OUTPUT_NAMES, qmm_kernel.SOURCE,
                        header=qmm_kernel.HEADER)
# Verdicts of the prefill kernel's check, keyed on the kernel's source and on this file's (the check's).
qmm_checks = CheckedOnce("pymlxc's CUDA 4-bit prefill product", source=(qmm_kernel.__file__, __file__))


def _use(cuda_matvec: bool) -> bool:
    return cuda_matvec and kernels_allowed()


def kernels_allowed() -> bool:
    """False inside `mlx_kernels_only()` (on this thread): pymlxc's row-count-specialized kernels
    stay out of shapeless traces and gradients (GGUF block layers ask this too)."""
    return not _mlx_only.get()


@contextmanager
def mlx_kernels_only() -> Iterator[None]:
    """Within (on this thread): MLX's `quantized_matmul` for every product."""
    with _mlx_only.set(True):
        yield


def quantized_matmul(x: Array, weight: Array, scales: Array, biases: Array, group_size: int, bits: int,
                     cuda_matvec: bool = False) -> Array:
    """`x @ dequantize(weight).T`; through pymlxc's kernel when `cuda_matvec` and it applies."""
    if _use(cuda_matvec):
        k = x.shape[-1]
        rows = x.size // k if k else 0
        if kernel_takes(x, weight, scales, biases, group_size, bits):
            n = weight.shape[0]
            return _the_kernel()([x, weight, scales, biases], output_shapes=[(*x.shape[:-1], n)],
                                 output_dtypes=[x.dtype], **matvec_kernel.launch(rows, k, n, x.dtype, group_size))[0]
    return mx.quantized_matmul(x, weight, scales, biases, True, group_size, bits)


def dense_matmul(x: Array, weight: Array, cuda_matvec: bool = False, weight_t: Array | None = None) -> Array:
    """`x @ weight.T` for dense weights [N, K] of x's type: through pymlxc's dense kernel when
    `cuda_matvec` and it takes x (`dense_takes`: a few rows), else MLX's matmul (of `weight_t`, the
    transpose a caller such as `nn.Linear` keeps, where given)."""
    if _use(cuda_matvec) and dense_takes(x, weight):
        k, n = x.shape[-1], weight.shape[0]
        return _FORMS["plain", True]()([x, weight], output_shapes=[(*x.shape[:-1], n)], output_dtypes=[x.dtype],
                                       **matvec_kernel.launch(x.size // k, k, n, x.dtype, 0, dense=True))[0]
    return mx.matmul(x, weight_t if weight_t is not None else mx.transpose(weight))


def dense_takes(x: Array, weight: Array) -> bool:
    """Whether the dense kernel computes `x @ weight.T`: weights [N, K] of x's 2-byte type, a few rows."""
    k = x.shape[-1]
    rows = x.size // k if k else 0
    return (matvec_kernel.dense_applies(rows, k, x.dtype.size) and weight.dtype == x.dtype and weight.ndim == 2
            and weight.shape[1] == k)


def _takes(x: Array, weight: Array, scales: Array | None, biases: Array | None, group_size: int,
           bits: int = 4) -> bool:
    """`dense_takes` for dense weights (`scales` None), else `kernel_takes` at `bits`."""
    if scales is None:
        return dense_takes(x, weight)
    return biases is not None and kernel_takes(x, weight, scales, biases, group_size, bits)


def _inputs(x: Array, weight: Array, scales: Array | None, biases: Array | None) -> list[Array]:
    """A form's first inputs: x and the dense weight, or x and the 4-bit weight, scales and biases."""
    if scales is None or biases is None:
        return [x, weight]
    return [x, weight, scales, biases]


def _product(x: Array, weight: Array, scales: Array | None, biases: Array | None, group_size: int) -> Array:
    """The plain product on pymlxc's kernel where it takes x, else MLX's: dense or 4-bit."""
    if scales is None or biases is None:
        return dense_matmul(x, weight, True)
    return quantized_matmul(x, weight, scales, biases, group_size, 4, True)


def silu_product(x: Array, weight: Array, scales: Array | None, biases: Array | None, group_size: int, bits: int,
                 cuda_matvec: bool) -> Array | None:
    """silu(gate) * up for a fused [gate; up] weight (gate rows first, as many as up's), 4-bit or
    dense (`scales` None), as pymlxc's kernel in its paired form (one kernel for the product and the
    SiLU product), or None where the kernel does not compute this product (the caller then uses
    `quantized_matmul` or `dense_matmul`)."""
    if not _use(cuda_matvec) or weight.shape[0] % 2 or not _takes(x, weight, scales, biases, group_size, bits):
        return None
    k, n = x.shape[-1], weight.shape[0]
    dense = scales is None
    return _FORMS["plain", dense]()(_inputs(x, weight, scales, biases), output_shapes=[(*x.shape[:-1], n // 2)],
                                    output_dtypes=[x.dtype],
                                    **matvec_kernel.launch(x.size // k, k, n, x.dtype, group_size, pair=True,
                                                           dense=dense))[0]


# Verdicts of the paired kernel's check, keyed on the kernel's source and on this file's (the check's).
pair_checks = CheckedOnce("pymlxc's CUDA gate/up + SiLU product", source=(matvec_kernel.__file__, __file__))


def silu_of_pair(both: Array) -> Array:
    """silu(gate) * up of a [gate; up] product [..., 2I] as MLX's operations compute it (`nn.silu`'s
    arithmetic, the model's MLP): what the paired kernel and the forms' fallbacks give, bit for bit."""
    gate, up = mx.split(both, [both.shape[-1] // 2], axis=-1)
    return gate * mx.sigmoid(gate) * up


def pair_ready(dtype: Any, group_size: int) -> bool:
    """Whether the paired kernel runs here and gives, bit for bit, MLX's `silu(gate) * up` of the
    unpaired kernel's two products (once per machine, type and group size; group 0: the dense kernel)."""
    return pair_checks.verdict(("pair", str(dtype), group_size), lambda: _compare_pair(dtype, group_size))


def _compare_pair(dtype: Any, group_size: int) -> str | None:
    import numpy as np  # noqa: PLC0415 - the check alone needs it

    rng = np.random.default_rng(0)
    k, half = 1024, 320
    weight, scales, biases = _random_weights(rng, 2 * half, k, dtype, group_size)
    for rows in (1, 3):
        x = mx.array(rng.standard_normal((rows, k)).astype(np.float32)).astype(dtype)
        got = silu_product(x, weight, scales, biases, group_size, 4, True)
        if got is None:
            return "it does not take these shapes"
        want = silu_of_pair(_product(x, weight, scales, biases, group_size))
        if not bool(mx.array_equal(got, want).item()):
            return f"its output for {rows} row(s) differs from MLX's silu(gate) * up ({dtype}, group {group_size})"
    return None


def residual_product(x: Array, weight: Array, scales: Array | None, biases: Array | None, group_size: int,
                     residual: Array) -> Array:
    """`residual + x @ dequantize(weight).T` for 4-bit weights, or `residual + x @ weight.T` for
    dense ones (`scales` None): one kernel (the matvec kernel's residual form: a decode step's
    o_proj or down_proj and the residual add after it) where the kernel takes x (a few rows), else
    the product and MLX's add (the same bits). `residual` has the product's shape and dtype."""
    if (not _takes(x, weight, scales, biases, group_size) or residual.dtype != x.dtype
            or tuple(residual.shape) != (*x.shape[:-1], weight.shape[0])):
        return residual + _product(x, weight, scales, biases, group_size)
    k, n = x.shape[-1], weight.shape[0]
    rows = x.size // k
    dense = scales is None
    (y,) = _FORMS["residual", dense]()(
        [*_inputs(x, weight, scales, biases), residual], output_shapes=[tuple(residual.shape)],
        output_dtypes=[x.dtype], **matvec_kernel.launch(rows, k, n, x.dtype, group_size, dense=dense))
    return y


def normed_product(h: Array, weight: Array, scales: Array | None, biases: Array | None, group_size: int,
                   norm_weight: Array, eps: float, pair: bool = False) -> Array:
    """`rms_norm(h, norm_weight, eps) @ dequantize(weight).T` for 4-bit weights (dense ones:
    `scales` None), or with `pair` (a [gate; up] weight) silu(gate) * up of it: one kernel (the
    matvec kernel's normalized form: a decode step's RMSNorm and the product after it) where it
    takes h (`normed_takes`: a few rows), else MLX's rms_norm and the products (the same bits)."""
    if not normed_takes(h, weight, scales, biases, group_size, 4) or norm_weight.dtype != h.dtype:
        normed = mx.fast.rms_norm(h, norm_weight, eps)
        if pair:
            paired = silu_product(normed, weight, scales, biases, group_size, 4, True)
            if paired is not None:
                return paired
            return silu_of_pair(_product(normed, weight, scales, biases, group_size))
        return _product(normed, weight, scales, biases, group_size)
    k, n = h.shape[-1], weight.shape[0]
    rows = h.size // k
    geometry = norm_kernel.geometry(k)
    assert geometry is not None  # normed_takes
    norm = (*geometry, float32_bits(eps))
    out = n // 2 if pair else n
    dense = scales is None
    (y,) = _FORMS["norm", dense]()(
        [*_inputs(h, weight, scales, biases), norm_weight], output_shapes=[(*h.shape[:-1], out)],
        output_dtypes=[h.dtype], **matvec_kernel.launch(rows, k, n, h.dtype, group_size, pair=pair, norm=norm,
                                                        dense=dense))
    return y


def normed_takes(h: Array, weight: Array, scales: Array | None, biases: Array | None, group_size: int,
                 bits: int) -> bool:
    """Whether `normed_product` computes the normalized product of h: the kernel takes the product
    (`kernel_takes` at `bits`, or `dense_takes` where `scales` is None), and MLX's rms_norm over
    rows of h runs a kernel the prologue reproduces on at most a block's threads."""
    k = h.shape[-1]
    geometry = norm_kernel.geometry(k) if norm_kernel.applies(k, h.dtype) else None
    return (geometry is not None and _takes(h, weight, scales, biases, group_size, bits)
            and matvec_kernel.norm_applies(h.size // k, k, h.dtype.size, geometry[0]))


def rope_takes(h: Array, weight: Array, scales: Array | None, biases: Array | None, group_size: int, keys: Array,
               values: Array, n_heads: int) -> bool:
    """Whether `normed_rope_product` computes this layer's step: `normed_takes`, the weight's rows
    are q, k and v heads of the buffers' size (values of the keys' size), all of h's type."""
    hkv, d = keys.shape[1], keys.shape[3]
    return (normed_takes(h, weight, scales, biases, group_size, 4) and d % 2 == 0 and values.shape[3] == d
            and keys.dtype == values.dtype == h.dtype and weight.shape[0] == (n_heads + 2 * hkv) * d)


def normed_rope_product(h: Array, weight: Array, scales: Array | None, biases: Array | None, group_size: int,
                        norm_weight: Array, eps: float, pos: Array, keys: Array, values: Array,
                        rope: rope_kernel.Rope, n_heads: int) -> tuple[Array, Array, Array]:
    """A layer's q/k/v step in one kernel: `normed_product`'s q/k/v of h, then what
    `rope_kv.rope_write_kv` does with them (queries RoPE'd at `pos` [B, n_heads, 1, D] returned, the
    key RoPE'd and the value written into `keys` / `values` at slot `pos` in place). `rope_takes` must
    hold; returns (queries, keys, values), the buffers the same arrays."""
    k, n = h.shape[-1], weight.shape[0]
    rows = h.size // k
    geometry = norm_kernel.geometry(k)
    assert geometry is not None  # rope_takes
    dense = scales is None
    launch = matvec_kernel.launch(rows, k, n, h.dtype, group_size, norm=(*geometry, float32_bits(eps)), dense=dense)
    launch["template"] = [*launch["template"], ("HQ", n_heads), ("HKV", keys.shape[1]), ("DH", keys.shape[3]),
                          ("FREQS", rope.with_freqs), ("SCALE_BITS", float32_bits(rope.scale_value)),
                          ("LOG2_BASE_BITS", 0 if rope.with_freqs else float32_bits(rope.log2_base))]
    (q,) = _FORMS["rope", dense]()(
        [*_inputs(h, weight, scales, biases), norm_weight, pos, rope.table, keys, values],
        output_shapes=[(rows, n_heads, 1, keys.shape[3])], output_dtypes=[h.dtype], **launch)
    return q, keys, values


# Verdicts of the residual and normalized forms' check, keyed on the kernel's source and this file's.
fusion_checks = CheckedOnce("pymlxc's CUDA matvec with the residual add and the RMSNorm inside",
                            source=(matvec_kernel.__file__, norm_kernel.__file__, rope_kernel.__file__, __file__))


def fusion_ready(dtype: Any, group_size: int, d: int, eps: float) -> bool:
    """Whether the residual and normalized forms run here and give, bit for bit, the plain kernel's
    products with MLX's add and rms_norm (rows of `d`, this eps) around them (once per machine and key)."""
    return fusion_checks.verdict(("fusion", str(dtype), group_size, d, float32_bits(eps)),
                                 lambda: _compare_fusion(dtype, group_size, d, eps))


def rope_fusion_ready(dtype: Any, group_size: int, d: int, eps: float, n_heads: int, n_kv_heads: int, head_dim: int,
                      rope: rope_kernel.Rope) -> bool:
    """Whether the RoPE form runs here and gives, bit for bit, the normalized form's q/k/v with
    `rope_kv.rope_write_kv` after it, at positions from 0 to 8191 (once per machine and key)."""
    key = ("rope", str(dtype), group_size, d, float32_bits(eps), n_heads, n_kv_heads, head_dim, rope.key)
    return fusion_checks.verdict(key, lambda: _compare_rope(dtype, group_size, d, eps, n_heads, n_kv_heads, head_dim,
                                                            rope))


def _compare_rope(dtype: Any, group_size: int, d: int, eps: float, hq: int, hkv: int, dh: int,
                  rope: rope_kernel.Rope) -> str | None:
    import numpy as np  # noqa: PLC0415 - the check alone needs it

    rng = np.random.default_rng(0)
    slots = 8192

    def random(*shape: int, scale: float = 1.0) -> Array:
        return mx.array(rng.standard_normal(shape).astype(np.float32) * scale).astype(dtype)

    w, s, b = _random_weights(rng, (hq + 2 * hkv) * dh, d, dtype, group_size)
    norm_weight = random(d)
    keys, values = random(1, hkv, slots, dh), random(1, hkv, slots, dh)
    got_k, got_v = rope_kernel.private_copy(keys), rope_kernel.private_copy(values)
    want_k, want_v = rope_kernel.private_copy(keys), rope_kernel.private_copy(values)
    mx.eval(got_k, got_v, want_k, want_v)
    for p in (0, 1, 77, 1000, 4097, slots - 1):
        h = random(1, 1, d)
        if not rope_takes(h, w, s, b, group_size, got_k, got_v, hq):
            return f"it does not take these shapes ({hq} + {hkv} heads of {dh}, rows of {d})"
        pos = mx.array([p] * 4, dtype=mx.int32)  # as the decode segments carry it
        q, got_k, got_v = normed_rope_product(h, w, s, b, group_size, norm_weight, eps, pos, got_k, got_v, rope, hq)
        mx.eval(q)
        qkv = normed_product(h, w, s, b, group_size, norm_weight, eps)
        want_q, want_k, want_v = rope_kernel.rope_write_kv(qkv, None, pos, want_k, want_v, rope, hq)
        mx.eval(want_q)
        same = [bool(mx.array_equal(a, e).item()) for a, e in ((q, want_q), (got_k, want_k), (got_v, want_v))]
        if not all(same):
            what = ", ".join(n for n, ok in zip(("queries", "keys", "values"), same, strict=True) if not ok)
            return f"its RoPE form's {what} at position {p} differ ({dtype}, group {group_size}, head size {dh})"
    return None


def _compare_fusion(dtype: Any, group_size: int, d: int, eps: float) -> str | None:
    import numpy as np  # noqa: PLC0415 - the check alone needs it

    rng = np.random.default_rng(0)

    def random(*shape: int, scale: float = 1.0) -> Array:
        return mx.array(rng.standard_normal(shape).astype(np.float32) * scale).astype(dtype)

    half = 160
    wo, so, bo = _random_weights(rng, d, 2 * d, dtype, group_size)  # o_proj / down_proj: 2d -> d
    wi, si, bi = _random_weights(rng, 2 * half, d, dtype, group_size)  # q/k/v or [gate; up]: d -> 2 half
    norm_weight = random(d)
    for rows in (1, 2):
        x, h = random(rows, 2 * d), random(rows, d)
        if not (_takes(x, wo, so, bo, group_size) and normed_takes(h, wi, si, bi, group_size, 4)):
            return f"it does not take these shapes ({rows} row(s) of {d})"
        both = _product(mx.fast.rms_norm(h, norm_weight, eps), wi, si, bi, group_size)
        pairs = [
            ("residual form", residual_product(x, wo, so, bo, group_size, h),
             h + _product(x, wo, so, bo, group_size)),
            ("normalized form", normed_product(h, wi, si, bi, group_size, norm_weight, eps), both),
            ("normalized gate/up form", normed_product(h, wi, si, bi, group_size, norm_weight, eps, pair=True),
             silu_of_pair(both)),
        ]
        for name, got, want in pairs:
            if not bool(mx.array_equal(got, want).item()):
                return f"its {name} for {rows} row(s) differs from MLX's ({dtype}, group {group_size}, rows of {d})"
    return None


def _random_weights(rng: Any, n: int, k: int, dtype: Any, group_size: int
                    ) -> tuple[Array, Array | None, Array | None]:
    """The checks' weights [n, k]: 4-bit at `group_size` (weight, scales, biases), or dense in
    `dtype` (weight, None, None) for group 0."""
    import numpy as np  # noqa: PLC0415 - the checks alone need it

    w = mx.array(rng.standard_normal((n, k)).astype(np.float32) * 0.05).astype(dtype)
    if not group_size:
        return w, None, None
    weight, scales, biases = mx.quantize(w, group_size, 4)
    return weight, scales, biases


# Verdicts of the dense kernel's check, keyed on the kernel's source and on this file's (the check's).
dense_checks = CheckedOnce("pymlxc's CUDA dense matvec", source=(matvec_kernel.__file__, __file__))


def dense_ready(dtype: Any) -> bool:
    """Whether the dense kernel runs here and agrees with float64 products of the same values for
    x and weights of `dtype` (once per machine and type): its forms, checked bit for bit against
    it (`fusion_ready` and the others at group 0), then stand in for MLX's matmul, add and norm."""
    return dense_checks.verdict(("dense", str(dtype)), lambda: _compare_dense(dtype))


def _compare_dense(dtype: Any) -> str | None:
    import numpy as np  # noqa: PLC0415 - the check alone needs it

    rng = np.random.default_rng(0)
    rounding = 2.0 ** -8 if dtype == mx.bfloat16 else 2.0 ** -11  # half a step of the output's type
    for k, n, rows in ((1024, 200, 1), (512, 333, 3), (4096, 66, 8)):  # both row splits, an odd unit, M up to 8
        weight, _, _ = _random_weights(rng, n, k, dtype, 0)
        x = mx.array(rng.standard_normal((rows, k)).astype(np.float32)).astype(dtype)
        if not dense_takes(x, weight):
            return f"it does not take {rows} row(s) of {k}"
        got = np.asarray(dense_matmul(x, weight, True).astype(mx.float32)).astype(np.float64)
        w64 = np.asarray(weight.astype(mx.float32)).astype(np.float64)
        x64 = np.asarray(x.astype(mx.float32)).astype(np.float64)
        want = x64 @ w64.T
        # float32 sums of k products, then rounding to the 2-byte output (at most half its step).
        tol = np.abs(x64) @ np.abs(w64).T * (k * 2.0 ** -23) + np.abs(want) * rounding
        if not np.all(np.abs(got - want) <= tol + 1e-6):
            bad = np.unravel_index(int(np.argmax(np.abs(got - want) - tol)), want.shape)
            return (f"its product differs from float64's at row {bad[0]}, column {bad[1]} "
                    f"({got[bad]:.5g} against {want[bad]:.5g}, {dtype})")
    return None


def kernel_takes(x: Array, weight: Array, scales: Array, biases: Array, group_size: int, bits: int) -> bool:
    """Whether pymlxc's kernel computes `x @ dequantize(weight).T` (where it is chosen): 4 bits at
    group 32, 64 or 128 (GGUF's Q4_0, Q4_1 and Q4_K repack to group 32), x in the scales' 2-byte
    dtype (a GGUF model computing in float16), a few rows. Q5_*, Q8_0 and float32 x go to MLX."""
    k = x.shape[-1]
    rows = x.size // k if k else 0
    # The cheap tests first: a prompt chunk (many rows) goes to MLX without the shape checks.
    return (matvec_kernel.quantized_applies(rows, k, bits, group_size, x.dtype.size)
            and _fits(x, weight, scales, biases, group_size))


def _fits(x: Array, weight: Array, scales: Array, biases: Array, group_size: int) -> bool:
    """Whether the arrays fit each other as the kernel reads them (by the weight's shape). Those
    that do not go to MLX, whose error names the mismatch."""
    k, n = x.shape[-1], weight.shape[0]
    return (x.dtype == scales.dtype and weight.ndim == 2 and weight.shape[1] * 8 == k
            and tuple(scales.shape) == (n, k // group_size) and tuple(biases.shape) == tuple(scales.shape))


def qmm_product(x: Array, weight: Array, scales: Array, biases: Array, group_size: int) -> Array:
    """`x @ dequantize(weight).T` through pymlxc's tensor-core kernel (`kernels/qmm.py`), for x of
    any rows in the scales' 2-byte dtype and 4-bit weights (`qmm_takes`)."""
    k, n = x.shape[-1], weight.shape[0]
    m = x.size // k
    (y,) = _the_qmm()([mx.reshape(x, (m, k)), weight, scales, biases], output_shapes=[(m, n)],
                      output_dtypes=[x.dtype], **qmm_kernel.launch(m, k, n, x.dtype, group_size))
    return mx.reshape(y, (*x.shape[:-1], n))


def qmm_takes(x: Array, weight: Array, scales: Array, biases: Array, group_size: int, bits: int) -> bool:
    """Whether the prefill kernel computes `x @ dequantize(weight).T`: 4 bits at group 32, 64 or
    128, x in the scales' 2-byte dtype, K a multiple of 64."""
    k = x.shape[-1]
    rows = x.size // k if k else 0
    return qmm_kernel.applies(rows, k, bits, group_size, x.dtype.size) and _fits(x, weight, scales, biases, group_size)


def qmm_ready(dtype: Any, group_size: int) -> bool:
    """Whether the prefill kernel runs here and agrees with MLX's quantized product for x of
    `dtype` at `group_size` (checked once per machine and key, see kernels/check.py)."""
    return qmm_checks.verdict(("qmm", str(dtype), group_size),
                              lambda: _compare_qmm(dtype, group_size))


def _compare_qmm(dtype: Any, group_size: int) -> str | None:
    """None where the kernel's product agrees with float64 on MLX's dequantized weights, for rows
    and outputs that are not whole tiles; else why not."""
    import numpy as np  # noqa: PLC0415 - the check alone needs it

    rng = np.random.default_rng(0)
    m, k, n = 80, 512, 200  # 2 x 2 tiles, neither whole; 8 steps of K
    w32 = mx.array(rng.standard_normal((n, k)).astype(np.float32) * 0.05).astype(dtype)
    weight, scales, biases = mx.quantize(w32, group_size, 4)
    x = mx.array(rng.standard_normal((m, k)).astype(np.float32)).astype(dtype)
    dense = np.asarray(mx.dequantize(weight, scales, biases, group_size, 4).astype(mx.float32)).astype(np.float64)
    xf = np.asarray(x.astype(mx.float32)).astype(np.float64)
    want, bound = xf @ dense.T, np.abs(xf) @ np.abs(dense).T
    tol = (bound + np.abs(want)) * 2.0 ** -7 + 1e-6
    got = np.asarray(qmm_product(x, weight, scales, biases, group_size).astype(mx.float32))
    if not np.all(np.abs(got - want) <= tol):
        bad = np.unravel_index(int(np.argmax(np.abs(got - want) - tol)), want.shape)
        return (f"its product differs from MLX's dequantized weights at row {bad[0]}, column {bad[1]} "
                f"({got[bad]:.5g} against {want[bad]:.5g})")
    return None


# Reads q, keys and values through their strides (head slices of a joint product, cache buffers).
_the_prefill_attention = SharedKernel(attention_kernel.NAME, attention_kernel.INPUTS, attention_kernel.OUTPUT_NAMES,
                                      attention_kernel.SOURCE, header=attention_kernel.HEADER,
                                      ensure_row_contiguous=False)
_the_padded_prefill_attention = SharedKernel(attention_kernel.PADDED_NAME, attention_kernel.PADDED_INPUTS,
                                             attention_kernel.OUTPUT_NAMES, attention_kernel.PADDED_SOURCE,
                                             header=attention_kernel.HEADER, ensure_row_contiguous=False)
prefill_attention_checks = CheckedOnce("pymlxc's CUDA prefill attention",
                                       source=(attention_kernel.__file__, __file__))


def prefill_attention(q: Array, k: Array, v: Array, scale: float, starts: Array | None = None) -> Array:
    """Causal attention of q [B, HQ, L, D] over k and v [B, HKV, T, D] (T >= L, the chunk's keys
    last) through pymlxc's kernel (`kernels/prefill_attention.py`; `prefill_attention_takes`):
    [B, HQ, L, D], a transposed view of the kernel's [B, L, HQ, D]. With `starts` (int32 [B]) row b's
    keys before starts[b] are padding, hidden from every query but their own (the padded form)."""
    b, hq, n, d = q.shape
    kernel, inputs = (_the_prefill_attention, [q, k, v]) if starts is None else (
        _the_padded_prefill_attention, [q, k, v, starts])
    (y,) = kernel()(inputs, output_shapes=[(b, n, hq, d)], output_dtypes=[q.dtype],
                    **attention_kernel.launch(b, n, hq, k.shape[1], d, q.dtype, scale))
    return mx.transpose(y, (0, 2, 1, 3))


def prefill_attention_takes(q: Array, k: Array, v: Array, starts: Array | None = None) -> bool:
    """Whether the kernel takes these shapes and types (`kernels/prefill_attention.applies`); with
    `starts`, its padded form: int32 [B]."""
    if q.ndim != 4 or k.ndim != 4 or tuple(k.shape) != tuple(v.shape) or k.shape[0] != q.shape[0]:
        return False
    if starts is not None and (starts.dtype != mx.int32 or tuple(starts.shape) != (q.shape[0],)):
        return False
    if k.shape[3] != q.shape[3] or not (q.dtype == k.dtype == v.dtype):
        return False
    return attention_kernel.applies(q.shape[2], k.shape[2], q.shape[1], k.shape[1], q.shape[3], q.dtype.size)


def prefill_attention_ready(dtype: Any, head_dim: int, heads: int, kv_heads: int, scale: float) -> bool:
    """Whether the kernel runs here for these heads and agrees with float64 (checked once per machine
    and key, see kernels/check.py)."""
    if not attention_kernel.applies(2, 2, heads, kv_heads, head_dim, dtype.size):
        return False
    return prefill_attention_checks.verdict(
        ("prefill_attention", str(dtype), head_dim, heads, kv_heads, float(scale)),
        lambda: _compare_prefill_attention(dtype, head_dim, heads, kv_heads, scale))


def causal_attention_reference(q: Any, k: Any, v: Any, scale: float, starts: Any = None) -> Any:
    """The kernel's attention in NumPy, in the arrays' precision: q [B, HQ, L, D] over k and v
    [B, HKV, T, D], query i seeing keys up to T - L + i (the check's and the tests' reference); with
    `starts` [B], only those from starts[b] on, and itself (`generate.left_padded_mask`)."""
    import numpy as np  # noqa: PLC0415 - the check alone needs it

    rep = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    n, t = q.shape[2], k.shape[2]
    keys, queries = np.arange(t)[None, :], np.arange(n)[:, None] + (t - n)
    visible = keys <= queries
    if starts is not None:
        real = keys[None] >= np.asarray(starts).reshape(-1, 1, 1)  # [B, 1, T]
        visible = (visible[None] & (real | (keys == queries)[None]))[:, None]  # [B, 1, L, T]
    scores = np.where(visible, q @ np.swapaxes(k, -1, -2) * scale, -np.inf)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return (weights / weights.sum(axis=-1, keepdims=True)) @ v


def padded_prefill_attention_ready(dtype: Any, head_dim: int, heads: int, kv_heads: int, scale: float) -> bool:
    """Whether the kernel's padded form (left-padded rows, `starts`) runs here for these heads and
    agrees with float64: checked once per machine and key, at load (`nn.mark_prefill_attention`),
    apart from the causal form's check, so that a failure of one leaves the other."""
    if not prefill_attention_ready(dtype, head_dim, heads, kv_heads, scale):
        return False
    return prefill_attention_checks.verdict(_padded_key(dtype, head_dim, heads, kv_heads, scale),
                                            lambda: _compare_padded_prefill_attention(dtype, head_dim, heads,
                                                                                      kv_heads, scale))


def padded_prefill_attention_passed(dtype: Any, head_dim: int, heads: int, kv_heads: int, scale: float) -> bool:
    """Whether `padded_prefill_attention_ready` passed in this process for these heads (asked by each
    attention; never runs the check: a first check during a generation would run on its evaluation
    thread)."""
    return prefill_attention_checks.passed(_padded_key(dtype, head_dim, heads, kv_heads, scale))


def _padded_key(dtype: Any, head_dim: int, heads: int, kv_heads: int, scale: float) -> tuple[Any, ...]:
    return ("prefill_attention_padded", str(dtype), head_dim, heads, kv_heads, float(scale))


def _compare_prefill_attention(dtype: Any, head_dim: int, heads: int, kv_heads: int, scale: float) -> str | None:
    """None where the kernel's attention agrees with float64 on the same values, for chunks that do not
    fill a block, over keys that are views of a longer buffer, and q a view of joint heads; else why not."""
    import numpy as np  # noqa: PLC0415 - the check alone needs it

    rng = np.random.default_rng(0)
    for n, t in ((37, 37), (21, 90), (2, 2)):
        joint = mx.array(rng.standard_normal((1, heads + kv_heads, n, head_dim)).astype(np.float32)).astype(dtype)
        buffers = [mx.array(rng.standard_normal((1, kv_heads, t + 13, head_dim)).astype(np.float32)).astype(dtype)
                   for _ in range(2)]
        q = mx.slice(joint, [0, 0, 0, 0], [1, heads, n, head_dim], [1, 1, 1, 1])
        k, v = (mx.slice(a, [0, 0, 0, 0], [1, kv_heads, t, head_dim], [1, 1, 1, 1]) for a in buffers)
        got = np.asarray(prefill_attention(q, k, v, scale).astype(mx.float32))
        qf, kf, vf = (np.asarray(a.astype(mx.float32)).astype(np.float64) for a in (q, k, v))
        problem = _attention_problem(got, causal_attention_reference(qf, kf, vf, scale), vf,
                                     f"{n} queries over {t} keys")
        if problem is not None:
            return problem
    return None


def _compare_padded_prefill_attention(dtype: Any, head_dim: int, heads: int, kv_heads: int, scale: float
                                      ) -> str | None:
    """None where the padded form agrees with float64 over three left-padded rows of 21 queries over
    90 keys, padded up to keys 0, 40 and 80 (queries 69-79 of the last row are padding themselves:
    each sees only itself); else why not."""
    import numpy as np  # noqa: PLC0415 - the check alone needs it

    rng = np.random.default_rng(1)
    q, k, v = (mx.array(rng.standard_normal((3, h, n, head_dim)).astype(np.float32)).astype(dtype)
               for h, n in ((heads, 21), (kv_heads, 90), (kv_heads, 90)))
    starts = np.array([0, 40, 80], np.int32)
    got = np.asarray(prefill_attention(q, k, v, scale, mx.array(starts)).astype(mx.float32))
    qf, kf, vf = (np.asarray(a.astype(mx.float32)).astype(np.float64) for a in (q, k, v))
    return _attention_problem(got, causal_attention_reference(qf, kf, vf, scale, starts), vf,
                              "left-padded rows of 21 queries over 90 keys")


def _attention_problem(got: Any, want: Any, vf: Any, case: str) -> str | None:
    """Why the kernel's `got` is not float64's `want` within the 2-byte type's roundings, or None."""
    import numpy as np  # noqa: PLC0415 - the check alone needs it

    # The output's rounding and the probabilities' (rounded to the type for the second product).
    tol = 2.0 ** -8 * (np.abs(want) + np.abs(vf).max())
    if not np.all(np.abs(got - want) <= tol):
        bad = np.unravel_index(int(np.argmax(np.abs(got - want) - tol)), want.shape)
        return (f"its attention of {case} differs from float64 at row {bad[0]}, head {bad[1]}, "
                f"query {bad[2]}, element {bad[3]} ({got[bad]:.5g} against {want[bad]:.5g})")
    return None


# The dequantization kernel by its count of weights (made on first use).
_the_dequantize = {count: SharedKernel(dequantize_kernel.name(count), dequantize_kernel.inputs(count),
                                       dequantize_kernel.outputs(count), dequantize_kernel.source(count),
                                       header=dequantize_kernel.HEADER)
                   for count in range(1, dequantize_kernel.MAX_WEIGHTS + 1)}
dequantize_checks = CheckedOnce("pymlxc's CUDA 4-bit dequantization", source=(dequantize_kernel.__file__, __file__))


def dequantize_kernel_takes(weight: Array, scales: Array, biases: Array, group_size: int, bits: int) -> bool:
    """Whether pymlxc's CUDA kernel (`kernels/dequantize.py`) dequantizes this weight: a layout it
    takes, on CUDA, the kernel past its check. Asked once per weight (the prefill's specs keep the
    answer), not at each dequantization."""
    n = weight.shape[0]
    k = weight.shape[-1] * 32 // bits if bits else 0
    fits = (weight.ndim == 2 and dequantize_kernel.applies(bits, group_size, scales.dtype.size)
            and tuple(scales.shape) == (n, k // group_size) and tuple(biases.shape) == tuple(scales.shape))
    return fits and kernels_allowed() and on_cuda() and dequantize_ready(scales.dtype, group_size)


def dequantized_weight(weight: Array, scales: Array, biases: Array, group_size: int, bits: int,
                       kernel: bool) -> Array:
    """MLX's `dequantize(weight, scales, biases)` of a whole [N, K * bits / 32] weight, in the
    scales' dtype: pymlxc's CUDA kernel where `kernel` (`dequantize_kernel_takes`), MLX's
    `dequantize` otherwise. Not inside a shapeless trace (the kernel's output shape could not be
    inferred again there)."""
    (dense,) = dequantized_weights([(weight, scales, biases, group_size, bits)], [kernel])
    return dense


QuantizedWeight = tuple[Array, Array, Array, int, int]  # weight, scales, biases, group size, bits


def dequantized_weights(weights: Sequence[QuantizedWeight], kernels: Sequence[bool]) -> list[Array]:
    """`dequantized_weight` of each (weight, scales, biases, group size, bits), in order. Those
    the kernel takes (`kernels`) go to it together, one call for each dtype and group size (up to
    `dequantize_kernel.MAX_WEIGHTS` a call): a segment's products then cost MLX's and the binding's
    host work for one custom kernel, not one a weight."""
    if len(kernels) != len(weights):
        raise ValueError(f"{len(weights)} weights and {len(kernels)} kernel choices")
    dense: dict[int, Array] = {}
    batches: dict[tuple[str, int], list[int]] = {}
    allowed = kernels_allowed()
    for i, ((weight, scales, biases, group_size, bits), kernel) in enumerate(zip(weights, kernels, strict=True)):
        if kernel and allowed:
            batches.setdefault((str(scales.dtype), group_size), []).append(i)
        else:
            dense[i] = mx.dequantize(weight, scales, biases, group_size, bits)
    step = dequantize_kernel.MAX_WEIGHTS
    for places in batches.values():
        for at in range(0, len(places), step):
            chunk = places[at:at + step]
            dense.update(zip(chunk, _kernel_dequantize([weights[i][:3] for i in chunk], weights[chunk[0]][3]),
                             strict=True))
    return [dense[i] for i in range(len(weights))]


def _kernel_dequantize(weights: Sequence[tuple[Array, Array, Array]], group_size: int) -> list[Array]:
    """The kernel's values of 1 to MAX_WEIGHTS (weight, scales, biases) of one dtype and group
    size, in one call."""
    dtype = weights[0][1].dtype
    return _the_dequantize[len(weights)]()(
        [a for w in weights for a in w], output_shapes=[(w.shape[0], w.shape[1] * 8) for w, _, _ in weights],
        output_dtypes=[dtype] * len(weights),
        **dequantize_kernel.launch(sum(w.size for w, _, _ in weights), dtype, group_size))


def check_dequantize_kernel(layers: Sequence[Any]) -> None:
    """Run the dequantization kernel's check (`dequantize_ready`) for the dtypes and group sizes of
    these quantized layers that it takes, now: at load, on the loading thread, rather than at a
    prefill's first product, on a thread whose stream the check cannot use."""
    if kernels_allowed() and on_cuda():
        for dtype, group in {(m.scales.dtype, m.group_size) for m in layers
                             if dequantize_kernel.applies(m.bits, m.group_size, m.scales.dtype.size)}:
            dequantize_ready(dtype, group)


def dequantize_ready(dtype: Any, group_size: int) -> bool:
    """Whether the dequantization kernel runs here and gives MLX's values (to one rounding of
    `dtype`) at `group_size` (checked once per machine and key, see kernels/check.py)."""
    return dequantize_checks.verdict(("dequantize", str(dtype), group_size),
                                     lambda: _compare_dequantize(dtype, group_size))


def _compare_dequantize(dtype: Any, group_size: int) -> str | None:
    """None where the kernel's values are MLX's dequantization's, within one rounding of `dtype`,
    for three weights in one call whose word counts are not whole numbers of thread blocks (so
    threads of one block serve two weights); else why not."""
    import numpy as np  # noqa: PLC0415 - the check alone needs it

    rng = np.random.default_rng(0)
    quantized: list[tuple[Array, Array, Array]] = []
    for n, k in ((37, 512), (5, 256), (70, 128)):  # 2368, 160 and 1120 words: 14 blocks and a part
        w32 = mx.array(rng.standard_normal((n, k)).astype(np.float32)).astype(dtype)
        weight, scales, biases = mx.quantize(w32, group_size, 4)
        quantized.append((weight, scales, biases))
    for i, (q, got_array) in enumerate(zip(quantized, _kernel_dequantize(quantized, group_size), strict=True)):
        want = np.asarray(mx.dequantize(q[0], q[1], q[2], group_size, 4).astype(mx.float32))
        got = np.asarray(got_array.astype(mx.float32))
        tol = np.abs(want) * 2.0 ** -(7 if dtype == mx.bfloat16 else 10) + 1e-6
        if got.shape != want.shape:
            return f"it gave values of shape {got.shape} for weight {i} of {want.shape}"
        if not np.all(np.abs(got - want) <= tol):
            bad = np.unravel_index(int(np.argmax(np.abs(got - want) - tol)), want.shape)
            return (f"its values of weight {i} differ from MLX's dequantization at row {bad[0]}, column {bad[1]} "
                    f"({got[bad]:.5g} against {want[bad]:.5g})")
    return None


def runs_on(layer: Any) -> bool:
    """Run the kernel once on `layer` (one row of zeros): compiles it now; False, with a warning,
    if it cannot run here."""
    try:
        x = mx.zeros((1, layer.weight.shape[1] * 8), layer.scales.dtype)
        mx.eval(quantized_matmul(x, layer.weight, layer.scales, layer.biases, layer.group_size, 4, True))
        return True
    except Exception as exc:  # noqa: BLE001 - whatever stops it here, MLX's kernel still works
        warnings.warn(f"pymlxc's CUDA matvec kernel cannot run here ({exc}); the model uses MLX's "
                      "quantized_matmul", RuntimeWarning, stacklevel=3)
        return False

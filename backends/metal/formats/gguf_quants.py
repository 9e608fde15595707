"""llama.cpp's tensor types as pymlxc keeps them in memory: repacked into MLX's affine layout where
that layout expresses the type, else kept as the file's own blocks and dequantized by MLX ops.

MLX's affine quantization stores, per group of 32 consecutive inputs of a row, a scale and a bias
(`w = scale * q + bias`, q unsigned with `bits` bits, packed little-endian into uint32 words). Every
legacy type (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) and the K-quants with 32-value sub-blocks (Q4_K, Q5_K)
are exactly that form with the integers unchanged:

    Q4_0  w = d (q - 8)          scale d, bias -8 d       Q4_1  w = d q + m     scale d, bias m
    Q5_0  w = d (q - 16)         scale d, bias -16 d      Q5_1  w = d q + m     scale d, bias m
    Q8_0  w = d q, q signed      q + 128, bias -128 d
    Q4_K, Q5_K  w = (d sc) q - (dmin m), sc and m 6-bit per sub-block of 32: scale d sc, bias -dmin m

Scales and biases are stored as float16 (5.0 bits per weight at 4 bits, against the file's 4.5).
For the legacy types they are exact (d and m are float16 in the file, and a power-of-two multiple of
a float16 is one); for Q4_K and Q5_K the products d sc and dmin m need up to 17 significant bits and
are rounded to float16's 11: |scale' - scale| <= 2^-11 |scale| (2^-25 absolute below float16's
normal range), and likewise the bias. A scale or bias that overflows float16 is an error.

Q2_K, Q3_K and Q6_K scale sub-blocks of 16 values, which MLX's group sizes (32, 64, 128) cannot
express, and re-encoding them in 8 bits would cost 9 bits a weight (1.4x to 2.6x the file). They stay
in the file's own blocks (uint8 [rows, blocks, 84 | 110 | 210 bytes] per 256 weights, llama.cpp's
layout); `dequantize_blocks` here is their reference dequantization in MLX ops, bit for bit as
`gguf.quants.dequantize` in float32. The layers that compute with them, through the GPU kernels where
those passed their check, are in `gguf_layers.py`.
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as QType
from gguf.constants import GGML_QUANT_SIZES

import pymlxc.core as mx
from pymlxc.core import Array

GROUP = 32  # MLX's group size for every repacked type
QK_K = 256
AFFINE_BITS: dict[QType, int] = {QType.Q4_0: 4, QType.Q4_1: 4, QType.Q5_0: 5, QType.Q5_1: 5, QType.Q8_0: 8,
                                 QType.Q4_K: 4, QType.Q5_K: 5}
EXACT_AFFINE = (QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1, QType.Q8_0)  # float16 scales lose nothing
BLOCK_TYPES = (QType.Q2_K, QType.Q3_K, QType.Q6_K)  # kept as the file's blocks
SCALE_DTYPE = np.float16
_CHUNK_WEIGHTS = 1 << 22  # rows repacked per step: bounded temporaries whatever the tensor size


class QuantError(ValueError):
    """A block holds a scale that the stored layout cannot represent (the message says which)."""


# ---------------------------------------------------------------------- affine repacking (numpy)

def _f16(raw: np.ndarray) -> np.ndarray:
    """Two-byte fields (n, 2) of uint8 -> float32 (n, 1)."""
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, span: int) -> np.ndarray:
    """Bytes (n, k*span) whose low nibbles hold values [0, span) of each chunk of 2*span values and
    whose high nibbles hold [span, 2 span) -> uint8 (n, 2*k*span) in value order."""
    n = qs.shape[0]
    q = qs.reshape(n, -1, 1, span) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    return (q & np.uint8(0x0F)).reshape(n, -1)


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The eight 6-bit scales and mins of a Q4_K/Q5_K super-block, packed in 12 bytes."""
    n = scales.shape[0]
    s = scales.reshape(n, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def affine_parts(blocks: np.ndarray, qtype: QType) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Blocks (n, type_size) uint8 of an affine-expressible type -> (q uint8 (n, block) unsigned,
    scale float32 (n, block/32), bias float32 (n, block/32)), exact: w = scale * q + bias."""
    n = blocks.shape[0]
    if qtype == QType.Q8_0:
        d = _f16(blocks[:, :2])
        q = (blocks[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return q, d, -128 * d
    if qtype in (QType.Q4_0, QType.Q4_1):
        d = _f16(blocks[:, :2])
        q = _nibbles(blocks[:, 2:] if qtype == QType.Q4_0 else blocks[:, 4:], 16)
        return q, d, (-8 * d if qtype == QType.Q4_0 else _f16(blocks[:, 2:4]))
    if qtype in (QType.Q5_0, QType.Q5_1):
        d = _f16(blocks[:, :2])
        at = 2 if qtype == QType.Q5_0 else 4
        qh = np.ascontiguousarray(blocks[:, at:at + 4]).view("<u4")
        high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
        q = _nibbles(blocks[:, at + 4:], 16) | (high << 4)
        return q, d, (-16 * d if qtype == QType.Q5_0 else _f16(blocks[:, 2:4]))
    if qtype in (QType.Q4_K, QType.Q5_K):
        d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
        sc, mn = _k_scale_min(blocks[:, 4:16])
        if qtype == QType.Q4_K:
            q = _nibbles(blocks[:, 16:], 32)
        else:
            qh = blocks[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
            q = _nibbles(blocks[:, 48:], 32) | ((qh & 1).reshape(n, QK_K) << 4)
        return q, d * sc, -(dmin * mn)
    raise QuantError(f"{qtype.name} is not an affine type")


def pack_bits(q: np.ndarray, bits: int) -> np.ndarray:
    """uint8 values (rows, cols) < 2^bits -> MLX's packing: a little-endian bit stream, value i at
    bits [i*bits, (i+1)*bits), read as uint32 words (rows, cols*bits/32)."""
    rows, cols = q.shape
    if bits == 8:
        return np.ascontiguousarray(q).view("<u4")
    if bits == 4:
        p = q.reshape(rows, -1, 2)
        return np.ascontiguousarray(p[..., 0] | (p[..., 1] << 4)).view("<u4")
    stream = ((q[..., None] >> np.arange(bits, dtype=np.uint8)) & 1).reshape(rows, cols * bits)
    return np.packbits(stream, axis=-1, bitorder="little").view("<u4")


def repack_affine(data: np.ndarray, qtype: QType, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A tensor's rows of blocks (rows, row_bytes) uint8 -> MLX affine (packed uint32, float16 scales,
    float16 biases), in chunks of rows. `name` is the tensor named in errors."""
    block, size = GGML_QUANT_SIZES[qtype]
    bits = AFFINE_BITS[qtype]
    rows, row_bytes = data.shape
    cols = row_bytes // size * block
    packed = np.empty((rows, cols * bits // 32), np.uint32)
    scales = np.empty((rows, cols // GROUP), SCALE_DTYPE)
    biases = np.empty((rows, cols // GROUP), SCALE_DTYPE)
    step = max(1, _CHUNK_WEIGHTS // max(cols, 1))
    for r in range(0, rows, step):
        chunk = np.asarray(data[r:r + step])
        n = chunk.shape[0]
        q, s, b = affine_parts(chunk.reshape(-1, size), qtype)
        packed[r:r + n] = pack_bits(q.reshape(n, cols), bits)
        with np.errstate(over="ignore"):
            s16, b16 = s.reshape(n, -1).astype(SCALE_DTYPE), b.reshape(n, -1).astype(SCALE_DTYPE)
        bad = ~(np.isfinite(s16) & np.isfinite(b16))
        if bad.any():
            row, group = (int(i) for i in np.argwhere(bad)[0])
            raise QuantError(f"tensor {name!r} ({qtype.name}): row {r + row}, group {group} has scale "
                             f"{float(s.reshape(n, -1)[row, group])} and bias {float(b.reshape(n, -1)[row, group])}, "
                             "which float16 cannot hold (corrupt block scales?)")
        scales[r:r + n], biases[r:r + n] = s16, b16
    return packed, scales, biases


# ---------------------------------------------------------------------- the file's blocks (MLX ops)

def _u8(values: list[int], shape: tuple[int, ...]) -> Array:
    return mx.array(np.array(values, np.uint8).reshape(shape))


def _half(raw: Array) -> Array:
    """Trailing two-byte field (..., 2) uint8 -> float32 (..., 1)."""
    return mx.view(raw, mx.float16).astype(mx.float32)


def dequantize_blocks(b: Array, qtype: QType) -> Array:
    """Rows of Q2_K/Q3_K/Q6_K blocks (..., n_blocks, type_size) uint8 -> float32 (..., n_blocks * 256),
    with the float32 operations of `gguf.quants.dequantize` in its order (so bit for bit equal)."""
    lead, nb = tuple(b.shape[:-2]), b.shape[-2]
    shape = (*lead, nb)
    if qtype == QType.Q6_K:
        ql = mx.reshape(b[..., 0:128], (*shape, 2, 1, 64)) >> _u8([0, 4], (2, 1))
        ql = mx.reshape(ql & 0x0F, (*shape, 8, 32))
        qh = mx.reshape(b[..., 128:192], (*shape, 2, 1, 32)) >> _u8([0, 2, 4, 6], (4, 1))
        qh = mx.reshape(qh & 0x03, (*shape, 8, 32))
        q = (ql | (qh << 4)).astype(mx.float32) - 32.0
        sc = mx.view(b[..., 192:208], mx.int8).astype(mx.float32)
        dl = mx.reshape(_half(b[..., 208:210]) * sc, (*shape, 16, 1))
        return mx.reshape(dl * mx.reshape(q, (*shape, 16, 16)), (*lead, nb * QK_K))
    if qtype == QType.Q3_K:
        hmask, qs, scales = b[..., 0:32], b[..., 32:96], b[..., 96:108]
        low = mx.reshape(mx.reshape(scales[..., 0:8], (*shape, 1, 8)) >> _u8([0, 4], (2, 1)), (*shape, 16))
        high = mx.reshape(mx.reshape(scales[..., 8:12], (*shape, 1, 4)) >> _u8([0, 2, 4, 6], (4, 1)), (*shape, 16))
        sc = ((low & 0x0F) | ((high & 0x03) << 4)).astype(mx.float32) - 32.0
        dl = mx.reshape(_half(b[..., 108:110]) * sc, (*shape, 16, 1))
        ql = mx.reshape(mx.reshape(qs, (*shape, 2, 1, 32)) >> _u8([0, 2, 4, 6], (4, 1)), (*shape, 16, 16)) & 3
        qh = mx.reshape(mx.reshape(hmask, (*shape, 1, 1, 32)) >> _u8(list(range(8)), (8, 1)), (*shape, 16, 16)) & 1
        q = ql.astype(mx.float32) - ((qh ^ 1) << 2).astype(mx.float32)
        return mx.reshape(dl * q, (*lead, nb * QK_K))
    if qtype == QType.Q2_K:
        scales, qs = b[..., 0:16], b[..., 16:80]
        d, dmin = _half(b[..., 80:82]), _half(b[..., 82:84])
        dl = mx.reshape(d * (scales & 0x0F).astype(mx.float32), (*shape, 16, 1))
        ml = mx.reshape(dmin * (scales >> 4).astype(mx.float32), (*shape, 16, 1))
        q = mx.reshape(mx.reshape(qs, (*shape, 2, 1, 32)) >> _u8([0, 2, 4, 6], (4, 1)), (*shape, 16, 16)) & 3
        return mx.reshape(dl * q.astype(mx.float32) - ml, (*lead, nb * QK_K))
    raise QuantError(f"{qtype.name} is not kept as blocks")


def block_shape(qtype: QType, cols: int) -> tuple[int, int]:
    """(blocks, bytes a block) of a row of `cols` weights: the trailing dimensions of a block weight."""
    block, size = GGML_QUANT_SIZES[qtype]
    if cols % block:
        raise QuantError(f"{cols} inputs are not a multiple of {qtype.name}'s block of {block}")
    return cols // block, size


__all__ = ["GROUP", "QK_K", "AFFINE_BITS", "EXACT_AFFINE", "BLOCK_TYPES", "SCALE_DTYPE", "QuantError", "affine_parts",
           "pack_bits", "repack_affine", "dequantize_blocks", "block_shape"]

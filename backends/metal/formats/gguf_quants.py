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

import os
from collections.abc import Callable
from concurrent.futures import Executor

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
_CHUNK_WEIGHTS = 1 << 22  # most weights a chunk of rows repacked at once: bounded temporaries per worker
_MIN_CHUNK_WEIGHTS = 1 << 20  # fewer would cost more in numpy's per-call overhead than they convert
_MAX_WORKERS = 16  # most threads converting at once; a tensor is split into this many chunks where sizes allow
_NIBBLE_MASK = np.uint64(0x0F0F0F0F0F0F0F0F)


class QuantError(ValueError):
    """A block holds a scale that the stored layout cannot represent (the message says which)."""


# ---------------------------------------------------------------------- affine repacking (numpy)

def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The float16 field at byte `at` of each block (n, size) uint8 -> float32 (n, 1)."""
    if blocks.flags.c_contiguous and blocks.shape[1] % 2 == 0 and at % 2 == 0:
        # One strided pass over the blocks as 16-bit words, not a copy of n two-byte rows.
        words = blocks.view("<u2")[:, at // 2]
    else:
        words = np.ascontiguousarray(blocks[:, at:at + 2]).view("<u2")[:, 0]
    return words.view("<f2").astype(np.float32).reshape(-1, 1)


def _nibbles(qs: np.ndarray, span: int) -> np.ndarray:
    """Bytes (n, k*span) whose low nibbles hold values [0, span) of each chunk of 2*span values and
    whose high nibbles hold [span, 2 span) -> uint8 (n, 2*k*span) in value order."""
    n, width = qs.shape
    words = span // 8  # span is 16 or 32: whole 64-bit words, each eight nibbles of either half
    src = np.ascontiguousarray(qs).view("<u8").reshape(-1, words)
    out = np.empty((src.shape[0], 2, words), "<u8")
    # Word by word: long one-dimensional loops, where a (n, span) operation runs n loops of span bytes.
    for j in range(words):
        np.bitwise_and(src[:, j], _NIBBLE_MASK, out=out[:, 0, j])
        np.right_shift(src[:, j], np.uint64(4), out=out[:, 1, j])
        np.bitwise_and(out[:, 1, j], _NIBBLE_MASK, out=out[:, 1, j])
    return out.view(np.uint8).reshape(n, 2 * width)


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
        d = _f16(blocks, 0)
        # int8 q + 128 as uint8 is q's byte with its sign bit flipped.
        return blocks[:, 2:] ^ np.uint8(0x80), d, -128 * d
    if qtype in (QType.Q4_0, QType.Q4_1):
        d = _f16(blocks, 0)
        q = _nibbles(blocks[:, 2:] if qtype == QType.Q4_0 else blocks[:, 4:], 16)
        return q, d, (-8 * d if qtype == QType.Q4_0 else _f16(blocks, 2))
    if qtype in (QType.Q5_0, QType.Q5_1):
        d = _f16(blocks, 0)
        at = 2 if qtype == QType.Q5_0 else 4
        # Bit i of the little-endian 32-bit qh is bit i % 8 of its byte i // 8.
        high = np.unpackbits(blocks[:, at:at + 4], axis=-1, bitorder="little")
        q = _nibbles(blocks[:, at + 4:], 16) | (high << 4)
        return q, d, (-16 * d if qtype == QType.Q5_0 else _f16(blocks, 2))
    if qtype in (QType.Q4_K, QType.Q5_K):
        d, dmin = _f16(blocks, 0), _f16(blocks, 2)
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
        # Each 16-bit word holds a pair of values: its low byte, with the high one's bits shifted
        # down, is the pair's packed byte (values < 16, so nothing else reaches it).
        pairs = np.ascontiguousarray(q).view("<u2")
        nibbles: np.ndarray = (pairs | (pairs >> np.uint16(4))).astype(np.uint8)
        return nibbles.view("<u4").reshape(rows, -1)
    # Eight values fill `bits` whole bytes: the low bytes of the little-endian 64-bit word holding them.
    eight = np.ascontiguousarray(q).reshape(-1, 8)
    word = eight[:, 0].astype("<u8")
    for i in range(1, 8):
        word |= eight[:, i].astype("<u8") << np.uint64(i * bits)
    packed = np.ascontiguousarray(word.view(np.uint8).reshape(-1, 8)[:, :bits])
    return packed.reshape(rows, cols * bits // 8).view("<u4")


def _chunk_rows(rows: int, cols: int) -> int:
    """Rows repacked at once: the tensor in _MAX_WORKERS parts, unless that makes chunks smaller than
    _MIN_CHUNK_WEIGHTS or larger than _CHUNK_WEIGHTS (the cap wins). Independent of the machine."""
    cols = max(cols, 1)
    even = -(-rows // _MAX_WORKERS)
    return max(1, min(max(even, _MIN_CHUNK_WEIGHTS // cols), _CHUNK_WEIGHTS // cols))


def convert_workers() -> int:
    """Threads for converting a file's tensors: the CPUs this process may run on, at most _MAX_WORKERS."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity outside Linux
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, _MAX_WORKERS))


Repacked = tuple[np.ndarray, np.ndarray, np.ndarray]  # packed uint32, float16 scales, float16 biases


def repack_affine(data: np.ndarray, qtype: QType, name: str, *, rows: np.ndarray | None = None,
                  pool: Executor | None = None) -> Repacked:
    """A tensor's rows of blocks (rows, row_bytes) uint8 -> MLX affine (packed uint32, float16 scales,
    float16 biases), in chunks of rows. `name` is the tensor named in errors. `rows`: the rows to
    take, in that order (`data[rows]`, without copying the tensor first); errors count rows in the
    result's order. `pool`: threads that repack the chunks at once (numpy releases the GIL in its
    loops), else this thread does; either way the result and the error raised (the first bad block
    in row order) are the same."""
    return start_repack(data, qtype, name, rows=rows, pool=pool)()


def start_repack(data: np.ndarray, qtype: QType, name: str, *, rows: np.ndarray | None = None,
                 pool: Executor | None = None) -> Callable[[], Repacked]:
    """`repack_affine` begun: with a pool, the chunks are queued on it now; the function returned
    waits for them (or, without one, repacks) and returns the result or raises its error."""
    block, size = GGML_QUANT_SIZES[qtype]
    bits = AFFINE_BITS[qtype]
    n_rows = data.shape[0] if rows is None else rows.shape[0]
    cols = data.shape[1] // size * block
    packed = np.empty((n_rows, cols * bits // 32), np.uint32)
    scales = np.empty((n_rows, cols // GROUP), SCALE_DTYPE)
    biases = np.empty((n_rows, cols // GROUP), SCALE_DTYPE)
    step = _chunk_rows(n_rows, cols)

    def chunk(r: int) -> None:
        # Each chunk writes its own rows of the outputs; its temporaries live only here.
        part = np.asarray(data[r:r + step] if rows is None else data[rows[r:r + step]])
        n = part.shape[0]
        q, s, b = affine_parts(part.reshape(-1, size), qtype)
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

    starts = range(0, n_rows, step)
    if pool is None:
        def run() -> Repacked:
            for r in starts:
                chunk(r)
            return packed, scales, biases
        return run
    futures = [pool.submit(chunk, r) for r in starts]

    def wait() -> Repacked:
        # In row order, so the first chunk in order that failed raises; those not started are dropped.
        try:
            for future in futures:
                future.result()
        finally:
            for future in futures:
                future.cancel()
        return packed, scales, biases
    return wait


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
           "pack_bits", "convert_workers", "Repacked", "repack_affine", "start_repack", "dequantize_blocks",
           "block_shape"]

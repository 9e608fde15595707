"""MLX's affine quantization in numpy, and mlx-lm's choice of what a plain checkpoint quantizes."""
from __future__ import annotations

from typing import Any

import numpy as np

QUANTIZE_BITS = (2, 3, 4, 6, 8)
ROUTER_QUANT = {"group_size": 64, "bits": 8}  # mlx-lm's quant_predicate for the MoE routers


def quantize_affine(w: np.ndarray, group_size: int = 64, bits: int = 4) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """MLX's affine quantization in numpy: returns (packed uint32 weight, scales, biases).

    Per group of `group_size` along the last axis, w ≈ scale * q + bias with q in [0, 2^bits).
    Like MLX, the scale is nudged so that the endpoint of larger magnitude is hit exactly (which
    keeps 0 exact when it is the group's minimum or maximum), and the q values are packed as one
    little-endian bit stream per row, `bits` bits each, into uint32 words.
    """
    if bits not in QUANTIZE_BITS:
        raise ValueError(f"bits must be one of {QUANTIZE_BITS}, got {bits}")
    if w.ndim < 2 or w.shape[-1] % group_size:
        raise ValueError(f"last axis {w.shape[-1]} of shape {w.shape} is not a multiple of group_size {group_size}")
    groups = w.astype(np.float32).reshape(*w.shape[:-1], -1, group_size)
    w_min = groups.min(axis=-1, keepdims=True)
    w_max = groups.max(axis=-1, keepdims=True)
    levels = np.float32(2**bits - 1)
    scales = np.maximum((w_max - w_min) / levels, np.float32(1e-7))
    min_is_edge = np.abs(w_min) > np.abs(w_max)
    scales = np.where(min_is_edge, scales, -scales)
    edge = np.where(min_is_edge, w_min, w_max)
    q0 = np.rint(edge / scales)
    with np.errstate(divide="ignore", invalid="ignore"):
        scales = np.where(q0 != 0, edge / q0, scales).astype(np.float32)
    biases = np.where(q0 == 0, np.float32(0), edge).astype(np.float32)
    q = np.clip(np.rint((groups - biases) / scales), 0, levels).astype(np.uint8)
    q = q.reshape(*w.shape[:-1], w.shape[-1])
    # Little-endian bit stream: value j takes bits [j*bits, (j+1)*bits) of its row.
    bit_planes = (q[..., None] >> np.arange(bits, dtype=np.uint8)) & 1
    stream = bit_planes.reshape(*w.shape[:-1], w.shape[-1] * bits)
    packed = np.packbits(stream, axis=-1, bitorder="little").view("<u4").astype(np.uint32)
    return packed, scales[..., 0].astype(w.dtype), biases[..., 0].astype(w.dtype)


def quantize_dense(weights: dict[str, np.ndarray], arch: str, group_size: int,
                   bits: int) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Every projection, the embedding and the head whose input size fits the group (no overrides)."""
    out: dict[str, np.ndarray] = {}
    for name, value in weights.items():
        quantizable = name.endswith(("_proj.weight", "embed_tokens.weight", "lm_head.weight"))
        if quantizable and value.ndim == 2 and value.shape[-1] % group_size == 0:
            stem = name[: -len(".weight")]
            out[name], out[stem + ".scales"], out[stem + ".biases"] = quantize_affine(value, group_size, bits)
        else:
            out[name] = value
    return out, {}


__all__ = ["QUANTIZE_BITS", "ROUTER_QUANT", "quantize_affine", "quantize_dense"]

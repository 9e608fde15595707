"""Training losses: cross-entropy (through logsumexp), masked cross-entropy over completion tokens, MSE.

Losses are computed in float32 whatever the logits' dtype (float64 stays float64): bfloat16
logsumexp over a large vocabulary loses the small differences that the gradient is made of.
"""
from __future__ import annotations

from typing import Literal

import pymlxc.core as mx
from pymlxc.core import Array

Reduction = Literal["none", "mean", "sum"]


def _reduce(loss: Array, reduction: Reduction) -> Array:
    if reduction == "none":
        return loss
    if reduction == "mean":
        return mx.mean(loss)
    if reduction == "sum":
        return mx.sum(loss)
    raise ValueError(f"reduction must be 'none', 'mean' or 'sum', not {reduction!r}")


def _wide(x: Array) -> Array:
    return x if x.dtype in (mx.float32, mx.float64) else x.astype(mx.float32)


def cross_entropy(logits: Array, targets: Array, reduction: Reduction = "none") -> Array:
    """-log softmax(logits)[target] along the last axis, as logsumexp(logits) - logits[target]
    (never exp of a large logit). `targets` holds class indices, shaped like `logits` minus its last axis."""
    if tuple(targets.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"targets shape {tuple(targets.shape)} does not match logits shape {tuple(logits.shape)} "
                         "without its last axis")
    logits = _wide(logits)
    picked = mx.squeeze(mx.take_along_axis(logits, mx.expand_dims(targets.astype(mx.int32), -1), -1), -1)
    return _reduce(mx.logsumexp(logits, -1) - picked, reduction)


def masked_cross_entropy(logits: Array, targets: Array, mask: Array) -> tuple[Array, Array]:
    """(mean cross-entropy over the positions where `mask` is true, number of such positions).

    Prompt tokens and padding are masked out; an all-false mask gives loss 0, not NaN.
    """
    if tuple(mask.shape) != tuple(targets.shape):
        raise ValueError(f"mask shape {tuple(mask.shape)} does not match targets shape {tuple(targets.shape)}")
    per_token = cross_entropy(logits, targets)
    weights = mask.astype(per_token.dtype)
    ntokens = mx.sum(weights)
    return mx.sum(per_token * weights) / mx.maximum(ntokens, 1.0), ntokens


def mse(predictions: Array, targets: Array, reduction: Reduction = "mean") -> Array:
    """Mean squared error, elementwise (predictions and targets broadcast)."""
    return _reduce(mx.square(_wide(predictions) - _wide(targets)), reduction)

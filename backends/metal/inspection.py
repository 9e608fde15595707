"""`inspect_attention`: what each attention layer holds for a prompt, as numpy arrays.

The prompt goes through the model as `generate`'s prefill takes it: into fresh caches of
`context_len`, in chunks of `PREFILL_STEP` at the same boundaries, so memory is bounded by a chunk
(and the arrays returned) and every position is computed as `generate` computes it. A cache may
evict (a sliding window, `context_len`), so keys are not read back from the caches: each layer's
cache is wrapped to record the keys it is given (after RoPE and any per-head norm: exactly what
attention uses), chunk by chunk. Queries never reach a cache, so they are recorded by the
architectures' shared attention functions (`models.base.recording_queries`). Linear-attention
layers (a RecurrentCache: no keys) run as they are and are not reported; `num_layers` counts the
attention layers.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

import pymlxc.core as mx
from pymlxc.types import AttentionSnapshot

from . import memory_check
from .cache import Cache, Mask
from .generate import PREFILL_STEP
from .models.base import recording_queries
from .recurrent_cache import RecurrentCache


class _Recorded:
    """A layer's cache that keeps the keys of each `update_and_fetch` (the `Cache` protocol's
    other members are the wrapped cache's)."""

    def __init__(self, cache: Cache) -> None:
        self.cache = cache
        self.keys: list[mx.Array] = []

    @property
    def offset(self) -> int:
        return self.cache.offset

    def update_and_fetch(self, keys: mx.Array, values: mx.Array) -> tuple[mx.Array, mx.Array]:
        self.keys.append(keys)
        return self.cache.update_and_fetch(keys, values)

    def make_mask(self, n: int, window_size: int | None = None) -> Mask:
        return self.cache.make_mask(n, window_size)

    @property
    def state(self) -> tuple[mx.Array, ...]:
        return self.cache.state


def _per_head(a: mx.Array) -> np.ndarray:
    """[1, heads, L, D] -> float32 [heads, L, D]."""
    heads: np.ndarray = np.asarray(mx.astype(a, mx.float32))[0]
    return heads


def _output_bytes(model: Any, cache: Sequence[Any], n: int, include_queries: bool) -> int:
    """float32 bytes of the keys (and queries) returned for `n` positions, 0 where unknown."""
    shapes = memory_check.layer_shapes(model, cache)
    if shapes is None:
        return 0
    heads = sum(s.head_dim * (s.kv_heads + (s.query_heads if include_queries else 0)) for s in shapes)
    return 4 * n * heads


def inspect_attention(model: Any, ids: Sequence[int], *, architecture: str, include_queries: bool = False,
                      context_len: int | None = None, step: int = PREFILL_STEP) -> AttentionSnapshot:
    """The keys of every layer for `ids` (and the queries, when asked), from a chunked prefill into
    fresh caches of `context_len`. The logits are never evaluated."""
    ids = list(ids)
    if not ids:
        raise ValueError("the prompt has no tokens")
    if step < 1:
        raise ValueError(f"step must be >= 1, not {step}")
    layers = [c if isinstance(c, RecurrentCache) else _Recorded(c) for c in model.make_cache(context_len)]
    cache = [r for r in layers if isinstance(r, _Recorded)]  # the attention layers'
    plain = [r.cache if isinstance(r, _Recorded) else r for r in layers]
    memory_check.check(model, plain, batch=1, prompt_len=len(ids), step=step,
                       extra=_output_bytes(model, plain, len(ids), include_queries),
                       what=f"inspect_attention of {len(ids)} tokens")
    keys: list[list[np.ndarray]] = [[] for _ in cache]
    queries: list[list[np.ndarray]] | None = [[] for _ in cache] if include_queries else None
    for start in range(0, len(ids), step):
        chunk = mx.array([ids[start:start + step]], dtype=mx.int32)
        if queries is not None:
            with recording_queries() as recorded:
                model(chunk, cache=layers)  # every query of the last layer too: not `last_only`
            if len(recorded) != len(cache):
                raise RuntimeError(f"{architecture}: {len(recorded)} attention calls recorded for {len(cache)} "
                                   "layers; this architecture's attention does not go through models.base")
        else:
            recorded = []
            model(chunk, cache=layers, last_only=True)  # every position's keys still reach the caches
        length = chunk.shape[1]
        for r in cache:
            if len(r.keys) != 1 or r.keys[0].shape[2] != length:
                raise RuntimeError(f"a layer cache got {[k.shape[2] for k in r.keys]} keys for a chunk of {length} "
                                   "tokens: this architecture does not keep one cache per layer, which "
                                   "inspect_attention needs")
        got = [r.keys.pop() for r in cache]
        mx.eval(got + recorded + [r.state for r in layers])
        for i, k in enumerate(got):
            keys[i].append(_per_head(k))
        if queries is not None:
            for i, q in enumerate(recorded):
                queries[i].append(_per_head(q))
        del got, recorded
    key_heads = _joined(keys)
    query_heads = _joined(queries) if queries is not None else None
    num_kv_heads, head_dim = len(key_heads[0]), key_heads[0][0].shape[1]
    return AttentionSnapshot(
        architecture=architecture,
        num_layers=len(key_heads),
        num_kv_heads=int(num_kv_heads),
        num_query_heads=len(query_heads[0]) if query_heads else _query_heads(model, int(num_kv_heads)),
        seq_len=len(ids),
        head_dim=int(head_dim),
        keys=key_heads,
        queries=query_heads,
        token_ids=tuple(ids),
    )


def _joined(layers: list[list[np.ndarray]]) -> list[list[np.ndarray]]:
    """Per layer, its chunks [heads, l, D] -> one contiguous (L, D) array per head; each layer's
    chunks are dropped as it is joined (one layer's copy at a time on top of the result)."""
    out = []
    for i, parts in enumerate(layers):
        whole = np.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]
        layers[i] = []
        out.append([np.ascontiguousarray(whole[h]) for h in range(whole.shape[0])])
    return out


def _query_heads(model: Any, default: int) -> int:
    args = getattr(model, "args", None)
    heads = getattr(args, "num_attention_heads", None)
    return int(heads) if heads else default

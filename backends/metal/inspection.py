"""`inspect_attention`: what each attention layer holds for a prompt, as numpy arrays.

Keys come from the caches after one prefill from empty caches: a cache stores exactly the keys
attention uses (after RoPE and any per-head norm), and one chunk from empty keeps every position
in order, sliding-window layers included. Queries never reach a cache, so they are recorded by the
architectures' shared attention functions (`models.base.recording_queries`).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

import pymlxc.core as mx
from pymlxc.types import AttentionSnapshot

from .models.base import recording_queries


def _keys_of(cache: Any, seq_len: int) -> mx.Array:
    if cache.offset != seq_len or not cache.state:
        raise RuntimeError(f"a layer cache saw {cache.offset} tokens of {seq_len}: this architecture does "
                           "not keep one cache per layer, which inspect_attention needs")
    keys = cache.state[0]
    if keys.shape[2] < seq_len:
        raise RuntimeError(f"a layer cache holds {keys.shape[2]} keys for {seq_len} tokens")
    b, h, _, d = keys.shape
    return mx.slice(keys, [0, 0, 0, 0], [b, h, seq_len, d], [1, 1, 1, 1])


def _per_head(a: mx.Array) -> list[np.ndarray]:
    """[1, heads, L, D] -> one float32 (L, D) array per head."""
    values = np.asarray(mx.astype(a, mx.float32))
    return [np.ascontiguousarray(values[0, h]) for h in range(values.shape[1])]


def inspect_attention(model: Any, ids: Sequence[int], *, architecture: str,
                      include_queries: bool = False) -> AttentionSnapshot:
    """One forward pass of `ids` through `model` into fresh caches; the keys of every layer (and
    the queries, when asked). The logits are never evaluated."""
    ids = list(ids)
    if not ids:
        raise ValueError("the prompt has no tokens")
    cache = model.make_cache(None)
    tokens = mx.array([ids], dtype=mx.int32)
    queries: list[mx.Array] | None = None
    if include_queries:
        with recording_queries() as queries:
            model(tokens, cache=cache)
        if len(queries) != len(cache):
            raise RuntimeError(f"{architecture}: {len(queries)} attention calls recorded for {len(cache)} layers; "
                               "this architecture's attention does not go through models.base")
    else:
        model(tokens, cache=cache)
    keys = [_keys_of(c, len(ids)) for c in cache]
    mx.eval(keys + (queries or []))
    key_heads = [_per_head(k) for k in keys]
    query_heads = [_per_head(q) for q in queries] if queries is not None else None
    _, num_kv_heads, _, head_dim = keys[0].shape
    return AttentionSnapshot(
        architecture=architecture,
        num_layers=len(keys),
        num_kv_heads=int(num_kv_heads),
        num_query_heads=int(queries[0].shape[1]) if queries else _query_heads(model, int(num_kv_heads)),
        seq_len=len(ids),
        head_dim=int(head_dim),
        keys=key_heads,
        queries=query_heads,
        token_ids=tuple(ids),
    )


def _query_heads(model: Any, default: int) -> int:
    args = getattr(model, "args", None)
    heads = getattr(args, "num_attention_heads", None)
    return int(heads) if heads else default

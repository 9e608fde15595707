"""Prefill of the Llama family through shapeless compiled segments.

Built op by op, a prompt chunk costs the binding about 35 calls per layer, and on a fast GPU that
host time is most of the time to the first token of a short prompt. Here each layer's work outside
the attention runs as one replay of a compiled segment, traced once for every prompt length
(`shapeless`), on the arrays of the segmented decode's plan (segments.py):

    the embedding, then
    first: layer 0's norm and q/k/v projections (reshaped to heads)                   (compiled)
    then for each layer i: RoPE at the cache's offset, the cache update, attention with the
    chunk's causal mask, and
    mid:  layer i's o_proj, residual, MLP, residual, layer i+1's norm and q/k/v         (compiled)
    last: the last layer's o_proj, residual, MLP, residual                             (compiled)

RoPE and the embedding stay outside: MLX runs RoPE as a graph of slices where it has no kernel (its
CPU), and a slice fixes its shape, as does the dequantization of a quantized table's rows. For the
same reason the q/k/v and gate/up projections run as their own matmuls here (on the views of the
fused weights), and a dense layer adds its bias after the matmul (`nn.shapeless_trace`). The
segments call the model's own block halves, like the decode's (`Attention.heads` / `output`,
`TransformerBlock.finish`); the tests compare the caches and tokens with the model's own forward.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pymlxc.core as mx
from pymlxc.core import Array

from .. import nn
from ..cache import make_prompt_mask
from ..kernel_choice import mlx_kernels_only
from ..models.base import attention, last_query
from .segments import SegmentGroup, SegmentPlan, call_segment
from .trace import CompileUnavailable, clone_modules
from .trace import spec as traced_spec


def _finish(block: Any, attn_out: Array, h: Array) -> Array:
    """The block's output after its attention (the block's own `finish`)."""
    h, mlp_out = block.finish(h, block.self_attn.output(attn_out))
    out: Array = h + mlp_out
    return out


def _trace_first(inputs: list[Array]) -> list[Array]:
    group: SegmentGroup = traced_spec()
    _embed, norm, attn, _qkv = clone_modules(group.modules, group.arrays, inputs[1:])
    return list(attn.heads(norm(inputs[0])))


def _trace_mid(inputs: list[Array]) -> list[Array]:
    group: SegmentGroup = traced_spec()
    block, _gate_up, norm, attn, _qkv = clone_modules(group.modules, group.arrays, inputs[2:])
    h = _finish(block, inputs[0], inputs[1])
    return [*attn.heads(norm(h)), h]


def _trace_last(inputs: list[Array]) -> list[Array]:
    group: SegmentGroup = traced_spec()
    block = clone_modules(group.modules[:1], group.arrays, inputs[2:])[0]
    return [_finish(block, inputs[0], inputs[1])]


class PrefillFunctions:
    """The three shapeless segments of one model structure, per batch size (a reshape keeps it)."""

    def __init__(self) -> None:
        self._by_batch: dict[int, tuple[Any, ...]] = {}

    def for_batch(self, b: int) -> tuple[Any, ...]:
        """(first, mid, last) compiled."""
        fns = self._by_batch.get(b)
        if fns is None:
            fns = self._by_batch[b] = tuple(mx.compile(f, shapeless=True)
                                            for f in (_trace_first, _trace_mid, _trace_last))
        return fns

    def clear(self) -> None:
        for fns in self._by_batch.values():
            for fn in fns:
                fn.clear()
        self._by_batch.clear()


class PrefillRunner:
    """`runner(tokens, cache, on_layer)`: one chunk [B, L] into the caches (full-attention
    KVCaches, as segments.plan requires); `on_layer(h, cache_i)` after each layer (the threaded
    prefill hands each to the evaluation thread). If a segment fails to trace, the caches are put
    back as they were, `on_fail` is told and CompileUnavailable is raised."""

    def __init__(self, plan: SegmentPlan, blocks: Sequence[Any], fns: PrefillFunctions,
                 on_fail: Callable[[BaseException], None]) -> None:
        self._plan = plan
        self._blocks = list(blocks)
        self._fns = fns
        self._on_fail = on_fail

    def __call__(self, tokens: Array, cache: Sequence[Any], on_layer: Callable[[Array, Any], None] | None = None
                 ) -> Array:
        """The last position's hidden state [B, 1, D] after the last layer (before the final norm),
        lazily: the last layer's attention output and MLP run on that position alone (the caches
        need only its keys and values)."""
        first, mid, last = self._fns.for_batch(tokens.shape[0])
        saved = [c.snapshot() for c in cache]  # the caches as they were, should a segment fail to trace
        try:
            with mlx_kernels_only(), nn.shapeless_trace():  # a trace here serves every chunk length
                return self._run(tokens, cache, on_layer, first, mid, last)
        except Exception as exc:
            for c, state in zip(cache, saved, strict=True):
                c.restore(state)
            self._on_fail(exc)
            raise CompileUnavailable(str(exc)) from exc

    def _run(self, tokens: Array, cache: Sequence[Any], on_layer: Callable[[Array, Any], None] | None,
             first: Any, mid: Any, last: Any) -> Array:
        plan, blocks = self._plan, self._blocks
        embed: Any = plan.first.modules[0]
        h: Array = embed(tokens)  # the embedding (a quantized table's gather fixes its shape)
        q, k, v = call_segment(first, plan.first, [h])
        length = tokens.shape[1]
        for i, block in enumerate(blocks):
            attn, c = block.self_attn, cache[i]
            offset = c.offset
            q, k = attn.rope(q, offset), attn.rope(k, offset)
            keys, values = c.update_and_fetch(k, v)
            mask = make_prompt_mask(length, c, None)
            final = i + 1 == len(blocks)
            if final:
                (q, mask), h = last_query(q, mask), h[:, -1:]
            out = attention(q, keys, values, scale=attn.scale, mask=mask)
            if final:
                (h,) = call_segment(last, plan.last, [out, h])
            else:
                q, k, v, h = call_segment(mid, plan.mids[i], [out, h])
            if on_layer is not None:
                on_layer(h, c)
        return h


__all__ = ["PrefillFunctions", "PrefillRunner"]

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
CPU), and a slice fixes its shape, as does the dequantization of a quantized table's rows. For the same reason the q/k/v and gate/up projections run as their own matmuls
here (on the views of the fused weights). The segments mirror `llama.Attention`,
`qwen3.Attention` and `llama.TransformerBlock` like the decode's; the tests compare the caches
and tokens with the model's own forward.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pymlxc.core as mx
from pymlxc.core import Array

from . import nn
from .cache import make_prompt_mask
from .matvec import mlx_kernels_only
from .models import qwen3
from .models.base import attention, last_query
from .segments import SegmentPlan, _clone, _Group, _tracing, call_segment


def _linear(m: Any, x: Array) -> Array:
    """`m(x)`, except that a dense layer's bias is added after the matmul: MLX's fused `addmm`
    flattens the rows to a fixed count."""
    if type(m) is nn.Linear and m.__dict__.get("bias") is not None:
        return mx.matmul(x, m._wT) + m.bias  # noqa: SLF001 - the layer's own transposed view
    return m(x)


def _heads(attn: Any, x: Array) -> list[Array]:
    """q, k, v [B, heads, L, D] of a chunk, before RoPE (`-1`: any length)."""
    b = x.shape[0]
    q = mx.reshape(_linear(attn.q_proj, x), (b, -1, attn.n_heads, attn.head_dim))
    k = mx.reshape(_linear(attn.k_proj, x), (b, -1, attn.n_kv_heads, attn.head_dim))
    v = mx.reshape(_linear(attn.v_proj, x), (b, -1, attn.n_kv_heads, attn.head_dim))
    if isinstance(attn, qwen3.Attention):
        q, k = attn.q_norm(q), attn.k_norm(k)
    return [mx.transpose(t, (0, 2, 1, 3)) for t in (q, k, v)]


def _finish(block: Any, attn_out: Array, h: Array) -> Array:
    attn = block.self_attn
    out = mx.reshape(mx.transpose(attn_out, (0, 2, 1, 3)), (h.shape[0], -1, attn.n_heads * attn.head_dim))
    h = h + _linear(attn.o_proj, out)
    x, mlp = block.post_attention_layernorm(h), block.mlp  # as llama.MLP: down(silu(gate) * up)
    return h + _linear(mlp.down_proj, nn.silu(_linear(mlp.gate_proj, x)) * _linear(mlp.up_proj, x))


def _trace_first(inputs: list[Array]) -> list[Array]:
    group: _Group = _tracing.group
    _embed, norm, attn, _qkv = _clone(group.modules, group.arrays, inputs[1:])
    return _heads(attn, norm(inputs[0]))


def _trace_mid(inputs: list[Array]) -> list[Array]:
    group: _Group = _tracing.group
    block, _gate_up, norm, attn, _qkv = _clone(group.modules, group.arrays, inputs[2:])
    h = _finish(block, inputs[0], inputs[1])
    return [*_heads(attn, norm(h)), h]


def _trace_last(inputs: list[Array]) -> list[Array]:
    group: _Group = _tracing.group
    block = _clone(group.modules[:1], group.arrays, inputs[2:])[0]
    return [_finish(block, inputs[0], inputs[1])]


class PrefillFunctions:
    """The three shapeless segments of one model structure, per batch size (a reshape keeps it)."""

    def __init__(self) -> None:
        self._by_batch: dict[int, tuple[Any, Any, Any]] = {}

    def for_batch(self, b: int) -> tuple[Any, Any, Any]:
        fns = self._by_batch.get(b)
        if fns is None:
            fns = self._by_batch[b] = tuple(mx.compile(f, shapeless=True) for f in (_trace_first, _trace_mid, _trace_last))
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
        from .compiled import CompileUnavailable  # noqa: PLC0415

        first, mid, last = self._fns.for_batch(tokens.shape[0])
        saved = [dict(vars(c)) for c in cache]  # the caches as they were, should a segment fail to trace
        try:
            with mlx_kernels_only():  # a trace here serves every chunk length
                return self._run(tokens, cache, on_layer, first, mid, last)
        except Exception as exc:
            for c, state in zip(cache, saved):
                vars(c).clear()
                vars(c).update(state)
            self._on_fail(exc)
            raise CompileUnavailable(str(exc)) from exc

    def _run(self, tokens: Array, cache: Sequence[Any], on_layer: Callable[[Array, Any], None] | None,
             first: Any, mid: Any, last: Any) -> Array:
        plan, blocks = self._plan, self._blocks
        h = plan.first.modules[0](tokens)  # the embedding (a quantized table's gather fixes its shape)
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

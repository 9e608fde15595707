"""The segmented decode step of the Llama family: compiled segments between the attentions, and
attention itself on exact-length keys through MLX's fused kernel.

The whole-step graph of `compiled.py` attends over fixed-size rings with an additive mask. MLX's
CUDA decode kernels take no array mask, so there every layer's attention runs as MLX's unfused
fallback (scale, matmul, mask, softmax, matmul): four kernels more per layer than mlx-lm, which
attends over the exact keys. This step keeps the fused kernel: per token it calls

    first: embedding, layer 0's norm and q/k/v projections with RoPE          (compiled)
    then for each layer i: write k, v at the position (static slice update), attend over the
    keys so far (a view, no mask), and
    mid:  layer i's o_proj, residual, MLP, residual, and layer i+1's norm, q/k/v and RoPE  (compiled)
    last: the last layer's o_proj, residual, MLP, residual, final norm, head, greedy pick  (compiled)

One trace of `mid` serves every layer (the weights are inputs), so a model is traced three times.
The segments mirror `llama.Attention` / `qwen3.Attention` (Qwen 2's is Llama's with biases) and
`llama.TransformerBlock`; `plan()` accepts exactly those classes (LoRA-wrapped projections are
fine: they are called as modules) and full attention only, and the tests compare its tokens with
the uncompiled loop's. Selected with `PYMLXC_DECODE=segmented`; see `compiled.py` for the rest.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pymlxc.core as mx
from pymlxc.core import Array
from pymlxc.core.transforms import FixedArrays

from .models import llama, qwen3
from .nn import Module
from .sample import greedy

_ATTENTION = (llama.Attention, qwen3.Attention)
_sdpa = mx.fast.scaled_dot_product_attention
_tracing = threading.local()


def plan(model: Any) -> list[llama.TransformerBlock] | None:
    """The blocks of a Llama-family model whose decode step can be segmented, else None."""
    if not isinstance(model, llama.Model) or any(w is not None for w in model.layer_windows()):
        return None
    blocks = list(model.layers)
    for block in blocks:
        if (type(block) is not llama.TransformerBlock or not isinstance(block.self_attn, _ATTENTION)
                or type(block.self_attn).__call__ not in (llama.Attention.__call__, qwen3.Attention.__call__)
                or type(block.mlp) is not llama.MLP):
            return None
    return blocks or None


# ---------------------------------------------------------------------- the segments (traced)

def _project(attn: Any, x: Array, pos: Array) -> tuple[Array, Array, Array]:
    """q, k, v [B, heads, 1, D] of one token, as `llama/qwen3.Attention` make them, RoPE'd at `pos`."""
    b = x.shape[0]
    q = mx.reshape(attn.q_proj(x), (b, 1, attn.n_heads, attn.head_dim))
    k = mx.reshape(attn.k_proj(x), (b, 1, attn.n_kv_heads, attn.head_dim))
    v = mx.reshape(attn.v_proj(x), (b, 1, attn.n_kv_heads, attn.head_dim))
    if isinstance(attn, qwen3.Attention):
        q, k = attn.q_norm(q), attn.k_norm(k)
    q = mx.transpose(q, (0, 2, 1, 3))
    k = mx.transpose(k, (0, 2, 1, 3))
    v = mx.transpose(v, (0, 2, 1, 3))
    return attn.rope(q, pos), attn.rope(k, pos), v


def _finish_block(block: Any, attn_out: Array, h: Array) -> Array:
    b = h.shape[0]
    o = block.self_attn.o_proj(mx.reshape(mx.transpose(attn_out, (0, 2, 1, 3)), (b, 1, -1)))
    h = h + o
    return h + block.mlp(block.post_attention_layernorm(h))


def _clone(modules: Sequence[Module | None], arrays: Sequence[Array], tracers: Sequence[Array]) -> list[Any]:
    from .compiled import _Cloner  # noqa: PLC0415 - one copier for both decode paths

    cloner = _Cloner({id(a): t for a, t in zip(arrays, tracers)})
    return [cloner.clone(m) if m is not None else None for m in modules]


def _trace_first(inputs: list[Array]) -> list[Array]:
    group: _Group = _tracing.group
    group.stats["traces"] += 1
    tokens, pos = inputs[0], inputs[1]
    embed, norm, attn = _clone(group.modules, group.arrays, inputs[2:])
    h = embed(mx.reshape(tokens, (tokens.shape[0], 1)))
    q, k, v = _project(attn, norm(h), pos)
    return [q, k, v, h]


def _trace_mid(inputs: list[Array]) -> list[Array]:
    group: _Group = _tracing.group
    attn_out, h, pos = inputs[0], inputs[1], inputs[2]
    block, norm, attn = _clone(group.modules, group.arrays, inputs[3:])
    h = _finish_block(block, attn_out, h)
    q, k, v = _project(attn, norm(h), pos)
    return [q, k, v, h]


def _trace_last(inputs: list[Array]) -> list[Array]:
    group: _Group = _tracing.group
    attn_out, h, pos = inputs[0], inputs[1], inputs[2]
    block, norm, embed, head = _clone(group.modules, group.arrays, inputs[3:])
    h = norm(_finish_block(block, attn_out, h))
    logits = embed.as_linear(h) if group.tied else head(h)
    logits = mx.reshape(logits, (logits.shape[0], logits.shape[-1]))
    return [greedy(logits) if group.fuse_greedy else logits, pos + 1]


@dataclass
class _Group:
    """The modules one segment call runs, their arrays (the call's fixed inputs) and flags."""

    modules: list[Module | None]
    arrays: list[Array]
    fixed: FixedArrays
    stats: dict[str, int]
    tied: bool = False
    fuse_greedy: bool = False


def _group(modules: Sequence[Module | None], stats: dict[str, int], **flags: Any) -> _Group:
    from .compiled import _arrays_of  # noqa: PLC0415

    present = [m for m in modules if m is not None]
    arrays: list[Array] = []
    seen: set[int] = set()
    for m in present:
        for a in _arrays_of(m):
            if id(a) not in seen:
                seen.add(id(a))
                arrays.append(a)
    return _Group(list(modules), arrays, FixedArrays(arrays), stats, **flags)


class SegmentFunctions:
    """The three compiled segments of one model structure (kept by the decoder per structure)."""

    def __init__(self) -> None:
        self.first = mx.compile(_trace_first)
        self.mid = mx.compile(_trace_mid)
        self.last = mx.compile(_trace_last)

    def clear(self) -> None:
        for fn in (self.first, self.mid, self.last):
            fn.clear()


# ---------------------------------------------------------------------- a generation

class SegmentedSession:
    """One generation's decode on the segments; `decode(first_inputs, max_tokens)` yields the
    sampled ids [B] like `generate.decode`, the caches get the buffers back when it ends."""

    def __init__(self, model: Any, blocks: list[Any], layers: list[Any], fns: SegmentFunctions,
                 fuse_greedy: bool, sampler: Any, first_position: int,
                 on_fail: Callable[[BaseException], None], stats: dict[str, int]) -> None:
        inner = model.model
        tied = model.lm_head is None
        self._layers = layers  # compiled._Layer: cache and ring size (= buffer length)
        self._fns = fns
        self._fuse_greedy = fuse_greedy
        self._sampler = sampler
        self._first = _group([inner.embed_tokens, blocks[0].input_layernorm, blocks[0].self_attn], stats)
        self._mids = [_group([blocks[i], blocks[i + 1].input_layernorm, blocks[i + 1].self_attn], stats)
                      for i in range(len(blocks) - 1)]
        self._last = _group([blocks[-1], inner.norm, inner.embed_tokens, model.lm_head], stats, tied=tied,
                            fuse_greedy=fuse_greedy)
        self._scales = [float(b.self_attn.scale) for b in blocks]
        self._buffers: list[Array] = []
        self._position = first_position
        self._on_fail = on_fail

    def _call(self, fn: Any, group: _Group, inputs: list[Array]) -> list[Array]:
        _tracing.group = group
        try:
            return fn.call_flat(inputs, group.fixed)
        finally:
            _tracing.group = None

    def _step(self, tokens: Array, pos: Array) -> tuple[Array, Array]:
        """One token through every layer; returns (sampled ids or logits, pos + 1)."""
        fns, p = self._fns, self._position
        q, k, v, h = self._call(fns.first, self._first, [tokens, pos])
        buffers = self._buffers
        out = None
        for i, scale in enumerate(self._scales):
            keys, values = buffers[2 * i], buffers[2 * i + 1]
            b, kvh, _, dk = keys.shape
            dv = values.shape[3]
            keys = mx.slice_update(keys, k, [0, 0, p, 0], [b, kvh, p + 1, dk], [1, 1, 1, 1])
            values = mx.slice_update(values, v, [0, 0, p, 0], [b, kvh, p + 1, dv], [1, 1, 1, 1])
            buffers[2 * i], buffers[2 * i + 1] = keys, values
            attn = _sdpa(q, mx.slice(keys, [0, 0, 0, 0], [b, kvh, p + 1, dk], [1, 1, 1, 1]),
                         mx.slice(values, [0, 0, 0, 0], [b, kvh, p + 1, dv], [1, 1, 1, 1]), scale=scale)
            if i + 1 < len(self._scales):
                q, k, v, h = self._call(fns.mid, self._mids[i], [attn, h, pos])
            else:
                out, pos = self._call(fns.last, self._last, [attn, h, pos])
        self._position += 1
        return out, pos

    def decode(self, first_inputs: Array, max_tokens: int) -> Iterator[Array]:
        from .compiled import _give_back, _ring_of  # noqa: PLC0415

        rings = [_ring_of(layer) for layer in self._layers]
        self._buffers = [a for pair in rings for a in pair]
        del rings
        for layer in self._layers:  # the session owns the buffers (see compiled.py)
            layer.cache.keys = layer.cache.values = None
        try:
            b = first_inputs.shape[0]
            tokens = mx.reshape(first_inputs, (b,))
            pos = mx.array(self._position, dtype=mx.int32)
            try:
                out, pos = self._step(tokens, pos)  # the first call of each segment traces it
            except Exception as exc:
                from .compiled import CompileUnavailable  # noqa: PLC0415

                self._on_fail(exc)
                raise CompileUnavailable(str(exc)) from exc
            tokens = out if self._fuse_greedy else self._sampler(out)
            mx.async_eval(tokens)
            for n in range(1, max_tokens + 1):
                following = None
                if n < max_tokens:
                    out, pos = self._step(tokens, pos)
                    following = out if self._fuse_greedy else self._sampler(out)
                    mx.async_eval(following)
                yield tokens
                if following is None:
                    return
                tokens = following
        finally:
            if self._buffers:
                for i, layer in enumerate(self._layers):
                    _give_back(layer, self._buffers[2 * i], self._buffers[2 * i + 1], self._position)
                self._buffers = []


__all__ = ["plan", "SegmentFunctions", "SegmentedSession"]

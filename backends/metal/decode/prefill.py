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
fused weights), and a dense layer adds its bias after the matmul (`nn.shapeless_trace`). A GGUF
block layer (a K-quant recipe's Q6_K value and down projections) has its rows dequantized outside
the trace, before each segment call (`BlockLinear.dense_chunks`, through the GPU kernels), and
handed in as inputs of that call, which the trace multiplies as dense matmuls: the products the
model's forward computes for many rows. Segments whose block layers differ in place or chunks are
traced apart. The segments call the model's own block halves, like the decode's
(`Attention.heads` / `output`, `TransformerBlock.finish`); the tests compare the caches and tokens
with the model's own forward.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pymlxc.core as mx
from pymlxc.core import Array

from .. import nn
from ..cache import make_prompt_mask
from ..kernel_choice import kernels_again, mlx_kernels_only
from ..models.base import attention, last_query
from .segments import SegmentGroup, SegmentPlan
from .trace import CompileUnavailable, call_traced, clone_modules
from .trace import spec as traced_spec


def _finish(block: Any, attn_out: Array, h: Array) -> Array:
    """The block's output after its attention (the block's own `finish`)."""
    h, mlp_out = block.finish(h, block.self_attn.output(attn_out))
    out: Array = h + mlp_out
    return out


@dataclass(frozen=True)
class PrefillSpec:
    """What a prefill segment's trace reads (`trace.spec()`): the decode plan's group, how many of its
    modules the trace runs (the last segment: the last block alone), and the block layers it takes
    dense rows for: their places (module index, path within it) and each one's chunks."""

    group: SegmentGroup
    modules: int
    places: tuple[tuple[int, str], ...] = ()
    chunks: tuple[int, ...] = ()
    joint: bool = False  # the next layer's q/k/v as its fused product's output (`_project`)

    def traced(self) -> list[Any]:
        """The modules the trace runs."""
        return list(self.group.modules[:self.modules])


def block_layers(modules: Sequence[Any]) -> dict[tuple[int, str], Any]:
    """The GGUF block linears among `modules` and their submodules by place (module index, path
    within it; a layer reached twice keeps its first place), in an order fixed by the structure:
    the layers whose rows the prefill dequantizes outside the trace. Found by their `dense_chunks`
    (gguf_layers needs the optional `gguf` package)."""
    found: dict[tuple[int, str], Any] = {}
    seen: set[int] = set()
    for i, module in enumerate(modules):
        if module is not None:
            for name, sub in module.named_modules():
                if callable(getattr(sub, "dense_chunks", None)) and id(sub) not in seen:
                    seen.add(id(sub))
                    found[(i, name)] = sub
    return found


def _clones(tracers: list[Array], n_inputs: int) -> list[Any]:
    """The traced modules on the traced arrays (after the call's `n_inputs` inputs and the dense
    chunks), the block linears' copies given their chunks (`BlockLinear.dense_rows`)."""
    spec: PrefillSpec = traced_spec()
    dense_end = n_inputs + sum(spec.chunks)
    clones = clone_modules(spec.traced(), spec.group.arrays, tracers[dense_end:])
    copies = block_layers(clones)
    at = n_inputs
    for place, n in zip(spec.places, spec.chunks, strict=True):
        copies[place].__dict__["dense_rows"] = tracers[at:at + n]
        at += n
    return clones


def _project(attn: Any, qkv: Any, x: Array) -> list[Array]:
    """The next layer's projections as a segment returns them: q, k, v [B, heads, L, D] (the model's
    `heads`), or where the plan joins them (`joint_qkv`) the fused product's output [B, L, N] (the
    q, k and v rows; with a tail, q and k, and the tail's v [B, L, Nv] after it), which the runner
    splits into heads outside the trace (`_heads_of`): a slice cannot be re-shaped in it."""
    spec: PrefillSpec = traced_spec()
    if not spec.joint:
        return list(attn.heads(x))
    return [qkv.joint(x)] + ([qkv.tail(x)] if qkv.tail is not None else [])


def _trace_first(inputs: list[Array]) -> list[Array]:
    _embed, norm, attn, qkv = _clones(inputs, 1)
    return _project(attn, qkv, norm(inputs[0]))


def _trace_mid(inputs: list[Array]) -> list[Array]:
    block, _gate_up, norm, attn, qkv = _clones(inputs, 2)
    h = _finish(block, inputs[0], inputs[1])
    return [*_project(attn, qkv, norm(h)), h]


def joint_qkv(attn: Any, qkv: Any) -> bool:
    """Whether the prefill takes a layer's q/k/v as its fused product (`_project`): the fusion joins
    q, k and v (or q and k, v its tail) of the attention's head layout in that order, and the
    attention has no q/k norms (Qwen 3's, which the model's `heads` applies per head)."""
    if qkv is None or attn.qk_norms():
        return False
    d = attn.head_dim
    q, kv = attn.n_heads * d, attn.n_kv_heads * d
    if qkv.tail is not None:
        return qkv.tail is attn.v_proj and tuple(qkv.sizes) == (q, kv)
    return tuple(qkv.sizes) == (q, kv, kv)


def _heads_of(attn: Any, outs: list[Array]) -> tuple[Array, Array]:
    """(q and k heads [B, Hq + Hkv, L, D], v heads [B, Hkv, L, D]) of a segment's joint outputs, as
    views: the q and k heads side by side for one RoPE call."""
    y = outs[0]
    b, length, d, hq, hkv = y.shape[0], y.shape[1], attn.head_dim, attn.n_heads, attn.n_kv_heads
    t = mx.transpose(mx.reshape(y, (b, length, -1, d)), (0, 2, 1, 3))
    if len(outs) == 2:  # v from the tail
        return t, mx.transpose(mx.reshape(outs[1], (b, length, hkv, d)), (0, 2, 1, 3))
    return t[:, :hq + hkv], t[:, hq + hkv:]


def _trace_last(inputs: list[Array]) -> list[Array]:
    (block,) = _clones(inputs, 2)
    return [_finish(block, inputs[0], inputs[1])]


class PrefillFunctions:
    """The three shapeless segments of one model structure, per batch size (a reshape keeps it) and
    per place and chunking of the segment's block layers (a trace holds which inputs they take)."""

    def __init__(self) -> None:
        self._by_key: dict[tuple[Any, ...], tuple[Any, ...]] = {}

    def get(self, b: int, blocks: tuple[Any, ...] = ()) -> tuple[Any, ...]:
        """(first, mid, last) compiled, for batch `b` and the block-layer key `blocks`."""
        key = (b, blocks)
        fns = self._by_key.get(key)
        if fns is None:
            fns = self._by_key[key] = tuple(mx.compile(f, shapeless=True)
                                            for f in (_trace_first, _trace_mid, _trace_last))
        return fns

    def clear(self) -> None:
        for fns in self._by_key.values():
            for fn in fns:
                fn.clear()
        self._by_key.clear()


class PrefillRunner:
    """`runner(tokens, cache, on_layer)`: one chunk [B, L] into the caches (full-attention
    KVCaches, as segments.plan requires); `on_layer(h, cache_i)` after each layer (the threaded
    prefill hands each to the evaluation thread). If a segment fails to trace, the caches are put
    back as they were, `on_fail` is told and CompileUnavailable is raised."""

    def __init__(self, plan: SegmentPlan, blocks: Sequence[Any], fns: PrefillFunctions,
                 on_fail: Callable[[BaseException], None], joint: bool = False, dtype: Any = None) -> None:
        self._plan = plan
        self._blocks = list(blocks)
        self._fns = fns
        self._on_fail = on_fail
        # Per segment: its group, how many of its modules the trace runs, and their block layers.
        self._first = _Segment(plan.first, len(plan.first.modules), False)
        self._mids = [_Segment(group, len(group.modules), True) for group in plan.mids]
        self._last = _Segment(plan.last, 1, True)
        # Per layer: whether its q/k/v come as the fused product (`joint_qkv`), with `joint`.
        self._joint = [joint and joint_qkv(g.modules[-2], g.modules[-1]) for g in (plan.first, *plan.mids)]
        blocks_here = [layer for seg in (self._first, *self._mids, self._last) for layer in seg.blocks]
        # Chunks this short leave the block layers to their matvec kernel, op by op (`takes`).
        self._op_by_op_rows = max((layer.kernel_rows(dtype) for layer in blocks_here), default=0) if dtype else 0

    def takes(self, chunk: Array) -> bool:
        """Whether a chunk of token ids [B, L] runs here: not where its B x L rows are few enough for
        the block layers' matvec kernel, which reads the blocks (here their rows would be
        dequantized whole for every chunk)."""
        return chunk.shape[0] * chunk.shape[1] > self._op_by_op_rows

    def __call__(self, tokens: Array, cache: Sequence[Any], on_layer: Callable[[Array, Any], None] | None = None
                 ) -> Array:
        """The last position's hidden state [B, 1, D] after the last layer (before the final norm),
        lazily: the last layer's attention output and MLP run on that position alone (the caches
        need only its keys and values)."""
        saved = [c.snapshot() for c in cache]  # the caches as they were, should a segment fail to trace
        try:
            with mlx_kernels_only(), nn.shapeless_trace():  # a trace here serves every chunk length
                return self._run(tokens, cache, on_layer)
        except Exception as exc:
            for c, state in zip(cache, saved, strict=True):
                c.restore(state)
            self._on_fail(exc)
            raise CompileUnavailable(str(exc)) from exc

    def _call(self, part: int, segment: _Segment, inputs: list[Array], batch: int, joint: bool = False
              ) -> list[Array]:
        """Segment `part` (0 first, 1 mid, 2 last) on `inputs` (the hidden states h last), its block
        layers' rows dequantized here first, in h's dtype (the kernels allowed: this is outside the
        trace)."""
        dense: list[list[Array]] = []
        if segment.blocks:
            with kernels_again():
                dense = [layer.dense_chunks(inputs[-1].dtype) for layer in segment.blocks]
        chunks = tuple(len(d) for d in dense)
        fn = self._fns.get(batch, (segment.places, chunks, joint))[part]
        spec = PrefillSpec(segment.group, segment.modules, segment.places, chunks, joint)
        return call_traced(fn, spec, [*inputs, *(c for d in dense for c in d)], segment.group.fixed)

    def _run(self, tokens: Array, cache: Sequence[Any], on_layer: Callable[[Array, Any], None] | None) -> Array:
        blocks, batch = self._blocks, tokens.shape[0]
        embed: Any = self._plan.first.modules[0]
        h: Array = embed(tokens)  # the embedding (a quantized table's gather fixes its shape)
        heads = self._call(0, self._first, [h], batch, self._joint[0])
        length = tokens.shape[1]
        for i, block in enumerate(blocks):
            attn, c = block.self_attn, cache[i]
            offset = c.offset
            if self._joint[i]:  # one RoPE call over the q and k heads side by side
                qk, v = _heads_of(attn, heads)
                qk = attn.rope(qk, offset)
                q, k = qk[:, :attn.n_heads], qk[:, attn.n_heads:]
            else:
                q, k, v = heads
                q, k = attn.rope(q, offset), attn.rope(k, offset)
            keys, values = c.update_and_fetch(k, v)
            mask = make_prompt_mask(length, c, None)
            final = i + 1 == len(blocks)
            if final:
                (q, mask), h = last_query(q, mask), h[:, -1:]
            out = attention(q, keys, values, scale=attn.scale, mask=mask)
            if final:
                (h,) = self._call(2, self._last, [out, h], batch)
            else:
                *heads, h = self._call(1, self._mids[i], [out, h], batch, self._joint[i + 1])
            if on_layer is not None:
                on_layer(h, c)
        return h


_HEAD_PROJECTIONS = ("q_proj", "k_proj", "v_proj")  # a Llama-family attention's (`Attention.heads`)


class _Segment:
    """A segment of the plan as the prefill calls it: its group, how many of the group's modules
    its trace runs, and the block layers it takes dense rows for, with their places (segments
    whose block layers sit elsewhere take traces of their own)."""

    def __init__(self, group: SegmentGroup, modules: int, finishes_a_block: bool) -> None:
        self.group, self.modules = group, modules
        # A block the segment finishes (its first module) runs its output projection and MLP only:
        # its q/k/v projections are the segment before's, and not dequantized again here.
        unused = {(0, f"self_attn.{p}") for p in _HEAD_PROJECTIONS} if finishes_a_block else set()
        found = block_layers(group.modules[:modules])
        self.places = tuple(place for place in found if place not in unused)
        self.blocks = [found[place] for place in self.places]


__all__ = ["PrefillFunctions", "PrefillRunner", "PrefillSpec", "block_layers"]

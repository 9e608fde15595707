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
model's forward computes for many rows. Segments that differ in their modules' form (classes, bit
widths, array shapes: a mixed-precision checkpoint's blocks) or their block layers' chunks are traced
apart. Only the traced calls run inside `kernel_choice.mlx_kernels_only()` and
`nn.shapeless_trace()`: the embedding and those dequantizations outside them take pymlxc's kernels.
The segments call the model's own block halves, like the decode's (`Attention.heads` / `output`,
`TransformerBlock.finish`); the tests compare the caches and tokens with the model's own forward.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pymlxc.core as mx
from pymlxc.core import Array

from .. import nn
from ..cache import make_prompt_mask
from ..kernel_choice import mlx_kernels_only
from ..models.base import attention, last_query
from .segments import SegmentGroup, SegmentPlan
from .trace import CompileUnavailable, call_traced, clone_modules
from .trace import spec as traced_spec


def _finish(block: Any, attn_out: Array, h: Array) -> Array:
    """The block's output after its attention (the block's own `finish`)."""
    h, mlp_out = block.finish(h, block.self_attn.output(attn_out))
    out: Array = h + mlp_out
    return out


_HEAD_PROJECTIONS = ("q_proj", "k_proj", "v_proj")  # a Llama-family attention's (`Attention.heads`)


@dataclass(frozen=True)
class PrefillSpec:
    """A segment of the plan as the prefill calls it, and what its trace reads (`trace.spec()`): the
    decode plan's group, how many of its modules the trace runs (the last segment: the last block
    alone), and the block layers it takes dense rows for, with their places (module index, path
    within it) and each one's row chunks. `traces`: which of `PrefillFunctions`' traces it takes
    (segments that differ in their form or their chunks take traces of their own)."""

    group: SegmentGroup
    modules: int
    places: tuple[tuple[int, str], ...]
    chunks: tuple[int, ...]
    blocks: tuple[Any, ...] = field(compare=False)
    traces: int = 0

    @classmethod
    def of(cls, group: SegmentGroup, modules: int, finishes_a_block: bool, fns: PrefillFunctions) -> PrefillSpec:
        # A block the segment finishes (its first module) runs its output projection and MLP only:
        # its q/k/v projections are the segment before's, and not dequantized again here.
        unused = {(0, f"self_attn.{p}") for p in _HEAD_PROJECTIONS} if finishes_a_block else set()
        found = block_layers(group.modules[:modules])
        places = tuple(place for place in found if place not in unused)
        blocks = tuple(found[place] for place in places)
        chunks = tuple(len(layer.row_chunks()) for layer in blocks)
        # The places follow from the form (the modules' classes) and the segment's role.
        key = (finishes_a_block, chunks, _form(group.modules[:modules], group.arrays))
        return cls(group, modules, places, chunks, blocks, fns.traces_for(key))

    def traced(self) -> list[Any]:
        """The modules the trace runs."""
        return list(self.group.modules[:self.modules])


def _form(modules: Sequence[Any], arrays: Sequence[Array]) -> tuple[Any, ...]:
    """What a shapeless trace of `modules` fixes beyond the chunk's length: their classes and
    quantization (a mixed-precision checkpoint's 6-bit value projection beside 4-bit ones) and the
    shapes of their arrays. Segments that differ in it must not share a trace, which would take any
    shapes and multiply one layer's packed weights as another's."""
    classes = tuple((i, name, type(sub).__name__, getattr(sub, "bits", None), getattr(sub, "group_size", None))
                    for i, module in enumerate(modules) if module is not None
                    for name, sub in module.named_modules())
    return classes, tuple((tuple(a.shape), str(a.dtype)) for a in arrays)


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


def _trace_first(inputs: list[Array]) -> list[Array]:
    _embed, norm, attn, _qkv = _clones(inputs, 1)
    return list(attn.heads(norm(inputs[0])))


def _trace_mid(inputs: list[Array]) -> list[Array]:
    block, _gate_up, norm, attn, _qkv = _clones(inputs, 2)
    h = _finish(block, inputs[0], inputs[1])
    return [*attn.heads(norm(h)), h]


def _trace_last(inputs: list[Array]) -> list[Array]:
    (block,) = _clones(inputs, 2)
    return [_finish(block, inputs[0], inputs[1])]


class PrefillFunctions:
    """The three shapeless segments of one model structure, per batch size (a reshape keeps it) and
    per place and chunking of the segment's block layers (a trace holds which inputs they take)."""

    def __init__(self) -> None:
        self._by_key: dict[tuple[int, int], tuple[Any, ...]] = {}
        self._traces: dict[tuple[Any, ...], int] = {}

    def traces_for(self, key: tuple[Any, ...]) -> int:
        """A small number for a segment's key (its form and chunks), the same for equal keys: hashed
        once, when a runner is made, not in every call (a key holds every array's shape)."""
        return self._traces.setdefault(key, len(self._traces))

    def get(self, b: int, traces: int) -> tuple[Any, ...]:
        """(first, mid, last) compiled, for batch `b` and a segment's `PrefillSpec.traces`."""
        fns = self._by_key.get((b, traces))
        if fns is None:
            fns = self._by_key[(b, traces)] = tuple(mx.compile(f, shapeless=True)
                                                    for f in (_trace_first, _trace_mid, _trace_last))
        return fns

    def clear(self) -> None:
        for fns in self._by_key.values():
            for fn in fns:
                fn.clear()
        self._by_key.clear()  # the numbers stay: runners made before hold them


def op_by_op_from(model: Any) -> int:
    """Rows of x from which a chunk goes op by op because the model's quantized layers take it as
    dense products (nn.mark_dense_products) or, in large blocks, through the tensor-core kernel
    (nn.mark_qmm_products): the shapeless trace can hold neither. 0: none."""
    rows = [r for r in (getattr(model, "dense_rows", 0), getattr(model, "qmm_rows", 0)) if r]
    return min(rows) if rows else 0


class PrefillRunner:
    """`runner(tokens, cache, on_layer)`: one chunk [B, L] into the caches (full-attention
    KVCaches, as segments.plan requires); `on_layer(h, cache_i)` after each layer (the threaded
    prefill hands each to the evaluation thread). If a segment fails to trace, the caches are put
    back as they were, `on_fail` is told and CompileUnavailable is raised. `takes(chunk)` says
    which chunks it runs: the others go through the model's forward, op by op."""

    def __init__(self, plan: SegmentPlan, blocks: Sequence[Any], fns: PrefillFunctions,
                 on_fail: Callable[[BaseException], None], dtype: Any = None, many_rows: int = 0) -> None:
        self._plan = plan
        self._blocks = list(blocks)
        self._made_for = (dtype, many_rows)
        self._fns = fns
        self._on_fail = on_fail
        self._first = PrefillSpec.of(plan.first, len(plan.first.modules), False, fns)
        self._mids = [PrefillSpec.of(group, len(group.modules), True, fns) for group in plan.mids]
        self._last = PrefillSpec.of(plan.last, 1, True, fns)
        # Chunks of at most this many rows leave the block layers to their matvec kernel, which
        # reads the blocks (here their rows would be dequantized whole for every chunk); chunks of
        # `many_rows` (`op_by_op_from`) or more go op by op too.
        layers = [layer for spec in (self._first, *self._mids, self._last) for layer in spec.blocks]
        self._few_rows = max((layer.kernel_rows(dtype) for layer in layers), default=0) if dtype else 0
        self._many_rows = many_rows

    def serves(self, plan: SegmentPlan, dtype: Any, many_rows: int) -> bool:
        """Whether this runner is the one `plan` and the model's compute dtype and row threshold
        would make (a decoder keeps one per plan, its specs made once)."""
        return plan is self._plan and self._made_for == (dtype, many_rows)

    def takes(self, chunk: Array) -> bool:
        """Whether a chunk of token ids [B, L] runs here (else op by op, see the class)."""
        rows = chunk.shape[0] * chunk.shape[1]
        return rows > self._few_rows and not (self._many_rows and rows >= self._many_rows)

    def __call__(self, tokens: Array, cache: Sequence[Any], on_layer: Callable[[Array, Any], None] | None = None
                 ) -> Array:
        """The last position's hidden state [B, 1, D] after the last layer (before the final norm),
        lazily: the last layer's attention output and MLP run on that position alone (the caches
        need only its keys and values)."""
        saved = [c.snapshot() for c in cache]  # the caches as they were, should a segment fail to trace
        try:
            return self._run(tokens, cache, on_layer)
        except Exception as exc:
            for c, state in zip(cache, saved, strict=True):
                c.restore(state)
            self._on_fail(exc)
            raise CompileUnavailable(str(exc)) from exc

    def _call(self, part: int, spec: PrefillSpec, inputs: list[Array], batch: int) -> list[Array]:
        """Segment `part` (0 first, 1 mid, 2 last) on `inputs` (the hidden states h last), its block
        layers' rows dequantized first, in h's dtype, outside the trace."""
        dense = [c for layer in spec.blocks for c in layer.dense_chunks(inputs[-1].dtype)]
        with mlx_kernels_only(), nn.shapeless_trace():  # what a trace builds: one trace serves every length
            return call_traced(self._fns.get(batch, spec.traces)[part], spec, [*inputs, *dense], spec.group.fixed)

    def _run(self, tokens: Array, cache: Sequence[Any], on_layer: Callable[[Array, Any], None] | None) -> Array:
        blocks, batch = self._blocks, tokens.shape[0]
        embed: Any = self._plan.first.modules[0]
        h: Array = embed(tokens)  # the embedding (a quantized table's gather fixes its shape)
        q, k, v = self._call(0, self._first, [h], batch)
        length = tokens.shape[1]
        for i, block in enumerate(blocks):
            attn, c = block.self_attn, cache[i]
            offset = c.offset
            q, k = attn.rope(q, offset), attn.rope(k, offset)
            mask = make_prompt_mask(length, c, None)  # before the update, as the model's forward: a
            # rotating cache's mask depends on what it held (after, it no longer fit the keys)
            keys, values = c.update_and_fetch(k, v)
            final = i + 1 == len(blocks)
            if final:
                (q, mask), h = last_query(q, mask), h[:, -1:]
            out = attention(q, keys, values, scale=attn.scale, mask=mask)
            if final:
                (h,) = self._call(2, self._last, [out, h], batch)
            else:
                q, k, v, h = self._call(1, self._mids[i], [out, h], batch)
            if on_layer is not None:
                on_layer(h, c)
        return h


__all__ = ["PrefillFunctions", "PrefillRunner", "PrefillSpec", "block_layers", "op_by_op_from"]

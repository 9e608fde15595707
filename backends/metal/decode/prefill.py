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

A prompt's first chunk, when it comes again at a length seen before (`WholePrompts`), runs as one
trace of fixed shapes instead: the embedding and every layer, RoPE, the cache writes and the
attention included, on copies of the empty caches, whose buffers come back. Built op by op, the
segments above still cost Python about 180 us a layer (an H100's 1B prefill of 128 tokens: 2.9 ms of
Python, 6.4 ms of MLX's own encoding; docs/performance.md); a replay of one trace costs Python one
call. Its shapes fix the length (and the caches' first allocation), so a length is traced on its
second prefill, not its first: a prompt of a length that never comes again pays no trace.
"""
from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pymlxc.core as mx
from pymlxc.core import Array
from pymlxc.core.transforms import FixedArrays

from .. import nn
from ..cache import KVCache, make_prompt_mask
from ..kernel_choice import mlx_kernels_only
from ..models.base import attention, last_query
from .segments import SegmentGroup, SegmentPlan
from .trace import CompileUnavailable, call_traced, clone_modules
from .trace import spec as traced_spec

log = logging.getLogger(__name__)

# Fresh prompt chunks of up to this many rows (batch x length) may run as one fixed-shape trace; the
# longer ones are bound by the device, where a trace saves nothing (and each holds a graph).
WHOLE_PROMPT_ROWS = 512
WHOLE_PROMPT_TRACES = 8  # traces kept per model, the least recently used dropped first


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


@dataclass(frozen=True)
class WholeSpec:
    """What the whole-prompt trace reads: the embedding and the blocks, their arrays (the call's
    fixed inputs, after the token ids) and empty caches to copy (their first allocation's size)."""

    modules: list[Any]
    arrays: list[Array]
    caches: list[Any]


def _trace_whole(inputs: list[Array]) -> list[Array]:
    spec: WholeSpec = traced_spec()
    tokens = inputs[0]
    embed, *blocks = clone_modules(spec.modules, spec.arrays, inputs[1:])
    caches = [c.copy() for c in spec.caches]
    h = embed(tokens)
    last = len(blocks) - 1
    for i, (block, c) in enumerate(zip(blocks, caches, strict=True)):
        # The model's own blocks, as its forward runs them (the last on its last position alone).
        h = block(h, make_prompt_mask(tokens.shape[1], c, None), c, i == last)
    return [h, *(a for c in caches for a in c.state)]


class WholePrompts:
    """The whole-prompt traces of one runner (see the module's doc), one per batch size, length
    and first allocation of the caches, from the second prefill of that key on (`seen`: the keys
    prefilled before, which a decoder's runners share: a new plan's runner still knows them); at
    most WHOLE_PROMPT_TRACES are kept. `close()` drops them and the arrays' handles."""

    def __init__(self, modules: list[Any], seen: collections.OrderedDict[tuple[int, ...], None] | None = None
                 ) -> None:
        self._modules = modules
        self._arrays: list[Array] | None = None
        self._fixed: FixedArrays | None = None
        self._seen = collections.OrderedDict() if seen is None else seen
        self._traces: collections.OrderedDict[tuple[int, ...], Any] = collections.OrderedDict()
        self.failed = False

    @staticmethod
    def applies(tokens: Array, cache: Sequence[Any]) -> bool:
        """Whether a chunk [B, L] into `cache` is a fresh prompt this path takes: every cache an
        empty KVCache, at most WHOLE_PROMPT_ROWS rows, more than one position."""
        rows = tokens.shape[0] * tokens.shape[1]
        return (tokens.shape[1] > 1 and rows <= WHOLE_PROMPT_ROWS
                and all(type(c) is KVCache and c.keys is None and c.offset == 0 for c in cache))

    def get(self, tokens: Array, cache: Sequence[Any]) -> Any | None:
        """The compiled trace for this chunk, or None on a key's first prefill (then noted)."""
        key = (*tokens.shape, *(c.step for c in cache))
        fn = self._traces.get(key)
        if fn is not None:
            self._traces.move_to_end(key)
            return fn
        if key not in self._seen:
            self._seen[key] = None
            while len(self._seen) > 8 * WHOLE_PROMPT_TRACES:
                self._seen.popitem(last=False)
            return None
        fn = self._traces[key] = mx.compile(_trace_whole)
        while len(self._traces) > WHOLE_PROMPT_TRACES:  # the least recently used trace goes
            self._traces.popitem(last=False)[1].clear()
        return fn

    def run(self, fn: Any, tokens: Array, cache: Sequence[Any]) -> Array:
        """The last position's hidden state [B, 1, D]; the caches take the trace's buffers."""
        if self._fixed is None:
            self._arrays = _distinct_arrays(self._modules)
            self._fixed = FixedArrays(self._arrays)
        assert self._arrays is not None
        with mlx_kernels_only():  # as the segments: MLX's kernels, which every device has
            h, *state = call_traced(fn, WholeSpec(self._modules, self._arrays, list(cache)), [tokens], self._fixed)
        length = tokens.shape[1]
        for i, c in enumerate(cache):
            c.take_first_update(state[2 * i], state[2 * i + 1], length)
        return h

    def close(self) -> None:
        for fn in self._traces.values():
            fn.clear()
        self._traces.clear()
        if self._fixed is not None:
            self._fixed.release()
        self._fixed = self._arrays = None


def _distinct_arrays(modules: Sequence[Any]) -> list[Array]:
    """The arrays of `modules`, each once, in the order the modules hold them."""
    out: list[Array] = []
    seen: set[int] = set()
    for m in modules:
        for a in nn.arrays_of(m):
            if id(a) not in seen:
                seen.add(id(a))
                out.append(a)
    return out


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
                 on_fail: Callable[[BaseException], None], dtype: Any = None, many_rows: int = 0,
                 seen: collections.OrderedDict[tuple[int, ...], None] | None = None) -> None:
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
        # Whole-prompt traces where no GGUF block layer is among the blocks: the trace would
        # dequantize their rows with MLX's ops in every call (the segments take them dense, above).
        self._whole = None if layers else WholePrompts([plan.first.modules[0], *self._blocks], seen)

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
        whole = self._whole
        if whole is not None and not whole.failed and whole.applies(tokens, cache):
            fn = whole.get(tokens, cache)
            if fn is not None:
                try:
                    h = whole.run(fn, tokens, cache)
                except Exception as exc:  # noqa: BLE001 - any trace failure: the segments take it
                    for c, state in zip(cache, saved, strict=True):
                        c.restore(state)
                    whole.failed = True
                    log.warning("whole-prompt prefill trace is not available for this model (%s: %s); "
                                "using the compiled segments", type(exc).__name__, exc)
                else:
                    if on_layer is not None:
                        on_layer(h, cache[-1])  # one graph: handed over once, with the last layer's cache
                    return h
        try:
            return self._run(tokens, cache, on_layer)
        except Exception as exc:
            for c, state in zip(cache, saved, strict=True):
                c.restore(state)
            self._on_fail(exc)
            raise CompileUnavailable(str(exc)) from exc

    def close(self) -> None:
        """Drop the whole-prompt traces and their handles on the model's arrays."""
        if self._whole is not None:
            self._whole.close()

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


__all__ = ["PrefillFunctions", "PrefillRunner", "PrefillSpec", "WholePrompts", "block_layers", "op_by_op_from"]

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
same reason a dense layer adds its bias after the matmul (`nn.shapeless_trace`), and the fused
dense products of the decode's plan (`segments.fuse`; `DENSE_ONLY`) are split without slices: the q/k/v product leaves
the trace as one array of joint heads [B, q + k + v heads, L, D], which the runner slices on the
head axis outside it (views; one RoPE turns the q and k heads together where no q/k norm comes
between), and the gate/up product [.., 2 * F] is unflattened to [.., 2, F] and reduced,
`prod(where([gate, up], silu(y), y))` over the pair: silu(gate) * up with the same roundings (a
product of two 2-byte floats is exact in float32). Three matmuls and a RoPE a layer fewer; on a GPU
each cost MLX more host time than the views and the reduction that replace them (`fused=False`,
`PYMLXC_PREFILL_FUSED_PRODUCTS=0`: the separate products, on the views of the fused weights). Where
a model's quantized blocks are large (`PYMLXC_PREFILL_DEQUANTIZED`, `nn.DEQUANTIZED_MIN_BLOCK_BYTES`)
its quantized products run as a dequantization of the weight and a dense matmul
(`nn.dequantized_products`), the fused ones too: the device's time, not the host's, bounds a large
model's short prefill, and MLX's quantized matmul of many rows reads its weights slowly. With
`PYMLXC_PREFILL_DEQUANTIZE_KERNEL` (`outside`) the Llama family's products (by name:
`_product_weights`) take weights dequantized before each segment call by pymlxc's kernel
(`kernels/dequantize.py`, about three times MLX's `dequantize` rate) and handed in as inputs, which
the layers' copies in the trace multiply (`nn.given_dense_product`). A GGUF
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

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pymlxc.core as mx
from pymlxc.core import Array

from .. import nn
from ..cache import make_prompt_mask
from ..kernel_choice import dequantize_kernel_takes, dequantized_weights, mlx_kernels_only
from ..models import llama
from ..models.base import attention, last_query
from .segments import FusedProjection, SegmentGroup, SegmentPlan
from .trace import CompileUnavailable, call_traced, clone_modules
from .trace import spec as traced_spec

# The fused products serve dense layers only. On an H200 (`probe_prefill.py --fused-ab`, runs
# interleaved in one process) Llama-3.2-1B's 128-token prefill took less time with them in bfloat16
# in 6 of 7 rounds (medians 6.12-10.16 ms against 6.24-11.29), and more at MLX 4-bit (group 64) in
# each of 3 rounds (10.10-10.40 against 9.47-9.91 ms). False: quantized fusions too (the tests).
DENSE_ONLY = True


class SiluPair:
    """A fused [gate; up] product as `llama.MLP` takes it (`silu_product`) in a shapeless trace:
    silu(gate) * up without slicing the product (see the module doc)."""

    def __init__(self, fused: Any) -> None:
        self._fused = fused

    def silu_product(self, x: Array) -> Array:
        y = mx.unflatten(self._fused.joint(x), -1, (2, self._fused.sizes[0]))
        gate = mx.array([[True], [False]])
        return mx.prod(mx.where(gate, nn.silu(y), y), axis=-2)

    def __call__(self, x: Array) -> list[Array]:
        outs: list[Array] = self._fused(x)
        return outs


def pairs_gate_up(block: Any, gate_up: Any, dequantized: bool = False) -> bool:
    """Whether the prefill runs `block`'s MLP on its fused gate/up product as a `SiluPair`: dense or
    `dequantized` (`DENSE_ONLY`), two halves of one width, no tail, and the Llama family's own MLP
    (SiLU) and block."""
    return (gate_up is not None and (gate_up.dense or dequantized or not DENSE_ONLY) and gate_up.tail is None
            and len(gate_up.sizes) == 2 and gate_up.sizes[0] == gate_up.sizes[1] and type(block.mlp) is llama.MLP
            and type(block).finish is llama.TransformerBlock.finish)


def joins_heads(attn: Any, qkv: Any, dequantized: bool = False) -> bool:
    """Whether the prefill runs `attn`'s q/k/v products as the fused product `qkv` (`_heads`): the
    Llama family's own `heads`, dense weights or `dequantized` ones (`DENSE_ONLY`), and q, k (and v,
    unless it is the tail) as the fused widths."""
    if qkv is None or not (qkv.dense or dequantized or not DENSE_ONLY) or type(attn).heads is not llama.Attention.heads:
        return False
    d = attn.head_dim
    want = (attn.n_heads * d, attn.n_kv_heads * d) + (() if qkv.tail is not None else (attn.n_kv_heads * d,))
    return tuple(qkv.sizes) == want


def _heads(attn: Any, qkv: Any, x: Array) -> list[Array]:
    """In a trace: the attention's heads of the normalized `x`: [q, k, v] [B, heads, L, D] through
    `attn.heads`, or with `qkv` the joint heads [B, q + k + v heads, L, D] of its one product (and
    v apart where it is the fusion's tail), which `split_heads` takes apart outside the trace."""
    if qkv is None:
        return list(attn.heads(x))
    b, d = x.shape[0], attn.head_dim
    y = qkv.joint(x)
    outs = [mx.transpose(mx.reshape(y, (b, -1, y.shape[-1] // d, d)), (0, 2, 1, 3))]
    if qkv.tail is not None:  # the clone's own layer (its dense rows), not the fusion's reference to it
        v = attn.v_proj(x)
        outs.append(mx.transpose(mx.reshape(v, (b, -1, attn.n_kv_heads, d)), (0, 2, 1, 3)))
    return outs


def _head_range(heads: Array, start: int, stop: int) -> Array:
    """Heads `start:stop` of [B, heads, L, D] (a view)."""
    b, _, n, d = heads.shape
    return mx.slice(heads, [0, start, 0, 0], [b, stop, n, d], [1, 1, 1, 1])


def split_heads(attn: Any, heads: Sequence[Array], joint: bool) -> tuple[Array, Array, Array, Array | None]:
    """q, k, v [B, heads, L, D] from a segment's `_heads` outputs, and the joint q and k heads where
    one RoPE can turn both (`rope_heads`), else None. With `joint`, q, k and v are views of the
    joint heads (slices on the head axis), q and k after the attention's own normalization (Qwen 3:
    then apart)."""
    if not joint:
        q, k, v = heads
        return q, k, v, None
    jh = heads[0]
    hq, hkv = attn.n_heads, attn.n_kv_heads
    v = heads[1] if len(heads) == 2 else _head_range(jh, hq + hkv, hq + 2 * hkv)
    if attn.qk_norms():
        q, k = attn.normalize_qk(_head_range(jh, 0, hq), _head_range(jh, hq, hq + hkv))
        return q, k, v, None
    return _head_range(jh, 0, hq), _head_range(jh, hq, hq + hkv), v, _head_range(jh, 0, hq + hkv)


def rope_heads(attn: Any, q: Array, k: Array, qk: Array | None, offset: int) -> tuple[Array, Array]:
    """q and k after RoPE at `offset`: one RoPE over the joint heads `qk` where given (RoPE turns
    each head alike, so the same values as two), else one each."""
    if qk is None:
        return attn.rope(q, offset), attn.rope(k, offset)
    turned = attn.rope(qk, offset)
    return _head_range(turned, 0, attn.n_heads), _head_range(turned, attn.n_heads, attn.n_heads + attn.n_kv_heads)


def _finish(block: Any, attn_out: Array, h: Array, gate_up: Any = None) -> Array:
    """The block's output after its attention (the block's own `finish`; with `gate_up`, its MLP
    on that fused product as a `SiluPair`)."""
    h, mlp_out = block.finish(h, block.self_attn.output(attn_out),
                              gate_up=SiluPair(gate_up) if gate_up is not None else None)
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
    joint_heads: bool = False  # the q/k/v heads as the fused product's joint heads (`_heads`)
    pair: bool = False  # the finished block's MLP on its fused gate/up product (`SiluPair`)
    # The quantized products whose weights the runner dequantizes before the trace (`outside`), by
    # place, those modules, and whether pymlxc's kernel takes each (asked once, here).
    weight_places: tuple[tuple[int, str], ...] = ()
    weight_modules: tuple[Any, ...] = field(default=(), compare=False)
    weight_kernels: tuple[bool, ...] = field(default=(), compare=False)

    @classmethod
    def of(cls, group: SegmentGroup, modules: int, finishes_a_block: bool, fns: PrefillFunctions,
           joint_heads: bool = False, pair: bool = False, outside: bool = False) -> PrefillSpec:
        # A block the segment finishes (its first module) runs its output projection and MLP only:
        # its q/k/v projections are the segment before's, and not dequantized again here.
        unused = {(0, f"self_attn.{p}") for p in _HEAD_PROJECTIONS} if finishes_a_block else set()
        found = block_layers(group.modules[:modules])
        places = tuple(place for place in found if place not in unused)
        blocks = tuple(found[place] for place in places)
        chunks = tuple(len(layer.row_chunks()) for layer in blocks)
        weights = _product_weights(group.modules[:modules], finishes_a_block, joint_heads, pair) if outside else {}
        # The places follow from the form (the modules' classes) and the segment's role.
        key = (finishes_a_block, chunks, joint_heads, pair, tuple(weights),
               _form(group.modules[:modules], group.arrays))
        kernels = tuple(dequantize_kernel_takes(*_quantized_weight(m)) for m in weights.values())
        return cls(group, modules, places, chunks, blocks, fns.traces_for(key), joint_heads, pair,
                   tuple(weights), tuple(weights.values()), kernels)

    def dense_weights(self) -> list[Array]:
        """The `weight_modules`' weights dequantized (pymlxc's kernel where it takes them, one
        call for them all), in their order."""
        return dequantized_weights([_quantized_weight(m) for m in self.weight_modules], self.weight_kernels)

    def traced(self) -> list[Any]:
        """The modules the trace runs."""
        return list(self.group.modules[:self.modules])


def _quantized_weight(module: Any) -> tuple[Array, Array, Array, int, int]:
    """(weight, scales, biases, group size, bits) of a quantized linear or fused projection."""
    if isinstance(module, FusedProjection):
        return module.quantized()
    return module.weight, module.scales, module.biases, module.group_size, module.bits


def _module_at(modules: Sequence[Any], place: tuple[int, str]) -> Any:
    """The module at `place` (module index, path within it; "" the module itself), or None."""
    i, path = place
    if i >= len(modules) or modules[i] is None:
        return None
    return dict(modules[i].named_modules()).get(path)


def _product_weights(modules: Sequence[Any], finishes_a_block: bool, joint_heads: bool, pair: bool
                     ) -> dict[tuple[int, str], Any]:
    """The quantized products a segment's trace runs (a Llama-family block's, by their names), by
    place: the finished block's output projection and MLP (gate/up fused with `pair`), the next
    block's q/k/v (fused with `joint_heads`, v apart where it is the fusion's tail). Products of
    other names dequantize inside the trace, as without `outside`."""
    wanted: list[tuple[int, str]] = []
    if finishes_a_block:
        wanted += [(0, "self_attn.o_proj"), (0, "mlp.down_proj")]
        wanted += [(1, "")] if pair else [(0, "mlp.gate_proj"), (0, "mlp.up_proj")]
    attn = 3 if finishes_a_block else 2  # the next block's attention, then its fused q/k/v
    if len(modules) > attn + 1:
        qkv = modules[attn + 1]
        if joint_heads:
            wanted.append((attn + 1, ""))
            if qkv is not None and qkv.tail is not None:
                wanted.append((attn, "v_proj"))
        else:
            wanted += [(attn, p) for p in _HEAD_PROJECTIONS]
    found = {place: _module_at(modules, place) for place in wanted}
    return {place: m for place, m in found.items()
            if isinstance(m, nn.QuantizedLinear) or (isinstance(m, FusedProjection) and m.quantized_weights)}


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
    dense_end = n_inputs + sum(spec.chunks) + len(spec.weight_places)
    clones = clone_modules(spec.traced(), spec.group.arrays, tracers[dense_end:])
    copies = block_layers(clones)
    at = n_inputs
    for place, n in zip(spec.places, spec.chunks, strict=True):
        copies[place].__dict__["dense_rows"] = tracers[at:at + n]
        at += n
    for place in spec.weight_places:  # nn.given_dense_product
        _module_at(clones, place).__dict__["dense_weight"] = tracers[at]
        at += 1
    return clones


def _trace_first(inputs: list[Array]) -> list[Array]:
    spec: PrefillSpec = traced_spec()
    _embed, norm, attn, qkv = _clones(inputs, 1)
    return _heads(attn, qkv if spec.joint_heads else None, norm(inputs[0]))


def _trace_mid(inputs: list[Array]) -> list[Array]:
    spec: PrefillSpec = traced_spec()
    block, gate_up, norm, attn, qkv = _clones(inputs, 2)
    h = _finish(block, inputs[0], inputs[1], gate_up if spec.pair else None)
    return [*_heads(attn, qkv if spec.joint_heads else None, norm(h)), h]


def _trace_last(inputs: list[Array]) -> list[Array]:
    spec: PrefillSpec = traced_spec()
    block, gate_up = _clones(inputs, 2)
    return [_finish(block, inputs[0], inputs[1], gate_up if spec.pair else None)]


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
                 fused: bool = True, dequantized: bool = False, outside: bool = False,
                 copy_bytes: int = 0) -> None:
        """`fused`: run the plan's fused q/k/v and gate/up products as one matmul each (module doc).
        `dequantized`: quantized products as a dequantization and a dense matmul each
        (`nn.dequantized_products`), fused ones too, with `outside` the Llama family's weights
        dequantized before each segment (`kernels/dequantize.py` on CUDA) and handed to the trace;
        a block's copies then take `copy_bytes` (`nn.dequantized_block_bytes`)."""
        self._plan = plan
        self._blocks = list(blocks)
        self._made_for = (dtype, many_rows, fused, dequantized, outside)
        self._dequantized = dequantized
        self._copy_bytes = copy_bytes if dequantized else 0
        self._fns = fns
        self._on_fail = on_fail
        # The groups' modules: first [embed, norm, attn, qkv], a mid [block, gate_up, norm, attn, qkv],
        # last [block, gate_up, ...] (segments.SegmentPlan).
        first, mids, last = plan.first.modules, [g.modules for g in plan.mids], plan.last.modules
        dq, out = dequantized, dequantized and outside
        self._first = PrefillSpec.of(plan.first, len(first), False, fns,
                                     joint_heads=fused and joins_heads(first[2], first[3], dq), outside=out)
        self._mids = [PrefillSpec.of(group, len(m), True, fns, joint_heads=fused and joins_heads(m[3], m[4], dq),
                                     pair=fused and pairs_gate_up(m[0], m[1], dq), outside=out)
                      for group, m in zip(plan.mids, mids, strict=True)]
        self._last = PrefillSpec.of(plan.last, 2, True, fns, pair=fused and pairs_gate_up(last[0], last[1], dq),
                                    outside=out)
        # Chunks of at most this many rows leave the block layers to their matvec kernel, which
        # reads the blocks (here their rows would be dequantized whole for every chunk); chunks of
        # `many_rows` (`op_by_op_from`) or more go op by op too.
        layers = [layer for spec in (self._first, *self._mids, self._last) for layer in spec.blocks]
        self._few_rows = max((layer.kernel_rows(dtype) for layer in layers), default=0) if dtype else 0
        self._many_rows = many_rows

    @property
    def dequantized(self) -> bool:
        """Whether the quantized products run dequantized for dense matmuls (`nn.dequantized_products`)."""
        return self._dequantized

    @property
    def dense_block_bytes(self) -> int:
        """The dequantized copies a block's products hold until the device has run it (0: none)."""
        return self._copy_bytes

    @property
    def specs(self) -> list[PrefillSpec]:
        """The segments as the runner calls them: the first, the middle ones, the last."""
        return [self._first, *self._mids, self._last]

    def serves(self, plan: SegmentPlan, dtype: Any, many_rows: int, fused: bool = True,
               dequantized: bool = False, outside: bool = False) -> bool:
        """Whether this runner is the one `plan` and the model's compute dtype, row threshold,
        `fused`, `dequantized` and `outside` would make (a decoder keeps one per plan, its specs
        made once)."""
        return plan is self._plan and self._made_for == (dtype, many_rows, fused, dequantized, outside)

    def takes(self, chunk: Array) -> bool:
        """Whether a chunk of token ids [B, L] runs here (else op by op, see the class)."""
        return self.takes_rows(chunk.shape[0] * chunk.shape[1])

    def takes_rows(self, rows: int) -> bool:
        """Whether a chunk of `rows` token ids (batch times length) runs here."""
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
        dense = [c for layer in spec.blocks for c in layer.dense_chunks(inputs[-1].dtype)] + spec.dense_weights()
        products = nn.dequantized_products() if self._dequantized else contextlib.nullcontext()
        with mlx_kernels_only(), nn.shapeless_trace(), products:  # what a trace builds: one trace serves every length
            return call_traced(self._fns.get(batch, spec.traces)[part], spec, [*inputs, *dense], spec.group.fixed)

    def _run(self, tokens: Array, cache: Sequence[Any], on_layer: Callable[[Array, Any], None] | None) -> Array:
        blocks, batch = self._blocks, tokens.shape[0]
        embed: Any = self._plan.first.modules[0]
        h: Array = embed(tokens)  # the embedding (a quantized table's gather fixes its shape)
        q, k, v, qk = split_heads(blocks[0].self_attn, self._call(0, self._first, [h], batch),
                                  self._first.joint_heads)
        length = tokens.shape[1]
        for i, block in enumerate(blocks):
            attn, c = block.self_attn, cache[i]
            offset = c.offset
            q, k = rope_heads(attn, q, k, qk, offset)
            mask = make_prompt_mask(length, c, None)  # before the update, as the model's forward: a
            # rotating cache's mask depends on what it held (after, it no longer fit the keys)
            keys, values = c.update_and_fetch(k, v)
            final = i + 1 == len(blocks)
            if final:
                (q, mask), h = last_query(q, mask), h[:, -1:]
            out = attention(q, keys, values, scale=attn.scale, mask=mask, kernel=attn.prefill_kernel)
            if final:
                (h,) = self._call(2, self._last, [out, h], batch)
            else:
                *heads, h = self._call(1, self._mids[i], [out, h], batch)
                q, k, v, qk = split_heads(blocks[i + 1].self_attn, heads, self._mids[i].joint_heads)
            if on_layer is not None:
                on_layer(h, c)
        return h


__all__ = ["PrefillFunctions", "PrefillRunner", "PrefillSpec", "SiluPair", "block_layers", "joins_heads",
           "op_by_op_from", "pairs_gate_up", "rope_heads", "split_heads"]

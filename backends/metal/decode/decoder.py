"""The compiled decode path: one traced graph per model serves every token of a generation.

The uncompiled loop (`generate.make_step`) rebuilds the whole forward pass in Python for each
token: a few hundred binding calls per token, which on a fast device costs more than the device
work of a small model. Here the per-token forward, the KV-cache writes and greedy sampling are
traced once with `mx.compile` and replayed by MLX in C++; Python only hands the previous step's
outputs to the next step.

Shapes must not change from token to token for one trace to serve, so decoding runs on
fixed-size buffers instead of growing caches:

* every layer's keys and values live in a ring of `R` slots, position `p` in slot `p % R`; a
  full-attention layer has `R` > every position written so far (it never wraps: slot = position),
  a sliding-window layer keeps `R = window` slots (mlx-lm's rotating cache holds the same tokens);
* a full-attention layer's buffer starts with room for the prompt and the first token and grows
  as tokens arrive (`rings.Rings`): to the next multiple of BUFFER_STEP at least, doubling, never past
  what `prompt + max_tokens` needs. So the memory of a short generation does not depend on
  `max_tokens`, and a long one traces once per buffer size (log2 of its length in 256-token steps);
* the position is an input array (`pos`), used for RoPE (`fast.rope` with an array offset), for
  the slot written (a scatter at that slot) and for an additive mask over the slots (a slot is
  visible when it holds a position <= pos inside the layer's window);
* the weights are inputs as well, not constants captured by the trace: the compiled graph then
  holds no weight, a LoRA adapter or an update is picked up without a retrace, and closing a
  model frees its memory whatever MLX's (per-thread) compile cache still holds.

Prefill stays uncompiled (a few large chunks: the binding's overhead is amortized there) and
writes into caches whose first allocation is already the decode's first size (`reserve`), so the
buffers pass to the decode without a copy. During decoding the session owns the buffers (so that MLX
writes them in place: an array something else still holds is copied on write); when it ends,
the caches get the rings back in their own layout, so a caller that keeps the caches (a prompt
cache) sees every token.

`CompiledDecoder.start` says None where this path does not apply (batches, explicit masks,
unknown cache types, a context-bounded cache that would evict, a model whose forward cannot be
traced); the caller then uses the uncompiled loop, which gives the same tokens.
`PYMLXC_COMPILE=0` (`Settings.compile`, see pymlxc/settings.py) turns the compiled path off.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import pymlxc.core as mx
from pymlxc.core import Array
from pymlxc.core.transforms import FixedArrays
from pymlxc.settings import Settings
from pymlxc.settings import current as current_settings

from ..cache import KVCache
from ..kernel_choice import check_dequantize_kernel
from ..kernels.check import on_cuda
from ..nn import Module, arrays_of, dequantized_block_bytes, large_quantized_blocks, quantized_layers
from ..recurrent_cache import StepRecurrentCache
from ..sample import (
    DEFAULT_PENALTY_CONTEXT,
    LogitsProcessor,
    Sampler,
    apply_processors,
    greedy,
)
from ..step_queue import StepQueue
from . import graph_fusions, prefill, segments
from .rings import (
    BUFFER_STEP,
    RingLayer,
    Rings,
    decode_capacity,
    first_capacity,
    give_back,
    plan_rings,
    reserve,
    take_buffers,
    unreserve,
)
from .segments import SegmentedSession
from .trace import CompileUnavailable, call_traced, clone_modules
from .trace import spec as traced_spec

log = logging.getLogger(__name__)

DECODE_MODES = ("graph", "segmented")


def _layers_hold_untraceable_blocks(model: Module) -> bool:
    """Whether the transformer layers of `model` (what the compiled prefill traces) have GGUF block
    layers that its trace cannot take (`gguf_layers.holds_untraceable_blocks`: any but BlockLinear,
    whose rows the prefill dequantizes outside the trace), imported here, as it needs the `gguf`
    package (the `gguf` extra), without which no model has them. The embedding and the head run
    outside the trace."""
    try:
        from ..gguf_layers import holds_untraceable_blocks  # noqa: PLC0415
    except ImportError:
        return False
    layers = getattr(model, "layers", None)
    if not isinstance(layers, list):
        return holds_untraceable_blocks(model)
    return any(holds_untraceable_blocks(layer) for layer in layers)


def decode_mode(setting: str = "auto") -> str:
    """How a compiled step is built. "graph": the whole step as one compiled graph over masked
    rings. "segmented" (models whose blocks declare their halves, see segments.py): compiled
    segments around MLX's fused attention on exact-length keys.
    `setting` (PYMLXC_DECODE) decides unless `auto`: then "segmented" on every device. On an H100
    the segments beat the graph in every Llama/Qwen case (MLX's CUDA decode attention takes no mask,
    so the graph's masked attention runs unfused). On a CPU they do less work on both threads:
    the graph attends over its whole masked ring (the decode buffer, up to twice the tokens held)
    where the segments attend over the keys held, and their fused q/k/v and gate/up products are
    fewer calls; for the float32 Llama of hidden 512, intermediate 128, vocabulary 400 (the
    2-core VM of BENCHMARKS.md), MLX's compute thread spent 4.72 ms per token on the graph, 4.00 on
    the segments and 4.40 in mlx-lm (BENCHMARKS.md). Models that segments.plan() does not cover (Gemma, MoE) use the
    graph either way."""
    if setting in DECODE_MODES:
        return setting
    if setting != "auto":
        raise ValueError(f"the decode setting must be auto or one of {', '.join(DECODE_MODES)}, not {setting!r}")
    return "segmented"


# ---------------------------------------------------------------------- caches seen by the traced forward

class RingState(Protocol):
    """What the layers of one traced step share (`RingCache` reads it): each row's position, the
    slot a ring of a given size writes to, and the mask over such a ring."""

    pos: Array

    def slot(self, ring: int) -> Array: ...

    def mask(self, ring: int, window: int | None) -> Array: ...


class _StepState:
    """Per-step values shared by the layers of one traced forward: the position, the slot each
    ring size writes to, and one mask per (ring size, window)."""

    def __init__(self, pos: Array, dtype: Any) -> None:
        self.pos = pos
        self.dtype = dtype
        self._slots: dict[int, Array] = {}
        self._masks: dict[tuple[int, int | None], Array] = {}

    def slot(self, ring: int) -> Array:
        s = self._slots.get(ring)
        if s is None:
            s = mx.reshape(mx.remainder(self.pos, ring), (1,))
            self._slots[ring] = s
        return s

    def mask(self, ring: int, window: int | None) -> Array:
        """Additive mask [ring]: 0 where the slot holds a position <= pos inside the window, -inf
        elsewhere (an empty slot, or one too old for the window)."""
        key = (ring, window)
        m = self._masks.get(key)
        if m is None:
            slots = mx.arange(ring, dtype=mx.int32)
            age = mx.remainder(self.pos - slots + ring, ring)  # pos - (position held by the slot)
            visible = age <= self.pos
            if window is not None and window < ring:
                visible = visible & (age < window)
            m = mx.where(visible, mx.array(0.0, self.dtype), mx.array(float("-inf"), self.dtype))
            self._masks[key] = m
        return m


class RingCache:
    """The `Cache` protocol over one layer's fixed ring, inside the traced forward (one token); the
    compiled batch step (batch_step.py) uses it too, with the batch's column and masks."""

    def __init__(self, keys: Array, values: Array, ring: int, window: int | None, state: RingState) -> None:
        self.keys, self.values = keys, values
        self.ring, self.window = ring, window
        self._state = state
        self.offset = state.pos  # an Array: RoPE takes it as the position

    def update_and_fetch(self, keys: Array, values: Array) -> tuple[Array, Array]:
        # A scatter at the slot: one CUDA kernel per buffer, where a dynamic slice update is two
        # (its offset, then the copy); both write the donated buffer in place.
        slot = self._state.slot(self.ring)
        self.keys = mx.scatter(self.keys, [slot], mx.expand_dims(keys, 0), [2])
        self.values = mx.scatter(self.values, [slot], mx.expand_dims(values, 0), [2])
        return self.keys, self.values

    def make_mask(self, n: int, window_size: int | None = None) -> Array:
        window = self.window
        if window_size is not None:
            window = window_size if window is None else min(window, window_size)
        return self._state.mask(self.ring, window)

    @property
    def state(self) -> tuple[Array, Array]:
        return self.keys, self.values


# ---------------------------------------------------------------------- the decoder

class CompiledDecoder:
    """The compiled one-token forward of one model, traced per structure and buffer shapes.

    `start(...)` turns prefilled caches into a `DecodeSession` (or None where this path does not
    apply). Thread-safe; `close()` drops the traces.
    """

    def __init__(self, model: Module, mode: str | None = None, settings: Settings | None = None) -> None:
        """`mode` ("graph" or "segmented") overrides `settings.decode`; `settings` (else the
        process's, see pymlxc/settings.py) hold the switches below."""
        if mode is not None and mode not in DECODE_MODES:
            raise ValueError(f"decode mode must be one of {', '.join(DECODE_MODES)}, not {mode!r}")
        settings = settings if settings is not None else current_settings()
        self._model: Module | None = model
        self._untraceable_blocks = model is not None and _layers_hold_untraceable_blocks(model)  # no compiled prefill
        self.enabled = settings.compile  # False: every generation takes the uncompiled loop
        self.mode = mode if mode is not None else settings.decode  # "auto": by the device at each generation
        # q/k/v and gate/up as one matmul each (weights fused: segments.py, graph_fusions.py).
        self.fuse_projections = settings.fuse_projections
        # The compiled prefill on those fused weights: one matmul each too (decode/prefill.py).
        self.prefill_fused_products = settings.switch_on("prefill_fused_products", on_cuda())
        # ... and its quantized products as a dequantization and a dense matmul each: `auto` where
        # the blocks are large (nn.large_quantized_blocks), `1` at any size.
        self.prefill_dequantized = settings.switch_on("prefill_dequantized", on_cuda())
        self.prefill_dequantized_any_size = settings.prefill_dequantized == "1"
        # ... the weights dequantized before each segment, by pymlxc's kernel, as the trace's inputs.
        self.prefill_dequantize_kernel = settings.switch_on("prefill_dequantize_kernel", on_cuda())
        # Read once: the prefill asks for a runner every generation.
        self._large_blocks = model is not None and large_quantized_blocks(model)
        dequantizes = model is not None and (self._large_blocks or self.prefill_dequantized_any_size)
        self._block_copy_bytes = dequantized_block_bytes(model) if dequantizes else 0
        if dequantizes and self.prefill_dequantized and self.prefill_dequantize_kernel:
            check_dequantize_kernel(quantized_layers(model))
        # On CUDA: each residual add and the norm after it as one kernel (kernels/add_rms_norm.py).
        self.fused_norm = settings.fused_norm
        # Segmented mode on CUDA: greedy's argmax as two kernels over many blocks (kernels/argmax.py).
        self.cuda_argmax = settings.cuda_argmax
        # Segmented mode on CUDA: each layer's RoPE and key/value writes as one kernel (kernels/rope_kv.py).
        self.cuda_rope_kv = settings.cuda_rope_kv
        # Segmented mode: the whole step as one graph, attention as CUDA kernels (kernels/decode_attention.py).
        self.cuda_decode_attention = settings.cuda_decode_attention
        # Segmented mode on CUDA: each gate/up product and the SiLU product as one kernel (kernels/matvec.py).
        self.cuda_gate_up = settings.cuda_gate_up
        # Segmented mode on CUDA: residual adds and block norms inside the 4-bit products (kernels/matvec.py).
        self.cuda_matvec_fusion = settings.cuda_matvec_fusion
        # Segmented mode on CUDA: RoPE and the key/value writes inside the normalized q/k/v product.
        self.cuda_rope_in_product = settings.cuda_rope_in_product
        self._fusions: dict[int, Any] = {}
        self._plans: dict[tuple[Any, ...], Any] = {}  # segments.SegmentPlan per segmented key
        self._recent_plan: tuple[tuple[Any, ...], tuple[Any, ...]] | None = None  # (signature and flags, key)
        self._lock = threading.Lock()
        self._compiled: dict[tuple[Any, ...], Any] = {}
        # The prefill runner of each plan (its specs walk the plan's modules: made once, not per generation)
        self._runners: dict[tuple[Any, ...], prefill.PrefillRunner] = {}
        self._failed: set[tuple[Any, ...]] = set()
        # How generations went: decoded on the compiled step, or handed to the uncompiled loop.
        self.stats = {"compiled": 0, "fallback": 0, "traces": 0}

    def close(self) -> None:
        with self._lock:
            for fn in self._compiled.values():
                fn.clear()
            self._compiled.clear()
            self._runners.clear()
            self._fusions.clear()
            self._plans.clear()
            self._recent_plan = None
            self._model = None

    # ------------------------------------------------------------------ tracing
    def _function(self, key: tuple[Any, ...], make: Callable[[], Any] | None = None) -> Any:
        with self._lock:
            fn = self._compiled.get(key)
            if fn is None:
                fn = make() if make is not None else mx.compile(_trace_step)
                self._compiled[key] = fn
            return fn

    # ------------------------------------------------------------------ sessions
    def start(self, cache: Sequence[Any], first_position: int, max_tokens: int, *, sampler: Sampler,
              processors: Sequence[LogitsProcessor] = (), history: Array | None = None,
              batch: int = 1, walk: tuple[list[Array], tuple[str, ...]] | None = None
              ) -> DecodeSession | SegmentedSession | None:
        """A session decoding from `first_position` (the position of the first input token) into
        rings made from `cache`, or None where the compiled path does not apply. (A trace records
        the stream its operations run on; MLX keeps one per default stream, so the evaluation
        thread's stream and a caller's own get their traces apart.)"""
        model = self._model
        if model is None or batch != 1 or max_tokens <= 0 or not cache:
            return None
        last_position = first_position + max_tokens - 1
        full = decode_capacity(first_position + 1, max_tokens)
        capacity = first_capacity(first_position + 1, max_tokens)
        if any(type(c) is KVCache and c.keys is not None and c.keys.shape[2] > capacity for c in cache):
            capacity = max(c.keys.shape[2] for c in cache if type(c) is KVCache and c.keys is not None)
        layers = plan_rings(cache, capacity, last_position)
        if layers is None or any(c.offset != first_position for c in cache) or any(c.empty() for c in cache):
            return None
        rings = Rings(layers, capacity, max(full, capacity), last_position)
        weights, classes = walk if walk is not None else arrays_of(model, with_classes=True)
        structure = (classes, len(weights))
        fuse_greedy = sampler is greedy and not processors
        if decode_mode(self.mode) == "segmented" and not processors:
            session = self._segmented(model, structure, weights, fuse_greedy, rings, sampler, first_position)
            if session is not None:
                return session
        graph, weights, classes = self._graph_fusions(model, weights, classes)
        extra = graph.arrays(weights) if graph is not None else []
        traced = (classes, len(weights) + len(extra), graph.key() if graph is not None else None)
        key = (traced, fuse_greedy, rings.key())
        if key in self._failed:
            return None
        spec = _Spec(model, weights + extra, layers, fuse_greedy, self.stats, graph)
        return DecodeSession(self, key, spec, sampler, processors, history, rings)

    def _graph_fusions(self, model: Module, weights: list[Array], classes: tuple[str, ...]
                       ) -> tuple[graph_fusions.GraphFusions | None, list[Array], tuple[str, ...]]:
        """The whole-step graph's fusions for `model` (graph_fusions.py), made or remade, with the
        model's arrays and classes walked again where fusing gave its linears new arrays."""
        with self._lock:
            before = dict(self._fusions)
            graph = graph_fusions.plan(model, self._fusions, self.fuse_projections, self.fused_norm)
            changed = any(before.get(k) is not v for k, v in self._fusions.items())
        if changed:
            weights, classes = arrays_of(model, with_classes=True)
        return graph, weights, classes

    def prepare_weights(self) -> None:
        """Fuse the projections now where the segmented decode will (it swaps the linears' weights
        for views of the fused arrays): a caller that compares weight identities across generations
        (the prompt cache) then sees the final arrays from the first generation on. Without this
        call the first segmented generation fuses them (and the next one rebuilds its plan once)."""
        model: Any = self._model  # its blocks are read where the model declares decode_fusions
        if model is None or not self.fuse_projections:
            return
        blocks = segments.plan(model) if decode_mode(self.mode) == "segmented" else None
        if blocks is None:
            blocks = graph_fusions.blocks_of(model)  # the whole-step graph fuses them
        if blocks is not None:
            with self._lock:
                segments.fusions_for(blocks, self._fusions)

    def _segment_plan(self, model: Module, structure: tuple[Any, ...], weights: list[Array], fuse_greedy: bool
                      ) -> tuple[tuple[Any, ...], Any] | None:
        """(key, segments.SegmentPlan) for the model as it is now, made or reused; None where the
        model is not of the Llama family or its segments failed before. A model whose arrays are
        those of the last segmented generation (the same signature) reuses that generation's plan
        without checking its fusions again."""
        signature = tuple(map(id, weights))
        with self._lock:
            recent = self._recent_plan
            seg_key: tuple[Any, ...] | None
            seg_plan: segments.SegmentPlan | None
            if recent is not None and recent[0] == (signature, fuse_greedy, self.fuse_projections):
                seg_key, seg_plan = recent[1], self._plans.get(recent[1])
            else:
                seg_key, seg_plan = None, None
        if seg_plan is None:
            blocks = segments.plan(model)
            if blocks is None:
                return None
            with self._lock:  # fusing swaps weights for views: once per model (and after updates)
                fusions = segments.fusions_for(blocks, self._fusions) if self.fuse_projections else None
            if fusions is not None and any(q is None or g is None for q, g in fusions):
                fusions = None  # all blocks alike (one trace of the middle segment serves them all)
            fused_norm = segments.use_fused_norm(model, blocks, self.fused_norm)
            argmax = fuse_greedy and segments.use_cuda_argmax(model, self.cuda_argmax)
            rope = segments.use_rope_kv(model, blocks, fusions, self.cuda_rope_kv)
            attention = segments.use_decode_attention(model, blocks, rope, self.cuda_decode_attention)
            pair_silu = segments.use_pair_silu(fusions, self.cuda_gate_up)
            layers = segments.fused_layers(model, blocks, fusions) if fusions else None
            matvec_fusion = segments.use_matvec_fusion(model, blocks, fusions, pair_silu, self.cuda_matvec_fusion,
                                                       layers)
            rope_in_product = segments.use_rope_in_product(model, blocks, fusions, rope, matvec_fusion,
                                                           self.cuda_rope_in_product)
            layers = layers if matvec_fusion else None
            seg_key = ("segmented", structure, fuse_greedy, fusions is not None, fused_norm, argmax, rope is not None,
                       attention, pair_silu, matvec_fusion, rope_in_product, layers)
            if seg_key in self._failed:
                return None
            with self._lock:
                seg_plan = self._plans.get(seg_key)
                if seg_plan is None or seg_plan.signature != signature:
                    self._plans.pop(seg_key, None)  # an old plan's arrays go first
                    seg_plan = segments.SegmentPlan(model, blocks, fuse_greedy, self.stats, fusions, signature,
                                                    fused_norm, argmax, rope, attention, pair_silu, matvec_fusion,
                                                    rope_in_product, layers)
                    self._plans[seg_key] = seg_plan
                self._recent_plan = ((signature, fuse_greedy, self.fuse_projections), seg_key)
        assert seg_key is not None and seg_plan is not None  # found or made together above
        if seg_key in self._failed:
            return None
        return seg_key, seg_plan

    def _segmented(self, model: Module, structure: tuple[Any, ...], weights: list[Array], fuse_greedy: bool,
                   rings: Rings, sampler: Sampler, first_position: int) -> SegmentedSession | None:
        """A segmented session, or None where the model is not of the Llama family or its segments
        failed to trace."""
        found = self._segment_plan(model, structure, weights, fuse_greedy)
        if found is None:
            return None
        seg_key, seg_plan = found
        fns = self._function(seg_key, segments.SegmentFunctions)
        return segments.SegmentedSession(seg_plan, rings, fns, sampler, first_position,
                                         on_fail=lambda exc: self._mark_failed(seg_key, exc))

    def prefill_runner(self, fuse_greedy: bool, walk: tuple[list[Array], tuple[str, ...]] | None = None
                       ) -> prefill.PrefillRunner | None:
        """`run(tokens, cache, on_layer)`: a prefill chunk through shapeless compiled segments (see
        prefill.py), on the plan the segmented decode that follows will use; None where the
        decode is not segmented (or the model not of the Llama family)."""
        model: Any = self._model  # a Llama-family model where a plan is found: it has `layers`
        if model is None or decode_mode(self.mode) != "segmented":
            return None
        weights, classes = walk if walk is not None else arrays_of(model, with_classes=True)
        if self._untraceable_blocks:
            # The trace would fail (and a failed trace on an H200 cost a Q4_K_M file's 128-token
            # prefill 14.0 ms against 9.5 ms op by op).
            return None
        found = self._segment_plan(model, (classes, len(weights)), weights, fuse_greedy)
        if found is None:
            return None
        seg_key, seg_plan = found
        fused = self.prefill_fused_products
        dequantized = self.prefill_dequantized and (self.prefill_dequantized_any_size or self._large_blocks)
        outside = dequantized and self.prefill_dequantize_kernel
        key = ("prefill", *seg_key, fused, dequantized, outside)
        if key in self._failed:
            return None
        dtype, many_rows = getattr(model, "compute_dtype", None), prefill.op_by_op_from(model)
        with self._lock:
            runner = self._runners.get(key)
        if runner is not None and runner.serves(seg_plan, dtype, many_rows, fused, dequantized, outside):
            return runner
        fns = self._function(key, prefill.PrefillFunctions)
        runner = prefill.PrefillRunner(seg_plan, list(model.layers), fns,
                                       on_fail=lambda exc: self._mark_failed(key, exc),
                                       dtype=dtype, many_rows=many_rows, fused=fused, dequantized=dequantized,
                                       outside=outside, copy_bytes=self._block_copy_bytes)
        with self._lock:
            self._runners[key] = runner
        return runner

    def reserve(self, cache: Sequence[Any], prompt_len: int, max_tokens: int) -> None:
        """Call before prefill: size the empty caches' first allocation as the decode's first buffers."""
        if self._model is not None:
            reserve(cache, first_capacity(prompt_len, max_tokens))

    def unreserve(self, cache: Sequence[Any]) -> None:
        """Undo `reserve` (`decode` does it when it ends; a generation that never decodes calls this)."""
        unreserve(cache)

    def decode(self, cache: Sequence[Any], first_inputs: Array, max_tokens: int, *, sampler: Sampler,
               processors: Sequence[LogitsProcessor] = (), history: Array | None = None,
               fallback: Callable[[], Iterator[Array]], queue: StepQueue | None = None,
               walk: tuple[list[Array], tuple[str, ...]] | None = None) -> Iterator[Array]:
        """Yield the sampled ids [B] of up to `max_tokens` steps after the prefilled `cache`, on the
        compiled step where it applies, else from `fallback()` (the uncompiled loop). `queue`: where
        the steps are built and encoded (see step_queue.py). `walk`: `arrays_of(model,
        with_classes=True)` when the caller has it already."""
        queue = queue if queue is not None else StepQueue()
        try:
            session = None
            if max_tokens > 0:
                first_position = cache[0].offset if cache else 0
                session = self.start(cache, first_position, max_tokens, sampler=sampler, processors=processors,
                                     history=history, batch=first_inputs.shape[0], walk=walk)
            if session is not None:
                started = session.decode(first_inputs, max_tokens, queue)
                stream: Iterator[Array] | None = started
                try:
                    first = next(started, None)
                except CompileUnavailable:
                    first, stream = None, None
                if stream is not None:
                    self.stats["compiled"] += 1
                    if first is None:
                        return
                    yield first
                    yield from stream
                    return
            self.stats["fallback"] += 1
            yield from fallback()
        finally:
            unreserve(cache)  # back to the classes' growth steps (see `reserve`)

    def _mark_failed(self, key: tuple[Any, ...], exc: BaseException) -> None:
        what = "compiled prefill" if key and key[0] == "prefill" else "compiled decode"
        log.warning("%s is not available for this model (%s: %s); using the uncompiled path",
                    what, type(exc).__name__, exc)
        with self._lock:
            self._failed.add(key)
            self._plans.pop(key, None)
            self._runners.pop(key, None)
            fn = self._compiled.pop(key, None)
        if fn is not None:
            fn.clear()


@dataclass
class _Spec:
    """What a trace of the step needs; handed to `_trace_step` through `trace.call_traced`."""

    model: Module
    weights: list[Array]
    layers: list[RingLayer]
    fuse_greedy: bool
    stats: dict[str, int]
    graph: graph_fusions.GraphFusions | None = None  # fused parts installed on the trace's copy


def _trace_step(inputs: list[Array]) -> list[Array]:
    """The function MLX traces: [tokens [B], pos [], k0, v0, k1, v1, ..., *weights] ->
    [next tokens [B] (or logits [B, V]), pos + 1, k0', v0', ...]. It runs on a copy of the model
    whose arrays are the traced inputs. (A module-level function: a closure over the decoder would
    make a reference cycle through the compiled function.)"""
    spec: _Spec = traced_spec()
    spec.stats["traces"] += 1
    n = len(spec.layers)
    tokens, pos = inputs[0], inputs[1]
    buffers = inputs[2:2 + 2 * n]
    weights = inputs[2 + 2 * n:]
    graph = spec.graph
    copies = clone_modules([spec.model, *(graph.modules() if graph is not None else [])], spec.weights, weights)
    model = copies[0]
    if graph is not None:
        graph.install(model, copies[1:])
    state = _StepState(pos, buffers[0].dtype)
    caches = [StepRecurrentCache(buffers[2 * i], buffers[2 * i + 1], pos) if layer.ring == 0
              else RingCache(buffers[2 * i], buffers[2 * i + 1], layer.ring, layer.window, state)
              for i, layer in enumerate(spec.layers)]
    b = tokens.shape[0]
    logits = model(mx.reshape(tokens, (b, 1)), cache=caches)
    logits = mx.reshape(logits, (b, logits.shape[-1]))
    out = greedy(logits) if spec.fuse_greedy else logits
    result = [out, pos + 1]
    for c in caches:
        result += list(c.state)
    return result


class DecodeSession:
    """One generation's decode on the compiled step. `decode(first_inputs, max_tokens)` yields
    the sampled ids [B] like `generate.decode`; the caches get the rings back when it ends."""

    def __init__(self, decoder: CompiledDecoder, key: tuple[Any, ...], spec: _Spec, sampler: Sampler,
                 processors: Sequence[LogitsProcessor], history: Array | None, rings: Rings) -> None:
        self._decoder = decoder
        self._key = key
        self._rings = rings  # rings.layers is spec.layers
        self._spec = spec
        self._sampler = sampler
        self._processors = list(processors)
        self._history = history
        self._buffers: list[Array] = []
        self._steps = 0  # built
        self._first_position = spec.layers[0].cache.offset
        self._fn = decoder._function(key)  # noqa: SLF001
        self._weights = FixedArrays(spec.weights)  # handed to every step without converting them again

    def _call(self, tokens: Array, pos: Array) -> tuple[Array, Array]:
        spec = self._spec
        grown = self._rings.grow_for(self._first_position + self._steps, self._buffers)
        if grown is not None:  # a new buffer size: its own trace (made once per size)
            self._buffers = grown
            self._key = (*self._key[:2], self._rings.key())
            self._fn = self._decoder._function(self._key)  # noqa: SLF001
        out = call_traced(self._fn, spec, [tokens, pos, *self._buffers], self._weights)  # spec: read by _trace_step
        self._buffers = out[2:]
        self._steps += 1
        return out[0], out[1]

    def _sample(self, inputs: Array, out: Array) -> Array:
        if self._spec.fuse_greedy:
            return out
        logits = out
        if self._processors:
            seen = self._history
            seen = inputs if seen is None else mx.concatenate([seen, inputs], axis=1)
            if seen.shape[1] > DEFAULT_PENALTY_CONTEXT:
                seen = seen[:, -DEFAULT_PENALTY_CONTEXT:]
            self._history = seen
            logits = apply_processors(self._processors, seen, logits)
        return self._sampler(logits)

    def decode(self, first_inputs: Array, max_tokens: int, queue: StepQueue) -> Iterator[Array]:
        """Yield up to `max_tokens` sampled id arrays [B], each step queued before the previous
        token is read. The first step traces (once per model, structure and ring sizes); if the
        trace fails, the decoder remembers it and raises, before anything was yielded."""
        spec = self._spec
        self._buffers = take_buffers(spec.layers)  # the session owns them until it gives them back
        b = first_inputs.shape[0]
        queue.hand_over([first_inputs, self._buffers, self._history, spec.weights])  # weights: an update may be lazy
        position: list[Array] = []  # the step's position input, carried from step to step

        def first() -> Array:
            tokens_in = mx.reshape(first_inputs, (b,))
            try:
                out, pos = self._call(tokens_in, mx.array(self._first_position, dtype=mx.int32))
            except Exception as exc:
                self._finish(0)  # the caches get their tokens back as they were, for the fallback
                self._decoder._mark_failed(self._key, exc)  # noqa: SLF001
                raise CompileUnavailable(str(exc)) from exc
            position.append(pos)
            return self._sample(mx.reshape(tokens_in, (b, 1)), out)

        def following(tokens: Array) -> Array:
            out, position[0] = self._call(tokens, position[0])
            return self._sample(mx.reshape(tokens, (b, 1)), out)

        try:
            yield from queue.pipeline(first, following, max_tokens, queue.lookahead)
        finally:
            queue.drain(raise_errors=False)  # the rings go back to the caches: every step scheduled
            self._finish(queue.steps_kept(self._steps))

    def _finish(self, steps: int) -> None:
        """Hand the rings back to the caches, holding the first `steps` steps' inputs."""
        if not self._buffers:
            return
        give_back(self._spec.layers, self._buffers, self._first_position + steps)
        self._buffers = []


__all__ = ["CompiledDecoder", "DecodeSession", "CompileUnavailable", "decode_capacity", "decode_mode", "reserve",
           "BUFFER_STEP"]  # CompileUnavailable, decode_capacity, reserve, BUFFER_STEP: from trace.py, rings.py

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
  as tokens arrive (`_Rings`): to the next multiple of BUFFER_STEP at least, doubling, never past
  what `prompt + max_tokens` needs. So the memory of a short generation does not depend on
  `max_tokens`, and a long one traces once per buffer size (log2 of its length in 256-token steps);
* the position is an input array (`pos`), used for RoPE (`fast.rope` with an array offset), for
  the slot written (`slice_update_dynamic`) and for an additive mask over the slots (a slot is
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

import copy
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

import pymlxc.core as mx
from pymlxc.core import Array
from pymlxc.core.transforms import FixedArrays
from pymlxc.settings import Settings
from pymlxc.settings import current as current_settings

from .cache import KVCache, RotatingKVCache
from .recurrent_cache import RecurrentCache, StepRecurrentCache
from .nn import Module
from .sample import DEFAULT_PENALTY_CONTEXT, LogitsProcessor, Sampler, apply_processors, greedy
from .step_queue import StepQueue

if TYPE_CHECKING:
    from .segments import SegmentedSession

log = logging.getLogger(__name__)

BUFFER_STEP = 256  # decode buffers are sized in steps of this many tokens (mlx-lm's cache step)
# ...plus a few slots, so that a buffer's length is never a multiple of 256. MLX's CUDA backend
# sends one-token attention over a prefix of a buffer whose length is such a multiple to cuDNN
# (`use_cudnn_for_decoding`), which measured 20.8 against 6.7 us per call for its own kernel at 300
# keys, and 36.7 against 23.3 at 2048 (H100, benchmarks/h100/probe).
BUFFER_PAD = 8


DECODE_MODES = ("graph", "segmented")


def decode_mode(setting: str = "auto") -> str:
    """How a compiled step is built. "graph": the whole step as one compiled graph over masked
    rings. "segmented" (models whose blocks declare their halves, see segments.py): compiled
    segments around MLX's fused attention on exact-length keys.
    `setting` (PYMLXC_DECODE) decides unless `auto`: then "segmented" on a GPU, "graph" on a CPU,
    where its lower host cost per token wins. On an H100 the segments beat the graph in every
    Llama/Qwen case (MLX's CUDA decode attention takes no mask, so the graph's masked attention runs
    unfused). Models that segments.plan() does not cover (Gemma, MoE) use the graph either way."""
    if setting in DECODE_MODES:
        return setting
    if setting != "auto":
        raise ValueError(f"the decode setting must be auto or one of {', '.join(DECODE_MODES)}, not {setting!r}")
    return "segmented" if mx.default_device().type == "gpu" else "graph"


def decode_capacity(prompt_len: int, max_tokens: int) -> int:
    """Slots a full-attention layer needs for a generation: rounded up to BUFFER_STEP, plus BUFFER_PAD."""
    need = max(prompt_len + max_tokens, 1)
    return -(-need // BUFFER_STEP) * BUFFER_STEP + BUFFER_PAD


def first_capacity(prompt_len: int, max_tokens: int) -> int:
    """Slots a full-attention layer starts a generation with: the prompt and the first token (all of
    the generation where that is less)."""
    return min(decode_capacity(prompt_len, min(max_tokens, 1)), decode_capacity(prompt_len, max_tokens))


def grown_capacity(capacity: int, needed: int, full: int) -> int:
    """The next buffer size after `capacity` slots, for `needed` slots: twice the size (in
    BUFFER_STEP steps), at least `needed`, at most `full` (what the whole generation needs)."""
    doubled = 2 * (capacity - BUFFER_PAD) + BUFFER_PAD
    return min(full, max(decode_capacity(needed, 0), doubled))


def reserve(cache: Sequence[Any], capacity: int) -> None:
    """Make each empty cache allocate `capacity` slots at its first update (a rotating cache: at
    most its size), so that prefill writes straight into the buffer that decoding starts with (no
    copy). `CompiledDecoder.decode` undoes it when the generation ends."""
    for c in cache:
        if type(c) in (KVCache, RotatingKVCache) and c.keys is None:
            c.step = max(capacity, type(c).step)


def _unreserve(cache: Sequence[Any]) -> None:
    for c in cache:
        if type(c) in (KVCache, RotatingKVCache):
            c.__dict__.pop("step", None)


# ---------------------------------------------------------------------- the module tree as inputs

def _arrays_of(model: Module, with_classes: bool = False) -> Any:
    """Every Array the module tree holds (parameters and private constants), each once, in a fixed
    order for a given tree structure; with `with_classes`, also the module classes in walk order
    (what a trace depends on besides shapes: an attached or fused LoRA adapter changes them).
    (Iterative: recursive closures would make reference cycles that keep the weights alive until a
    garbage collection.)"""
    out: list[Array] = []
    classes: list[str] = []
    seen: set[int] = set()
    stack: list[Any] = [model]
    while stack:
        value = stack.pop()
        if isinstance(value, Array):
            if id(value) not in seen:
                seen.add(id(value))
                out.append(value)
        elif isinstance(value, Module):
            if id(value) not in seen:
                seen.add(id(value))
                classes.append(type(value).__qualname__)
                stack.extend(reversed(list(vars(value).values())))
        elif isinstance(value, (list, tuple)):
            stack.extend(reversed(value))
        elif isinstance(value, dict):
            stack.extend(reversed(list(value.values())))
    return (out, tuple(classes)) if with_classes else out


class _Cloner:
    """Copies a module tree with its Arrays replaced by `substitute[id(array)]`; the model itself
    is untouched (another thread may be running it). Shared modules stay shared."""

    def __init__(self, substitute: dict[int, Array]) -> None:
        self.substitute = substitute
        self.memo: dict[int, Module] = {}

    def swap(self, value: Any) -> Any:
        if isinstance(value, Array):
            return self.substitute.get(id(value), value)
        if isinstance(value, Module):
            return self.clone(value)
        if isinstance(value, list):
            return [self.swap(v) for v in value]
        if isinstance(value, tuple):
            return tuple(self.swap(v) for v in value)
        if isinstance(value, dict) and any(isinstance(v, (Array, Module)) for v in value.values()):
            return {k: self.swap(v) for k, v in value.items()}
        return value

    def clone(self, module: Module) -> Module:
        done = self.memo.get(id(module))
        if done is not None:
            return done
        new = copy.copy(module)
        self.memo[id(module)] = new
        # Set through __dict__: a module's __setattr__ may derive constants from what is set.
        new.__dict__.update({k: self.swap(v) for k, v in vars(module).items()})
        return new


def _clone(model: Module, substitute: dict[int, Array]) -> Module:
    return _Cloner(substitute).clone(model)


# ---------------------------------------------------------------------- caches seen by the traced forward

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


class _RingCache:
    """The `Cache` protocol over one layer's fixed ring, inside the traced forward (one token)."""

    def __init__(self, keys: Array, values: Array, ring: int, window: int | None, state: _StepState) -> None:
        self.keys, self.values = keys, values
        self.ring, self.window = ring, window
        self._state = state
        self.offset = state.pos  # an Array: RoPE takes it as the position

    def update_and_fetch(self, keys: Array, values: Array) -> tuple[Array, Array]:
        slot = self._state.slot(self.ring)
        self.keys = mx.slice_update_dynamic(self.keys, keys, slot, [2])
        self.values = mx.slice_update_dynamic(self.values, values, slot, [2])
        return self.keys, self.values

    def make_mask(self, n: int, window_size: int | None = None) -> Array:
        window = self.window
        if window_size is not None:
            window = window_size if window is None else min(window, window_size)
        return self._state.mask(self.ring, window)

    @property
    def state(self) -> tuple[Array, Array]:
        return self.keys, self.values


# ---------------------------------------------------------------------- rings from and back to caches

@dataclass
class _Layer:
    """How one layer's cache maps to its ring."""

    cache: Any
    ring: int
    window: int | None


def _plan(cache: Sequence[Any], capacity: int, last_position: int) -> list[_Layer] | None:
    """The ring of each layer, or None when a cache is of a kind this path does not handle (or
    would have to evict tokens it must keep)."""
    layers = []
    for c in cache:
        if type(c) is KVCache:
            layers.append(_Layer(c, capacity, None))
        elif type(c) is RotatingKVCache:
            if c.keep and last_position >= c.max_size:
                return None  # a context-bounded cache would evict with sinks kept: not a ring
            ring = min(c.max_size, capacity)
            layers.append(_Layer(c, ring, c.max_size if ring == c.max_size else None))
        elif type(c) is RecurrentCache and c.left_padding is None:
            layers.append(_Layer(c, 0, None))  # ring 0: a fixed-size state, passed whole from step to step
        else:
            return None
    return layers


def _ring_of(layer: _Layer) -> tuple[Array, Array]:
    """The layer's keys and values laid out as its ring (slot = position % ring)."""
    c, ring = layer.cache, layer.ring
    if ring == 0:
        return c.decode_buffers()
    offset = c.offset
    if type(c) is KVCache:
        k, v = c.keys, c.values
        length = k.shape[2]
        if length == ring:
            return k, v
        if length > ring:  # a restored cache with room to spare: keep the filled part
            return _cut(k, ring), _cut(v, ring)
        pad_k = mx.zeros((k.shape[0], k.shape[1], ring - length, k.shape[3]), k.dtype)
        pad_v = mx.zeros((v.shape[0], v.shape[1], ring - length, v.shape[3]), v.dtype)
        return mx.concatenate([k, pad_k], axis=2), mx.concatenate([v, pad_v], axis=2)
    # RotatingKVCache in temporal order, nothing evicted, already `ring` long: that is the ring.
    if c._idx == offset and c._len == ring and offset <= ring:  # noqa: SLF001
        return c.keys, c.values
    # Otherwise pick, for every slot, the buffer entry holding its latest position.
    held = c._slot_positions()  # noqa: SLF001 - the cache's own layout, read-only
    where = {int(p): i for i, p in enumerate(held) if p >= 0}
    index = np.zeros(ring, dtype=np.int32)
    for s in range(ring):
        if s < offset:
            p = s + ring * ((offset - 1 - s) // ring)
            index[s] = where[p]
    k, v = c.keys, c.values
    idx = mx.array(index)
    return mx.take(k, idx, axis=2), mx.take(v, idx, axis=2)


def _cut(a: Array, length: int) -> Array:
    b, h, _, d = a.shape
    return mx.slice(a, [0, 0, 0, 0], [b, h, length, d], [1, 1, 1, 1])


def _give_back(layer: _Layer, keys: Array, values: Array, offset: int) -> None:
    """Put the ring back into the layer's cache, in that cache's own layout, at `offset` tokens."""
    c, ring = layer.cache, layer.ring
    if ring == 0:
        c.take_back(keys, values, offset)
        return
    if type(c) is KVCache:
        c.keys, c.values, c.offset = keys, values, offset
        c._capacity = ring  # noqa: SLF001 - the buffer is a KVCache buffer of `ring` slots
        b, h, _, dk = keys.shape
        c._dims = (b, h, dk, values.shape[3])  # noqa: SLF001
        return
    # RotatingKVCache(keep=0 or never evicted): slot p % ring holds position p, which is its own
    # in-place layout with the write index at offset % ring (or in temporal order until full).
    c.keys, c.values, c.offset = keys, values, offset
    c._len = ring  # noqa: SLF001
    c._idx = offset if offset < ring else offset % ring  # noqa: SLF001
    if hasattr(c, "_set_dims"):
        c._set_dims(keys, values)  # noqa: SLF001


class _Rings:
    """The rings of one decode session, grown as positions arrive (see the module doc). `layers` is
    one list for the session's life: growing replaces its items."""

    def __init__(self, layers: list[_Layer], capacity: int, full: int, last_position: int) -> None:
        self.layers = layers
        self.capacity = capacity  # slots of the layers that grow (full attention)
        self.full = full
        self.last_position = last_position

    def key(self) -> tuple[tuple[int, int | None], ...]:
        return tuple((layer.ring, layer.window) for layer in self.layers)

    def grow_for(self, position: int, buffers: list[Array]) -> list[Array] | None:
        """Where a step at `position` does not fit the growing layers: their buffers grown (a new
        list; zeros after the positions held, which stay at their slots) and `layers` updated.
        None where it fits."""
        if position < self.capacity:
            return None
        capacity = grown_capacity(self.capacity, position + 1, self.full)
        if capacity <= position:
            raise RuntimeError(f"decode position {position} is past the {self.full} slots planned for this generation")
        layers = _plan([layer.cache for layer in self.layers], capacity, self.last_position)
        if layers is None:  # the same caches planned before: cannot happen unless they changed type
            raise RuntimeError("the decode caches changed during the generation")
        out = list(buffers)
        for i, (old, new) in enumerate(zip(self.layers, layers)):
            extra = new.ring - old.ring
            for j in (2 * i, 2 * i + 1) if extra > 0 else ():
                a = out[j]
                b, h, _, d = a.shape
                out[j] = mx.concatenate([a, mx.zeros((b, h, extra, d), a.dtype)], axis=2)
        self.layers[:] = layers
        self.capacity = capacity
        return out


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
        self.enabled = settings.compile  # False: every generation takes the uncompiled loop
        self.mode = mode if mode is not None else settings.decode  # "auto": by the device at each generation
        # Segmented mode: run q/k/v and gate/up as one matmul each (weights fused, see segments.py).
        self.fuse_projections = settings.fuse_projections
        # Segmented mode on CUDA: each residual add and the norm after it as one kernel (cuda_norm.py).
        self.fused_norm = settings.fused_norm
        # Segmented mode on CUDA: greedy's argmax as two kernels over many blocks (cuda_argmax.py).
        self.cuda_argmax = settings.cuda_argmax
        # Segmented mode on CUDA: each layer's RoPE and key/value writes as one kernel (cuda_rope_kv.py).
        self.cuda_rope_kv = settings.cuda_rope_kv
        self._fusions: dict[int, Any] = {}
        self._plans: dict[tuple[Any, ...], Any] = {}  # segments.SegmentPlan per segmented key
        self._recent_plan: tuple[tuple[Any, ...], tuple[Any, ...]] | None = None  # (signature and flags, key)
        self._lock = threading.Lock()
        self._compiled: dict[tuple[Any, ...], Any] = {}
        self._failed: set[tuple[Any, ...]] = set()
        # How generations went: decoded on the compiled step, or handed to the uncompiled loop.
        self.stats = {"compiled": 0, "fallback": 0, "traces": 0}

    def close(self) -> None:
        with self._lock:
            for fn in self._compiled.values():
                fn.clear()
            self._compiled.clear()
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
              ) -> "DecodeSession | SegmentedSession | None":
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
        layers = _plan(cache, capacity, last_position)
        if layers is None or any(c.offset != first_position for c in cache) or any(c.empty() for c in cache):
            return None
        rings = _Rings(layers, capacity, max(full, capacity), last_position)
        weights, classes = walk if walk is not None else _arrays_of(model, with_classes=True)
        structure = (classes, len(weights))
        fuse_greedy = sampler is greedy and not processors
        if decode_mode(self.mode) == "segmented" and not processors:
            session = self._segmented(model, structure, weights, fuse_greedy, rings, sampler, first_position)
            if session is not None:
                return session
        key = (structure, fuse_greedy, rings.key())
        if key in self._failed:
            return None
        spec = _Spec(model, weights, layers, fuse_greedy, self.stats)
        return DecodeSession(self, key, spec, sampler, processors, history, rings)

    def prepare_weights(self) -> None:
        """Fuse the projections now where the segmented decode will (it swaps the linears' weights
        for views of the fused arrays): a caller that compares weight identities across generations
        (the prompt cache) then sees the final arrays from the first generation on. Without this
        call the first segmented generation fuses them (and the next one rebuilds its plan once)."""
        model = self._model
        if model is None or not self.fuse_projections or decode_mode(self.mode) != "segmented":
            return
        from . import segments

        blocks = segments.plan(model)
        if blocks is not None:
            with self._lock:
                segments.fusions_for(blocks, self._fusions)

    def _segment_plan(self, model: Module, structure: tuple[Any, ...], weights: list[Array], fuse_greedy: bool
                      ) -> "tuple[tuple[Any, ...], Any] | None":
        """(key, segments.SegmentPlan) for the model as it is now, made or reused; None where the
        model is not of the Llama family or its segments failed before. A model whose arrays are
        those of the last segmented generation (the same signature) reuses that generation's plan
        without checking its fusions again."""
        from . import segments

        signature = tuple(map(id, weights))
        with self._lock:
            recent = self._recent_plan
            if recent is not None and recent[0] == (signature, fuse_greedy, self.fuse_projections):
                seg_key, seg_plan = recent[1], self._plans.get(recent[1])
            else:
                seg_key = seg_plan = None
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
            seg_key = ("segmented", structure, fuse_greedy, fusions is not None, fused_norm, argmax, rope is not None)
            if seg_key in self._failed:
                return None
            with self._lock:
                seg_plan = self._plans.get(seg_key)
                if seg_plan is None or seg_plan.signature != signature:
                    self._plans.pop(seg_key, None)  # an old plan's arrays go first
                    seg_plan = segments.SegmentPlan(model, blocks, fuse_greedy, self.stats, fusions, signature,
                                                    fused_norm, argmax, rope)
                    self._plans[seg_key] = seg_plan
                self._recent_plan = ((signature, fuse_greedy, self.fuse_projections), seg_key)
        if seg_key in self._failed:
            return None
        return seg_key, seg_plan

    def _segmented(self, model: Module, structure: tuple[Any, ...], weights: list[Array], fuse_greedy: bool,
                   rings: _Rings, sampler: Sampler, first_position: int) -> "SegmentedSession | None":
        """A segmented session, or None where the model is not of the Llama family or its segments
        failed to trace."""
        from . import segments

        found = self._segment_plan(model, structure, weights, fuse_greedy)
        if found is None:
            return None
        seg_key, seg_plan = found
        fns = self._function(seg_key, segments.SegmentFunctions)
        return segments.SegmentedSession(seg_plan, rings, fns, sampler, first_position,
                                         on_fail=lambda exc: self._mark_failed(seg_key, exc))

    def prefill_runner(self, fuse_greedy: bool, walk: tuple[list[Array], tuple[str, ...]] | None = None
                       ) -> "Callable[..., None] | None":
        """`run(tokens, cache, on_layer)`: a prefill chunk through shapeless compiled segments (see
        prefill_segments.py), on the plan the segmented decode that follows will use; None where the
        decode is not segmented (or the model not of the Llama family)."""
        model = self._model
        if model is None or decode_mode(self.mode) != "segmented":
            return None
        from . import prefill_segments

        weights, classes = walk if walk is not None else _arrays_of(model, with_classes=True)
        found = self._segment_plan(model, (classes, len(weights)), weights, fuse_greedy)
        if found is None:
            return None
        seg_key, seg_plan = found
        key = ("prefill", *seg_key)
        if key in self._failed:
            return None
        fns = self._function(key, prefill_segments.PrefillFunctions)
        return prefill_segments.PrefillRunner(seg_plan, list(model.layers), fns,
                                              on_fail=lambda exc: self._mark_failed(key, exc))

    def reserve(self, cache: Sequence[Any], prompt_len: int, max_tokens: int) -> None:
        """Call before prefill: size the empty caches' first allocation as the decode's first buffers."""
        if self._model is not None:
            reserve(cache, first_capacity(prompt_len, max_tokens))

    def unreserve(self, cache: Sequence[Any]) -> None:
        """Undo `reserve` (`decode` does it when it ends; a generation that never decodes calls this)."""
        _unreserve(cache)

    def decode(self, cache: Sequence[Any], first_inputs: Array, max_tokens: int, *, sampler: Sampler,
               processors: Sequence[LogitsProcessor] = (), history: Array | None = None,
               fallback: Callable[[], Iterator[Array]], queue: StepQueue | None = None,
               walk: tuple[list[Array], tuple[str, ...]] | None = None) -> Iterator[Array]:
        """Yield the sampled ids [B] of up to `max_tokens` steps after the prefilled `cache`, on the
        compiled step where it applies, else from `fallback()` (the uncompiled loop). `queue`: where
        the steps are built and encoded (see step_queue.py). `walk`: `_arrays_of(model,
        with_classes=True)` when the caller has it already."""
        queue = queue if queue is not None else StepQueue()
        try:
            session = None
            if max_tokens > 0:
                first_position = cache[0].offset if cache else 0
                session = self.start(cache, first_position, max_tokens, sampler=sampler, processors=processors,
                                     history=history, batch=first_inputs.shape[0], walk=walk)
            if session is not None:
                stream = session.decode(first_inputs, max_tokens, queue)
                try:
                    first = next(stream, None)
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
            _unreserve(cache)  # back to the classes' growth steps (see `reserve`)

    def _mark_failed(self, key: tuple[Any, ...], exc: BaseException) -> None:
        log.warning("compiled decode is not available for this model (%s: %s); using the uncompiled path",
                    type(exc).__name__, exc)
        with self._lock:
            self._failed.add(key)
            self._plans.pop(key, None)
            fn = self._compiled.pop(key, None)
        if fn is not None:
            fn.clear()


@dataclass
class _Spec:
    """What a trace of the step needs; handed to `_trace_step` through `_tracing` by the caller."""

    model: Module
    weights: list[Array]
    layers: list[_Layer]
    fuse_greedy: bool
    stats: dict[str, int]


_tracing = threading.local()


def _trace_step(inputs: list[Array]) -> list[Array]:
    """The function MLX traces: [tokens [B], pos [], k0, v0, k1, v1, ..., *weights] ->
    [next tokens [B] (or logits [B, V]), pos + 1, k0', v0', ...]. It runs on a copy of the model
    whose arrays are the traced inputs. (A module-level function: a closure over the decoder would
    make a reference cycle through the compiled function.)"""
    spec: _Spec = _tracing.spec
    spec.stats["traces"] += 1
    n = len(spec.layers)
    tokens, pos = inputs[0], inputs[1]
    buffers = inputs[2:2 + 2 * n]
    weights = inputs[2 + 2 * n:]
    model = _clone(spec.model, {id(a): t for a, t in zip(spec.weights, weights)})
    state = _StepState(pos, buffers[0].dtype)
    caches = [StepRecurrentCache(buffers[2 * i], buffers[2 * i + 1], pos) if layer.ring == 0
              else _RingCache(buffers[2 * i], buffers[2 * i + 1], layer.ring, layer.window, state)
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
                 processors: Sequence[LogitsProcessor], history: Array | None, rings: _Rings) -> None:
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
        _tracing.spec = spec  # read by _trace_step, if MLX traces now
        try:
            out = self._fn.call_flat([tokens, pos, *self._buffers], self._weights)
        finally:
            _tracing.spec = None
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
        rings = [_ring_of(layer) for layer in spec.layers]
        self._buffers = [a for pair in rings for a in pair]
        del rings
        # The session owns the buffers until it gives them back: a cache still holding them would
        # make every buffer's first write a copy (MLX writes in place only into an array nothing
        # else holds), a second KV cache at the peak.
        for layer in spec.layers:
            if layer.ring == 0:
                layer.cache.release_buffers()
            else:
                layer.cache.keys = layer.cache.values = None
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
        offset = self._first_position + steps
        for i, layer in enumerate(self._spec.layers):
            _give_back(layer, self._buffers[2 * i], self._buffers[2 * i + 1], offset)
        self._buffers = []


class CompileUnavailable(RuntimeError):
    """The model's forward could not be traced; the caller falls back to the uncompiled path."""


__all__ = ["CompiledDecoder", "DecodeSession", "CompileUnavailable", "decode_capacity", "decode_mode", "reserve",
           "BUFFER_STEP"]

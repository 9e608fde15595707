"""The continuous batch's decode step as one compiled graph (`batching.Scheduler`'s step).

Built op by op, a step of the batch costs the binding a few hundred calls and MLX as many graph
nodes, every step, whatever the batch size: on an H100 that host work, not the device, set the
step's time for a 1B model. Here the step is traced once per batch size and buffer size and
replayed: the inputs are the rows' last ids [B, 1], the column written this step, each row's
position (RoPE) and first valid column (one per attention layer where they differ), and every
layer's key/value buffers of the batch
(`BatchKVCache`, [B, H, capacity, D]) or, for a Gated DeltaNet layer, its rows' conv windows and
states (`BatchRecurrentCache`); the outputs are the logits [B, V], the buffers with this step's
column written (a scatter at that column) and the new windows and states. Attention runs over the
whole buffer with a mask made inside the graph (a row sees its valid columns up to this step's,
within a layer's window), so shapes do not change from step to step; the weights are inputs, not
constants the trace keeps. A batch needs one attention layer at least (its columns and positions).

`BatchStep.logits` says None where the step cannot be traced (the caller then builds it op by op,
which gives the same tokens); a structure that failed once is not traced again. It is on by default
on CUDA (`PYMLXC_BATCH_COMPILE`, `Settings.batch_compile`): on an H200 serving Llama-3.2-1B in 4
bits its inter-token latency was 4.0 ms at one client against 6.8 ms op by op, and a server that
warms every batch size up to 16 answered 0.8 s later. Not on a CPU: there it measured no faster
(it attends over the whole buffer).
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

import pymlxc.core as mx
from pymlxc.core import Array
from pymlxc.core.transforms import FixedArrays
from pymlxc.settings import Settings

from ..kernels.check import on_cuda
from ..nn import Module, arrays_of
from ..recurrent_cache import StepRecurrentCache
from .decoder import RingCache
from .trace import call_traced, clone_modules
from .trace import spec as traced_spec

log = logging.getLogger(__name__)


@dataclass
class _Spec:
    """What a trace of the batch step needs; handed to `_trace_batch_step` through `call_traced`."""

    model: Module
    weights: list[Array]
    stats: dict[str, int]


class _BatchState:
    """The `RingState` of one batch step inside the trace: each row's position (RoPE), this step's
    column as the slot of every layer's buffer, and boolean masks [B, 1, 1, capacity]: a row sees
    its valid columns up to this step's, within the layer's window.

    `valid` is each row's first valid column, [B] when every attention layer shares it (a mask per
    window), or [layers, B], one row per attention layer in order (a mask per layer; a sliding
    window layer of a row that joined past its window holds fewer keys than the full layers)."""

    def __init__(self, positions: Array, column: Array, valid: Array, capacity: int) -> None:
        self.pos = positions
        self._column = column
        self._per_layer = valid.ndim == 2
        self._valid = valid
        self._cols = mx.reshape(mx.arange(capacity, dtype=mx.int32), (1, capacity))
        self._by_key: dict[tuple[int | None, int | None], Array] = {}

    def slot(self, ring: int) -> Array:
        return self._column

    def mask(self, ring: int, window: int | None) -> Array:
        """`ring`: the attention layer's index among the batch's attention layers."""
        key = (ring if self._per_layer else None, window)
        m = self._by_key.get(key)
        if m is None:
            valid = self._valid[ring] if self._per_layer else self._valid
            seen = mx.logical_and(self._cols >= mx.reshape(valid, (-1, 1)), self._cols <= self._column)
            if window is not None:
                seen = mx.logical_and(seen, self._cols > self._column - window)
            m = self._by_key[key] = mx.expand_dims(seen, (1, 2))
        return m


def _trace_batch_step(inputs: list[Array]) -> list[Array]:
    """The function MLX traces: [ids [B, 1], column [1], positions [B], first valid columns ([B], or
    [attention layers, B] where the layers differ), a0, b0, a1, b1, ..., *weights] -> [logits [B, V],
    a0', b0', ...], a layer's pair its key/value buffers [B, H, capacity, D] or, for a Gated DeltaNet
    layer, its conv windows [B, K - 1, C] and states [B, Hv, Dv, Dk] (told apart by the first array's
    rank: a conv window has three axes)."""
    spec: _Spec = traced_spec()
    spec.stats["traces"] += 1
    ids, column, positions, valid = inputs[:4]
    n = (len(inputs) - 4 - len(spec.weights)) // 2
    buffers = inputs[4:4 + 2 * n]
    model = clone_modules([spec.model], spec.weights, inputs[4 + 2 * n:])[0]
    pairs = [(buffers[2 * i], buffers[2 * i + 1]) for i in range(n)]
    capacity = next((a.shape[2] for a, _ in pairs if a.ndim == 4), 1)
    state = _BatchState(positions, column, valid, capacity)
    caches: list[Any] = []
    attention = 0  # the ring index of the next attention layer: its row of a per-layer `valid`
    for a, b in pairs:
        if a.ndim == 3:
            caches.append(StepRecurrentCache(a, b, positions))
        else:
            caches.append(RingCache(a, b, attention, None, state))
            attention += 1
    logits = model(ids, cache=caches)
    out = [mx.reshape(logits, (ids.shape[0], logits.shape[-1]))]
    for c in caches:
        out += list(c.state)
    return out


def batch_compile_on(settings: Settings) -> bool:
    """Whether a model loaded with `settings` takes the compiled batch step (`Settings.batch_compile`:
    `auto` on CUDA)."""
    return settings.compile and settings.switch_on("batch_compile", on_cuda())


@dataclass
class _Trace:
    """The compiled function of one model structure, with the arrays it is handed."""

    fn: Any
    spec: _Spec
    fixed: FixedArrays
    structure: tuple[Any, ...]

    def release(self) -> None:
        self.fn.clear()
        self.fixed.release()


class BatchStep:
    """The compiled batch step of one model. Thread-safe; `close()` drops the traces."""

    def __init__(self, model: Module, enabled: bool = True) -> None:
        self._model: Module | None = model
        self.enabled = enabled
        self._trace: _Trace | None = None
        self._version = -1  # the batch version `_trace` was last checked against the model for
        self._failed: set[tuple[Any, ...]] = set()
        self._lock = threading.Lock()
        self.stats = {"compiled": 0, "traces": 0, "fallback": 0}

    def close(self) -> None:
        with self._lock:
            if self._trace is not None:
                self._trace.release()
            self._trace = None
            self._model = None

    def _prepare(self, version: int) -> _Trace | None:
        """The compiled function and the model's arrays as they are now (made again after the
        model's arrays change: an adapter, fused projections), or None where this structure failed.
        The arrays are looked at again only when `version` (the batch's rows) changed."""
        model = self._model
        if model is None:
            return None
        with self._lock:
            if version == self._version and self._trace is not None:
                return self._trace
        weights, classes = arrays_of(model, with_classes=True)
        structure = (classes, tuple(map(id, weights)))
        with self._lock:
            self._version = version
            if structure in self._failed:
                return None
            if self._trace is None or self._trace.structure != structure:
                if self._trace is not None:
                    self._trace.release()
                self._trace = _Trace(mx.compile(_trace_batch_step), _Spec(model, list(weights), self.stats),
                                     FixedArrays(weights), structure)
            return self._trace

    def logits(self, ids: Array, column: Array, positions: Array, valid: Array, buffers: list[Array],
               version: int) -> tuple[Array, list[Array]] | None:
        """(logits [B, V], the buffers after this step) on the compiled step, or None where it does
        not apply (disabled, or the model's forward could not be traced: then logged once).
        `version`: the batch's (`Batch.version`), new whenever its rows changed."""
        if not self.enabled:
            return None
        trace = self._prepare(version)
        if trace is None:
            self.stats["fallback"] += 1
            return None
        try:
            out = call_traced(trace.fn, trace.spec, [ids, column, positions, valid, *buffers], trace.fixed)
        except Exception as exc:  # noqa: BLE001 - the op-by-op step gives the same tokens
            with self._lock:
                self._failed.add(trace.structure)
                if self._trace is trace:
                    trace.release()
                    self._trace = None
            log.warning("the batch decode step could not be compiled (%s); it is built op by op", exc)
            self.stats["fallback"] += 1
            return None
        self.stats["compiled"] += 1
        return out[0], out[1:]


__all__ = ["BatchStep", "batch_compile_on"]

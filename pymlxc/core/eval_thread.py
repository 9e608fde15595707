"""A thread that hands graphs to MLX for its caller, so the caller can build the next one meanwhile.

On a fast device a small model's decode step is bound by host work done twice, one after the other
on one thread: Python builds the step's graph, then MLX encodes it for the device (`async_eval`: on
CUDA every operation becomes a node of a CUDA graph, about 4 µs each on an H100). Measured there,
both halves take about 1 ms per token for a 1B model while the device waits
(docs/performance.md). With an `EvalThread` the encoding of step n runs here while the caller
builds step n+1, so a step costs the longer half instead of the sum.

Rules, both from MLX's threading model:

* Arrays given to `submit` must be built on this thread's stream (`with stream_scope(t.stream)`):
  MLX's GPU streams belong to the thread that made them, and only that thread may encode for them.
* Read a submitted array (`item()`, `tolist()`, numpy) only after its `Ticket.wait()`. Once MLX has
  scheduled an array, reading it only waits for the device; reading it before would make MLX
  evaluate it on the caller's thread.
* Never read an array that a later submission takes as an input: reading clears the array's
  event while this thread may be reading it to encode that submission (a data race that crashed).
  Read a copy made with the step instead (`mx.copy`: it shares the data, not the event).
* Never evaluate, here and there at once, arrays of one graph: before the caller evaluates
  anything that may reach a submitted graph, it waits for every submission so far.

One thread per device serves the whole process (`shared(device)`); submissions run in order.
"""
from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Iterator
from typing import Any

from .. import settings
from ._loader import check, ffi, lib
from .device import Device, Stream, default_stream, stream_scope
from .eval import async_eval

ENV_VAR = settings.variable("eval_thread")


class Ticket:
    """One submission: `wait()` returns once MLX has scheduled its arrays (or raises what failed)."""

    __slots__ = ("_done", "_error")

    def __init__(self) -> None:
        self._done = threading.Event()
        self._error: BaseException | None = None

    def wait(self) -> None:
        self._done.wait()
        if self._error is not None:
            raise self._error

    @property
    def done(self) -> bool:
        return self._done.is_set()


class EvalThread:
    """A daemon thread with its own stream on `device` that runs `async_eval` on what it is given."""

    def __init__(self, device: Device, name: str = "pymlxc-eval") -> None:
        self.device = device
        self._jobs: queue.SimpleQueue[tuple[list[Any], Ticket] | None] = queue.SimpleQueue()
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self.stream: Stream | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._start_error is not None:
            raise self._start_error

    def _run(self) -> None:
        try:
            self.stream = default_stream(self.device)  # this thread's own stream
        except BaseException as exc:  # noqa: BLE001 - handed to the constructor's caller
            self._start_error = exc
            self._ready.set()
            return
        self._ready.set()
        while True:
            job = self._jobs.get()
            if job is None:
                return
            arrays: list[Any] | None
            arrays, ticket = job
            job = None
            try:
                async_eval(arrays)
            except BaseException as exc:  # noqa: BLE001 - re-raised by Ticket.wait on the caller's thread
                ticket._error = exc  # noqa: SLF001
            finally:
                # No reference may outlive the call: MLX writes a buffer in place only when nothing
                # else holds it (the next step's cache update).
                arrays = None
                ticket._done.set()  # noqa: SLF001

    @contextlib.contextmanager
    def building(self) -> Iterator[Stream]:
        """Build on this thread's stream inside the block: pymlxc's operations, and MLX's default
        stream for the calling thread too (some MLX operations place inner operations on the
        thread's default stream rather than the one they were given)."""
        stream = self.stream
        assert stream is not None
        previous = ffi.new("mlx_stream *")
        dev = self.device._new_c()
        try:
            check(lib.mlx_get_default_stream(previous, dev))
        finally:
            lib.mlx_device_free(dev)
        try:
            check(lib.mlx_set_default_stream(stream._c))
            with stream_scope(stream):
                yield stream
        finally:
            lib.mlx_set_default_stream(previous[0])
            lib.mlx_stream_free(previous[0])

    def submit(self, arrays: list[Any]) -> Ticket:
        """Queue `async_eval(arrays)`; the arrays must have been built on `self.stream`."""
        if not self._thread.is_alive():
            raise RuntimeError("the evaluation thread has stopped")
        ticket = Ticket()
        self._jobs.put((list(arrays), ticket))
        return ticket

    def close(self) -> None:
        """Stop after the queued submissions (they are still scheduled)."""
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()


_shared: dict[Device, EvalThread] = {}
_shared_lock = threading.Lock()


def shared(device: Device) -> EvalThread:
    """The process's evaluation thread for `device`, started at first use."""
    with _shared_lock:
        t = _shared.get(device)
        if t is None or not t.alive:
            t = _shared[device] = EvalThread(device, name=f"pymlxc-eval-{device.type}{device.index}")
        return t


def enabled(device: Device, setting: str | None = None) -> bool:
    """Whether generation loops should encode on an EvalThread: `setting` (else the process's
    PYMLXC_EVAL_THREAD, see pymlxc/settings.py) `1`/`0` decides; `auto` means on a GPU (host-bound
    there) and not on a CPU (MLX's CPU evaluation computes on the stream's own thread already, and
    the CPU cores are the compute)."""
    value = settings.current().eval_thread if setting is None else setting
    if value not in settings.SWITCH:
        raise ValueError(f"the eval-thread setting must be one of {', '.join(settings.SWITCH)}, not {value!r}")
    return value == "1" or (value == "auto" and device.type == "gpu")


__all__ = ["EvalThread", "Ticket", "shared", "enabled", "ENV_VAR"]

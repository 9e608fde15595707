"""Devices and streams. MLX streams are thread-local (MLX >= 0.31.2), so each Python thread gets its
own default stream, created lazily on that thread."""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

from ._loader import check, ffi, lib


class Device:
    """A compute device ("cpu" or "gpu") with an index."""

    __slots__ = ("type", "index")

    def __init__(self, type: str = "cpu", index: int = 0) -> None:
        if type not in ("cpu", "gpu"):
            raise ValueError(f"device type must be 'cpu' or 'gpu', not {type!r}")
        self.type = type
        self.index = index

    def __repr__(self) -> str:
        return f"Device({self.type}, {self.index})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Device) and (self.type, self.index) == (other.type, other.index)

    def __hash__(self) -> int:
        return hash((self.type, self.index))

    def _new_c(self) -> Any:
        kind = lib.MLX_CPU if self.type == "cpu" else lib.MLX_GPU
        return lib.mlx_device_new_type(kind, self.index)


cpu = Device("cpu")
gpu = Device("gpu")


class Stream:
    """An MLX stream (owns its handle)."""

    __slots__ = ("_c", "device", "__weakref__")

    def __init__(self, handle: Any, device: Device) -> None:
        self._c = handle
        self.device = device

    def __repr__(self) -> str:
        return f"Stream({self.device})"

    def __del__(self) -> None:
        c = getattr(self, "_c", None)
        if c is not None and lib is not None:
            lib.mlx_stream_free(c)
            self._c = None

    def synchronize(self) -> None:
        check(lib.mlx_synchronize(self._c))


def _device_from_c(dev: Any) -> Device:
    kind = ffi.new("mlx_device_type *")
    index = ffi.new("int *")
    check(lib.mlx_device_get_type(kind, dev))
    check(lib.mlx_device_get_index(index, dev))
    return Device("cpu" if kind[0] == lib.MLX_CPU else "gpu", index[0])


def is_available(device: Device) -> bool:
    dev = device._new_c()
    try:
        ok = ffi.new("bool *")
        check(lib.mlx_device_is_available(ok, dev))
        return bool(ok[0])
    finally:
        lib.mlx_device_free(dev)


def device_count(type: str) -> int:
    count = ffi.new("int *")
    check(lib.mlx_device_count(count, lib.MLX_CPU if type == "cpu" else lib.MLX_GPU))
    return int(count[0])


_state = threading.local()
_default_lock = threading.Lock()
_default_device: list[Device] = []  # set lazily from MLX's own default

# The hot path of every op: this thread's current C stream, cached as `_cache.c`. A thread fills its
# own entry on first use and on leaving a `stream_scope`; `set_default_device` replaces the whole
# object (dropping every thread's entry at once) and tells the listeners (the generated wrappers keep
# it in their globals to read it without a call).
_cache = threading.local()
_cache_listeners: list[Callable[[threading.local], None]] = []


def current_stream() -> Any:
    """The handle (`void *`, for `fast` calls) of this thread's current stream: what an op with
    `stream=None` runs on."""
    try:
        return _cache.c
    except AttributeError:
        c = _cache.c = default_stream()._c.ctx
        return c


def _drop_cache() -> None:
    global _cache
    _cache = threading.local()
    for listener in _cache_listeners:
        listener(_cache)


def default_device() -> Device:
    override: Device | None = getattr(_state, "device", None)
    if override is not None:
        return override
    with _default_lock:
        if not _default_device:
            dev = ffi.new("mlx_device *")
            check(lib.mlx_get_default_device(dev))
            try:
                _default_device.append(_device_from_c(dev[0]))
            finally:
                lib.mlx_device_free(dev[0])
        return _default_device[0]


def set_default_device(device: Device) -> None:
    """Set the process-wide default device; every thread's default stream follows it."""
    if not is_available(device):
        raise ValueError(f"{device} is not available in this MLX build")
    dev = device._new_c()
    try:
        check(lib.mlx_set_default_device(dev))
    finally:
        lib.mlx_device_free(dev)
    with _default_lock:
        _default_device[:] = [device]
    _drop_cache()


def new_stream(device: Device | None = None) -> Stream:
    device = device or default_device()
    dev = device._new_c()
    try:
        return Stream(lib.mlx_stream_new_device(dev), device)
    finally:
        lib.mlx_device_free(dev)


def _thread_stream(device: Device) -> Stream:
    streams: dict[Device, Stream] | None = getattr(_state, "streams", None)
    if streams is None:
        streams = _state.streams = {}
    stream = streams.get(device)
    if stream is None:
        dev = device._new_c()
        try:
            handle = ffi.new("mlx_stream *")
            check(lib.mlx_get_default_stream(handle, dev))
            stream = streams[device] = Stream(handle[0], device)
        finally:
            lib.mlx_device_free(dev)
    return stream


def default_stream(device: Device | None = None) -> Stream:
    """This thread's stream: a `stream_scope` override, else the thread's default for the device."""
    if device is None:
        override: Stream | None = getattr(_state, "stream", None)
        if override is not None:
            return override
    return _thread_stream(device or default_device())


# What a `stream=` argument accepts: a Stream, a Device, "cpu"/"gpu", or None for this thread's stream.
StreamLike = Stream | Device | str | None


def resolve_stream(stream: StreamLike) -> Any:
    """The handle (`void *`, for `fast` calls) for a `stream=` argument: None, a Stream, a Device, or
    "cpu"/"gpu"."""
    if stream is None:
        return current_stream()
    if isinstance(stream, Stream):
        return stream._c.ctx
    if isinstance(stream, str):
        stream = Device(stream)
    if not isinstance(stream, Device):
        raise TypeError(f"stream= takes a Stream, a Device, 'cpu' or 'gpu', not {type(stream).__name__}")
    return default_stream(stream)._c.ctx


@contextlib.contextmanager
def stream_scope(target: Stream | Device | str) -> Iterator[Stream]:
    """Run the ops of this thread inside the block on `target` (a stream, a device, or "cpu"/"gpu")."""
    if isinstance(target, str):
        target = Device(target)
    stream = target if isinstance(target, Stream) else _thread_stream(target)
    previous_stream = getattr(_state, "stream", None)
    previous_device = getattr(_state, "device", None)
    _state.stream, _state.device = stream, stream.device
    _cache.c = stream._c.ctx
    try:
        yield stream
    finally:
        _state.stream, _state.device = previous_stream, previous_device
        with contextlib.suppress(AttributeError):
            del _cache.c  # recomputed on the next op, from the restored scope


def synchronize(stream: Stream | None = None) -> None:
    check(lib.mlx_synchronize((stream or default_stream())._c))

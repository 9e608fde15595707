"""MLX's distributed communication through mlx-c, in the shape of `mlx.core.distributed`.

`init()` joins the processes that `mlx.launch` (or `pymlxc launch`) started into a `Group`; the
collectives (`all_sum`, `all_gather`, `all_max`, `all_min`, `sum_scatter`) and the point-to-point
`send`/`recv`/`recv_like` are lazy ops like any other: the communication happens when their result
is evaluated. `group=None` means the group of the last `init()` (MLX's global group); a process that
was not launched as one of several gets a group of size 1, on which every collective is the
identity. The backend (`ring`, `mpi`, `nccl`, `jaccl`, or `any`) reads its peers from the
environment that the launcher sets (MLX_RANK and MLX_HOSTFILE for the ring).

A lost peer makes the evaluation that waits on it raise `MLXError` (the ring backend says
"connection to a peer was lost").
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from . import dtypes as _dt
from ._gen import arr, int_list
from ._loader import MLXError, error_state, ffi, last_error, lib
from .array import Array, new_handle, release_failed, wrap
from .device import resolve_stream

BACKENDS = ("any", "ring", "mpi", "nccl", "jaccl", "jaccl-ring")

_GROUP_P = ffi.typeof("mlx_distributed_group *")
_STREAM_P = ffi.typeof("mlx_stream *")


def _backend_arg(backend: str) -> Any:
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str, one of {', '.join(BACKENDS)}; not {type(backend).__name__}")
    if backend not in BACKENDS:
        raise ValueError(f"unknown distributed backend {backend!r}; known: {', '.join(BACKENDS)}")
    return backend.encode()


def _error_message() -> str | None:
    """The message MLX's error handler left for this thread since the last call, cleared; None if
    none. (For the mlx-c functions that answer a value, not a status: rank, size, is_available.)"""
    message = getattr(error_state, "message", None)
    if message is None:
        return None
    return last_error()


class Group:
    """A group of processes (MLX's `distributed::Group`): `rank()` of this process in it, `size()`,
    and `split(color, key)` into subgroups. Owns its handle."""

    __slots__ = ("_c", "_rank", "_size", "__weakref__")

    def __init__(self, slot: Any) -> None:
        """Adopt a filled `mlx_distributed_group *` slot (internal: use `init()` or `split()`)."""
        self._c = ffi.gc(slot, lambda p: lib.mlx_distributed_group_free(p[0]) if p[0].ctx != ffi.NULL else None)
        # Rank and size never change for a group: read once (mlx-c answers 0 on an error, so an
        # unset error message after the call is what tells a real 0 from a failure).
        self._rank = self._read(lib.mlx_distributed_group_rank, "rank")
        self._size = self._read(lib.mlx_distributed_group_size, "size")
        if self._size < 1:
            raise MLXError(f"distributed group reports size {self._size}")

    def _read(self, fn: Any, what: str) -> int:
        _error_message()  # drop a stale message of this thread
        value = int(fn(self._c[0]))
        message = _error_message()
        if message is not None:
            raise MLXError(f"cannot read the group's {what}: {message}")
        return value

    @property
    def handle(self) -> Any:
        """The `mlx_distributed_group` struct to pass to mlx-c (valid while the Group lives)."""
        return self._c[0]

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def split(self, color: int, key: int = -1) -> Group:
        """The subgroup of the processes that pass the same `color`, ordered by `key` (-1: by rank).
        Every process of this group must call it. (Not every backend can split: the ring cannot.)"""
        for name, value in (("color", color), ("key", key)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"split: {name} must be an int, not {type(value).__name__}")
        slot = ffi.new(_GROUP_P)
        status = lib.mlx_distributed_group_split(slot, self._c[0], color, key)
        if status:
            if slot[0].ctx != ffi.NULL:
                lib.mlx_distributed_group_free(slot[0])
            raise MLXError(last_error())
        return Group(slot)

    def __repr__(self) -> str:
        return f"Group(rank={self._rank}, size={self._size})"


def is_available(backend: str = "any") -> bool:
    """Whether a distributed backend (`any` of them, or the one named) is compiled into MLX."""
    b = _backend_arg(backend)
    _error_message()
    ok = bool(lib.mlx_distributed_is_available(b))
    message = _error_message()
    if message is not None:
        raise MLXError(f"is_available({backend!r}): {message}")
    return ok


def init(strict: bool = False, backend: str = "any") -> Group:
    """Join the distributed group of the processes launched together and return it. With `strict`,
    failing to join (no launcher environment, a peer that cannot be reached) raises `MLXError`;
    otherwise such a process gets a group of size 1. Calling it again returns the same group."""
    if not isinstance(strict, bool):
        raise TypeError(f"strict must be a bool, not {type(strict).__name__}")
    b = _backend_arg(backend)
    slot = ffi.new(_GROUP_P)
    status = lib.mlx_distributed_init(slot, strict, b)
    if status:
        if slot[0].ctx != ffi.NULL:
            lib.mlx_distributed_group_free(slot[0])
        raise MLXError(f"distributed init (backend {backend!r}, strict={strict}) failed: {last_error()}")
    if slot[0].ctx == ffi.NULL:
        raise MLXError(f"distributed init (backend {backend!r}) returned no group")
    return Group(slot)


# ---------------------------------------------------------------------- ops

def _group_arg(group: Group | None) -> Any:
    if group is None:
        return ffi.new(_GROUP_P)[0]  # null: MLX's global group
    if not isinstance(group, Group):
        raise TypeError(f"group must be a pymlxc.core.distributed.Group or None, not {type(group).__name__}")
    return group.handle


def _stream_arg(stream: Any) -> Any:
    return ffi.new(_STREAM_P, [resolve_stream(stream)])[0]


def _run(name: str, fn: Any, *args: Any) -> Array:
    res = new_handle()
    if fn(res, *args):
        release_failed(res)
        raise MLXError(f"{name}: {last_error()}")
    return wrap(res)


class _Collective(Protocol):
    def __call__(self, x: Any, *, group: Group | None = None, stream: Any = None) -> Array: ...


def _collective(cname: str, doc: str) -> _Collective:
    fn = getattr(lib, f"mlx_distributed_{cname}")

    def op(x: Any, *, group: Group | None = None, stream: Any = None) -> Array:
        a = arr(x)
        return _run(cname, fn, a.handle, _group_arg(group), _stream_arg(stream))

    op.__name__ = op.__qualname__ = cname
    op.__doc__ = doc
    return op


all_sum = _collective("all_sum", "The sum of `x` over every process of the group (each gets the sum).")
all_max = _collective("all_max", "The elementwise maximum of `x` over every process of the group.")
all_min = _collective("all_min", "The elementwise minimum of `x` over every process of the group.")
all_gather = _collective("all_gather", "Every process's `x` concatenated along axis 0, in rank order.")
sum_scatter = _collective(
    "sum_scatter", "The sum over the group of `x`, split along axis 0: process r gets the r-th part.")


def _peer(name: str, value: Any, group: Group | None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int rank, not {type(value).__name__}")
    size = (group if group is not None else init()).size()
    if not 0 <= value < size:
        raise ValueError(f"{name}={value} is not a rank of a group of size {size}")
    return value


def send(x: Any, dst: int, *, group: Group | None = None, stream: Any = None) -> Array:
    """Send `x` to process `dst`; the result (an array like `x`) must be evaluated for the send to
    happen (keep it in the graph, e.g. as what later steps depend on)."""
    a = arr(x)
    return _run("send", lib.mlx_distributed_send, a.handle, _peer("dst", dst, group), _group_arg(group),
                _stream_arg(stream))


def recv(shape: Sequence[int], dtype: Any, src: int, *, group: Group | None = None, stream: Any = None) -> Array:
    """An array of `shape` and `dtype` received from process `src`."""
    c_shape, n = int_list(list(shape))
    return _run("recv", lib.mlx_distributed_recv, c_shape, n, _dt.as_dtype(dtype).value, _peer("src", src, group),
                _group_arg(group), _stream_arg(stream))


def recv_like(x: Any, src: int, *, group: Group | None = None, stream: Any = None) -> Array:
    """An array of `x`'s shape and dtype received from process `src`."""
    a = arr(x)
    return _run("recv_like", lib.mlx_distributed_recv_like, a.handle, _peer("src", src, group), _group_arg(group),
                _stream_arg(stream))


__all__ = ["BACKENDS", "Group", "all_gather", "all_max", "all_min", "all_sum", "init", "is_available", "recv",
           "recv_like", "send", "sum_scatter"]

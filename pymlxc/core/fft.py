"""`mlx.core.fft` (CPU and GPU where MLX supports them)."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from . import _generated as _g
from ._gen import RAW, arr
from .array import Array


class OneAxis(Protocol):
    def __call__(self, a: Any, n: int | None = None, axis: int = -1, norm: str = "backward", *,
                 stream: Any = None) -> Array: ...


class ManyAxes(Protocol):
    def __call__(self, a: Any, s: Sequence[int] | None = None, axes: Sequence[int] | None = ...,
                 norm: str = "backward", *, stream: Any = None) -> Array: ...


def _one(name: str) -> OneAxis:
    fn: Callable[..., Array] = RAW["fft_" + name]

    def f(a: Any, n: int | None = None, axis: int = -1, norm: str = "backward", *, stream: Any = None) -> Array:
        a = arr(a)
        if n is None:
            n = a.shape[axis] if name not in ("irfft",) else 2 * (a.shape[axis] - 1)
        return fn(a, n, axis, norm, stream=stream)

    f.__name__ = name
    return f


def _many(name: str, default_axes: Sequence[int] | None) -> ManyAxes:
    fn: Callable[..., Array] = RAW["fft_" + name]

    def f(a: Any, s: Sequence[int] | None = None, axes: Sequence[int] | None = default_axes, norm: str = "backward",
          *, stream: Any = None) -> Array:
        a = arr(a)
        ax = list(axes) if axes is not None else list(range(a.ndim))
        if s is None:
            s = [a.shape[i] for i in ax]
            if name.startswith("irfft"):
                s[-1] = 2 * (s[-1] - 1)
        return fn(a, list(s), ax, norm, stream=stream)

    f.__name__ = name
    return f


fft, ifft, rfft, irfft = (_one(n) for n in ("fft", "ifft", "rfft", "irfft"))
fft2, ifft2, rfft2, irfft2 = (_many(n, (-2, -1)) for n in ("fft2", "ifft2", "rfft2", "irfft2"))
fftn, ifftn, rfftn, irfftn = (_many(n, None) for n in ("fftn", "ifftn", "rfftn", "irfftn"))


def fftshift(a: Any, axes: Sequence[int] | None = None, *, stream: Any = None) -> Array:
    a = arr(a)
    return _g.fft_fftshift(a, list(axes) if axes is not None else list(range(a.ndim)), stream=stream)


def ifftshift(a: Any, axes: Sequence[int] | None = None, *, stream: Any = None) -> Array:
    a = arr(a)
    return _g.fft_ifftshift(a, list(axes) if axes is not None else list(range(a.ndim)), stream=stream)

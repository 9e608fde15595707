"""`mlx.core.linalg`. Most decompositions run on the CPU stream only (as in MLX)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from . import _generated as _g
from ._gen import arr
from .array import Array


def norm(a: Any, ord: float | str | None = None, axis: int | Sequence[int] | None = None, keepdims: bool = False,  # noqa: A002
         *, stream: Any = None) -> Array:
    a = arr(a)
    axes = list(range(a.ndim)) if axis is None else [axis] if isinstance(axis, int) else list(axis)
    if ord is None:
        return _g.linalg_norm_l2(a, axes, keepdims=keepdims, stream=stream)
    if isinstance(ord, str):
        return _g.linalg_norm_matrix(a, ord, axes, keepdims=keepdims, stream=stream)
    return _g.linalg_norm(a, float(ord), axes, keepdims=keepdims, stream=stream)


def inv(a: Any, *, stream: Any = None) -> Array:
    return _g.linalg_inv(a, stream=stream)


def pinv(a: Any, *, stream: Any = None) -> Array:
    return _g.linalg_pinv(a, stream=stream)


def solve(a: Any, b: Any, *, stream: Any = None) -> Array:
    return _g.linalg_solve(a, b, stream=stream)


def solve_triangular(a: Any, b: Any, upper: bool = False, *, stream: Any = None) -> Array:
    return _g.linalg_solve_triangular(a, b, upper, stream=stream)


def cholesky(a: Any, upper: bool = False, *, stream: Any = None) -> Array:
    return _g.linalg_cholesky(a, upper, stream=stream)


def qr(a: Any, *, stream: Any = None) -> tuple[Array, Array]:
    return _g.linalg_qr(a, stream=stream)


def svd(a: Any, compute_uv: bool = True, *, stream: Any = None) -> Any:
    out = _g.linalg_svd(a, compute_uv, stream=stream)
    return tuple(out) if compute_uv else out[0]


def eigh(a: Any, UPLO: str = "L", *, stream: Any = None) -> tuple[Array, Array]:  # noqa: N803
    return _g.linalg_eigh(a, UPLO, stream=stream)


def eigvalsh(a: Any, UPLO: str = "L", *, stream: Any = None) -> Array:  # noqa: N803
    return _g.linalg_eigvalsh(a, UPLO, stream=stream)


def cross(a: Any, b: Any, axis: int = -1, *, stream: Any = None) -> Array:
    return _g.linalg_cross(a, b, axis, stream=stream)


def lu_factor(a: Any, *, stream: Any = None) -> tuple[Array, Array]:
    return _g.linalg_lu_factor(a, stream=stream)

"""`mlx.core.random` with explicit keys (a key is a uint32 Array of shape (2,))."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from . import _generated as _g
from . import dtypes as _dt
from ._loader import check, lib
from .array import Array, new_handle, wrap


def key(seed: int) -> Array:
    p = new_handle()
    check(lib.mlx_random_key(p, int(seed) & 0xFFFFFFFFFFFFFFFF))
    return wrap(p)


def seed(value: int) -> None:
    """Seed MLX's global generator (used when no key is passed)."""
    check(lib.mlx_random_seed(int(value) & 0xFFFFFFFFFFFFFFFF))


def split(key: Array, num: int = 2, *, stream: Any = None) -> Array:
    return _g.random_split_num(key, num, stream=stream)


def _shape(shape: int | Sequence[int]) -> list[int]:
    return [shape] if isinstance(shape, int) else list(shape)


def uniform(low: Any = 0.0, high: Any = 1.0, shape: int | Sequence[int] = (), dtype: Any = _dt.float32,
            key: Array | None = None, *, stream: Any = None) -> Array:
    return _g.random_uniform(low, high, _shape(shape), dtype, key=key, stream=stream)


def normal(shape: int | Sequence[int] = (), dtype: Any = _dt.float32, loc: float = 0.0, scale: float = 1.0,
           key: Array | None = None, *, stream: Any = None) -> Array:
    return _g.random_normal(_shape(shape), dtype, loc, scale, key=key, stream=stream)


def randint(low: Any, high: Any, shape: int | Sequence[int] = (), dtype: Any = _dt.int32,
            key: Array | None = None, *, stream: Any = None) -> Array:
    return _g.random_randint(low, high, _shape(shape), dtype, key=key, stream=stream)


def bernoulli(p: Any = 0.5, shape: int | Sequence[int] | None = None, key: Array | None = None, *,
              stream: Any = None) -> Array:
    p_arr = p if isinstance(p, Array) else Array(p, _dt.float32)
    return _g.random_bernoulli(p_arr, _shape(shape) if shape is not None else list(p_arr.shape), key=key, stream=stream)


def categorical(logits: Any, axis: int = -1, num_samples: int | None = None, key: Array | None = None, *,
                stream: Any = None) -> Array:
    if num_samples is None:
        return _g.random_categorical(logits, axis, key=key, stream=stream)
    return _g.random_categorical_num_samples(logits, axis, num_samples, key=key, stream=stream)


def gumbel(shape: int | Sequence[int] = (), dtype: Any = _dt.float32, key: Array | None = None, *,
           stream: Any = None) -> Array:
    return _g.random_gumbel(_shape(shape), dtype, key=key, stream=stream)


def truncated_normal(lower: Any, upper: Any, shape: int | Sequence[int] = (), dtype: Any = _dt.float32,
                     key: Array | None = None, *, stream: Any = None) -> Array:
    return _g.random_truncated_normal(lower, upper, _shape(shape), dtype, key=key, stream=stream)


def permutation(x: Any, axis: int = 0, key: Array | None = None, *, stream: Any = None) -> Array:
    if isinstance(x, int):
        return _g.random_permutation_arange(x, key=key, stream=stream)
    return _g.random_permutation(x, axis, key=key, stream=stream)

"""Evaluation of lazy arrays."""
from __future__ import annotations

from typing import Any

from ._gen import vector_of
from ._loader import check, lib
from .array import Array


def _collect(args: tuple[Any, ...]) -> list[Array]:
    out: list[Array] = []
    stack = list(args)
    while stack:
        item = stack.pop()
        if isinstance(item, Array):
            out.append(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif item is not None:
            raise TypeError(
                f"eval takes arrays and (nested) lists, tuples or dicts of arrays, not {type(item).__name__}")
    return out


def eval(*args: Any) -> None:  # noqa: A001
    """Evaluate arrays (or trees of arrays) and wait for them."""
    arrays = _collect(args)
    if not arrays:
        return
    _keep, vec = vector_of(arrays)
    check(lib.mlx_eval(vec[0]))


def async_eval(*args: Any) -> None:
    """Schedule evaluation and return at once; reading a value later waits for it."""
    arrays = _collect(args)
    if not arrays:
        return
    _keep, vec = vector_of(arrays)
    check(lib.mlx_async_eval(vec[0]))

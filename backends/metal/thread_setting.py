"""A value each thread sees on its own, set for the span of a `with` block: the switches that a
caller turns on around a forward pass (a shapeless trace, MLX's kernels only, a layer listener)
without passing them through every layer."""
from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

V = TypeVar("V")


class ThreadSetting(Generic[V]):
    """`get()` gives `default` on a thread until `with setting.set(value):` changes it there;
    leaving the block restores what was before (so blocks nest)."""

    def __init__(self, default: V) -> None:
        self._local = threading.local()
        self._default = default

    def get(self) -> V:
        value: V = getattr(self._local, "value", self._default)
        return value

    @contextmanager
    def set(self, value: V) -> Iterator[None]:
        before = self.get()
        self._local.value = value
        try:
            yield
        finally:
            self._local.value = before


__all__ = ["ThreadSetting"]

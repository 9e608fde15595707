"""What every optional kernel of the native backend asks before a model uses it: is this process
on MLX's CUDA device, and does the kernel run here and agree with MLX's own operations (asked once
per process and shape, with a RuntimeWarning naming the reason where it does not)."""
from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Hashable

import pymlxc.core as mx


def on_cuda() -> bool:
    """Whether MLX runs on a CUDA GPU here (its CUDA build and the GPU as the default device)."""
    return mx.cuda_available() and mx.default_device().type == "gpu"


class CheckedOnce:
    """One kernel's verdicts, one per key (shape, dtype, ...): `verdict(key, compare)` runs
    `compare()` the first time the key is asked and keeps its answer. `compare` returns None where
    the kernel agrees with MLX, else why not; an exception it raises means the kernel cannot run
    here. A failed check warns once and the caller keeps MLX's kernels."""

    def __init__(self, kernel: str) -> None:
        self.kernel = kernel  # how the warning names it
        self._known: dict[Hashable, bool] = {}
        self._lock = threading.Lock()  # held while checking: a second asker waits for the verdict

    def verdict(self, key: Hashable, compare: Callable[[], str | None]) -> bool:
        with self._lock:
            known = self._known.get(key)
            if known is None:
                try:
                    why = compare()
                except Exception as exc:  # noqa: BLE001 - whatever stops it, MLX's kernels still work
                    why = f"it cannot run here ({type(exc).__name__}: {exc})"
                if why is not None:
                    warnings.warn(f"{self.kernel} is not used: {why}; using MLX's kernels", RuntimeWarning,
                                  stacklevel=3)
                known = self._known[key] = why is None
            return known

    def known(self) -> dict[Hashable, bool]:
        """The verdicts so far (a copy)."""
        with self._lock:
            return dict(self._known)

    def forget(self) -> None:
        """Drop every verdict: the next `verdict` checks again (tests)."""
        with self._lock:
            self._known.clear()


__all__ = ["CheckedOnce", "on_cuda"]

"""What every optional kernel of the native backend asks before a model uses it: is this process
on MLX's CUDA device, and does the kernel run here and agree with MLX's own operations (asked once
per machine and shape, with a RuntimeWarning naming the reason where it does not).

A passing verdict is kept in the user cache (`pymlxc/user_cache.py`, `PYMLXC_CACHE_DIR`) under a
key of everything it depends on: the device and its driver, the MLX build, the source of the module
that defines the kernel and its check, and the check's own key (shape, dtype, ...). A later process
with the same key skips the check (and the kernel compilations and runs it costs); any change in
the key checks again. A failing verdict is not kept: it may be transient (a stream missing on a
thread, memory), and checking again only costs time, while a wrong "yes" would cost correctness.
"""
from __future__ import annotations

import hashlib
import re
import sys
import threading
import warnings
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path
from typing import Any

import pymlxc.core as mx
from pymlxc import ptx_cache, user_cache

CHECKS_FORMAT = 1  # bump when what a verdict means changes: older verdicts are then checked again
# device_info keys whose values change while a machine runs (they would never let a verdict hit).
_VOLATILE = re.compile(r"free|avail|active|used|peak", re.IGNORECASE)


def on_cuda() -> bool:
    """Whether MLX runs on a CUDA GPU here (its CUDA build and the GPU as the default device)."""
    return mx.cuda_available() and mx.default_device().type == "gpu"


_environment: dict[str, Any] | None = None
_environment_lock = threading.Lock()


def environment() -> dict[str, Any]:
    """The facts a kernel's verdict depends on besides its source and key: MLX's device as MLX
    describes it, the NVIDIA driver (where there is one), and the MLX build (the Python package and
    its CUDA or Metal companion, mlx-c). Computed once per process."""
    global _environment
    with _environment_lock:
        if _environment is None:
            device = mx.default_device()
            try:
                info = {k: v for k, v in mx.device_info().items() if not _VOLATILE.search(k)}
            except mx.MLXError:
                info = {}
            _environment = {"device": str(device), "device_info": info, "driver": ptx_cache.nvidia_driver(),
                            "mlx": ptx_cache.mlx_builds(), "mlx_c": mx.mlx_c_version(), "platform": sys.platform}
        return _environment


def _source_digest(paths: Sequence[str]) -> str | None:
    """SHA-256 of the files that define a kernel and its check (most often one file holds both)."""
    digest = hashlib.sha256()
    try:
        for path in paths:
            digest.update(Path(path).read_bytes())
    except OSError:
        return None
    return digest.hexdigest() if paths else None


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower()[:60] or "kernel"


class CheckedOnce:
    """One kernel's verdicts, one per key (shape, dtype, ...): `verdict(key, compare)` runs
    `compare()` the first time the key is asked on this machine and keeps its answer. `compare`
    returns None where the kernel agrees with MLX, else why not; an exception it raises means the
    kernel cannot run here. A failed check warns once and the caller keeps MLX's kernels.

    `source`: the file, or files, whose text keys the persisted verdicts (default: the module that
    makes this object, where the kernel's source and its check are written). `store`: where they persist
    (default: the user cache's "checks" folder; None: this process only). `fallback`: what the
    warning says is used instead."""

    def __init__(self, kernel: str, source: str | Sequence[str] | None = None,
                 store: user_cache.Store | str | None = "default", fallback: str = "MLX's kernels") -> None:
        self.kernel = kernel  # how the warning names it
        self.fallback = fallback  # and what it says is used instead
        self._known: dict[Hashable, bool] = {}
        self._lock = threading.Lock()  # held while checking: a second asker waits for the verdict
        if source is None:
            source = sys._getframe(1).f_globals.get("__file__")  # noqa: SLF001 - the defining module
        self._source = _source_digest([source] if isinstance(source, str) else list(source or ()))
        self._store = (user_cache.Store(f"checks-{_slug(kernel)}") if store == "default"
                       else store if isinstance(store, user_cache.Store) else None)
        self.checks_run = 0  # compare() calls in this process (the rest came from memory or the cache)

    def _persisted_key(self, key: Hashable) -> dict[str, Any] | None:
        if self._store is None or self._source is None:
            return None
        try:
            user_cache.canonical(key)
        except (TypeError, ValueError):
            return None  # a key that is not plain data is kept for this process only
        return {"format": CHECKS_FORMAT, "kernel": self.kernel, "source_sha256": self._source,
                "environment": environment(), "key": key}

    def verdict(self, key: Hashable, compare: Callable[[], str | None]) -> bool:
        with self._lock:
            known = self._known.get(key)
            if known is not None:
                return known
            persisted = self._persisted_key(key)
            if persisted is not None and self._store is not None and self._store.get(persisted) is True:
                self._known[key] = True
                return True
            self.checks_run += 1
            try:
                why = compare()
                raised = False
            except Exception as exc:  # noqa: BLE001 - whatever stops it, MLX's kernels still work
                why = f"it cannot run here ({type(exc).__name__}: {exc})"
                raised = True
            if why is not None:
                warnings.warn(f"{self.kernel} is not used: {why}; using {self.fallback}", RuntimeWarning,
                              stacklevel=3)
            elif not raised and persisted is not None and self._store is not None:
                self._store.put(persisted, True)
            known = self._known[key] = why is None
            return known

    def passed(self, key: Hashable) -> bool:
        """Whether `verdict` for `key` passed in this process; never runs the check (for a caller on
        a hot path, or on a thread where a first check must not run)."""
        return self._known.get(key) is True  # one read of a dict: atomic, no lock needed

    def known(self) -> dict[Hashable, bool]:
        """The verdicts so far (a copy)."""
        with self._lock:
            return dict(self._known)

    def forget(self) -> None:
        """Drop every verdict, in this process and in the cache: the next `verdict` checks again
        (tests, and a user who wants the kernels checked again)."""
        with self._lock:
            self._known.clear()
            if self._store is not None:
                self._store.clear()


__all__ = ["CheckedOnce", "environment", "on_cuda"]

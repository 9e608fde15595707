"""The backend registry: `register`, `get`, `list_backends`, `default_backend`, `load_model`."""
from __future__ import annotations

import threading
from typing import Any

from . import hub
from .model import Backend, TextModel
from .options import LoadConfig, make_config

_lock = threading.Lock()
_backends: dict[str, Backend] = {}
PREFERENCE = ("metal", "mlx_lm")


class BackendUnavailableError(RuntimeError):
    """No backend can load the model here; the message says which exist and why not."""


def register(backend: Backend) -> None:
    """Add (or replace) a backend under its `name`."""
    if not getattr(backend, "name", None):
        raise ValueError("a backend needs a non-empty name")
    with _lock:
        _backends[backend.name] = backend


def get(name: str) -> Backend:
    with _lock:
        backend = _backends.get(name)
    if backend is None:
        raise KeyError(f"no backend named {name!r}; registered: {', '.join(list_backends()) or 'none'}")
    return backend


def list_backends() -> list[str]:
    with _lock:
        return sorted(_backends)


def _describe() -> str:
    parts = []
    for name in list_backends():
        backend = get(name)
        parts.append(
            f"{name} (available)" if backend.available() else f"{name} (unavailable: {backend.unavailable_reason()})"
        )
    return "; ".join(parts) or "none registered"


def default_backend() -> Backend:
    """`metal` if available, then `mlx_lm`, then any other available backend."""
    names = list_backends()
    ordered = [n for n in PREFERENCE if n in names] + [n for n in names if n not in PREFERENCE]
    for name in ordered:
        backend = get(name)
        if backend.available():
            return backend
    raise BackendUnavailableError(f"no backend is available: {_describe()}")


def load_model(path: str, backend: str | None = None, **options: Any) -> TextModel:
    """Load the model at `path` with `backend` or the default one. `path` is a directory or a .gguf
    file, or a Hugging Face repo id (`org/name`, `org/name@revision`, `org/name:Q4_K_M` for a GGUF
    repo) downloaded into the hub cache first (`pymlxc.hub.resolve`; an existing path wins)."""
    config = make_config(LoadConfig, backend=backend, **options)
    if config.backend is None:
        chosen = default_backend()
    else:
        try:
            chosen = get(config.backend)
        except KeyError:
            raise BackendUnavailableError(f"unknown backend {config.backend!r}; backends: {_describe()}") from None
        if not chosen.available():
            raise BackendUnavailableError(
                f"backend {config.backend!r} is unavailable: {chosen.unavailable_reason()}; backends: {_describe()}"
            )
    return chosen.load(str(hub.resolve(path)), config)  # options checked and backend chosen before any download

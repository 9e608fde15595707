"""The mlx_lm backend: mlx-lm running in worker processes (`pymlxc.bridge`), driven over JSON Lines."""
from __future__ import annotations

from .backend import PYTHON_ENV, MlxLmBackend, probe
from .errors import WorkerBadRequest, WorkerDied, WorkerError, WorkerReplyError, WorkerTemplateError, WorkerTimeout
from .textmodel import MlxLmModel

__all__ = [
    "PYTHON_ENV",
    "MlxLmBackend",
    "MlxLmModel",
    "WorkerBadRequest",
    "WorkerDied",
    "WorkerError",
    "WorkerReplyError",
    "WorkerTemplateError",
    "WorkerTimeout",
    "probe",
    "register_backend",
]


def register_backend() -> MlxLmBackend:
    """Register an `mlx_lm` backend (worker Python from $PYMLXC_MLX_LM_PYTHON or this one) and return it."""
    from pymlxc.registry import register

    backend = MlxLmBackend()
    register(backend)
    return backend

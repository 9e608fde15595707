"""The `mlx_lm` Backend: whether a worker can run here (a cached probe of its Python), and `load`."""
from __future__ import annotations

import dataclasses
import functools
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from pymlxc import settings
from pymlxc.options import LoadConfig

from .textmodel import MlxLmModel

PYTHON_ENV = settings.variable("mlx_lm_python")  # the Python that runs the worker, when mlx-lm lives elsewhere
MIN_MLX_LM = (0, 32)  # BatchGenerator and the generate_step keywords the worker uses
# Loads mlx's native library (the part that breaks) but not mlx-lm, whose import takes seconds;
# mlx-lm's version comes from its metadata, or from the module where it has none (a source checkout).
_PROBE = """
import importlib.metadata, importlib.util, sys
import mlx.core
if importlib.util.find_spec("mlx_lm") is None:
    sys.exit("ModuleNotFoundError: No module named 'mlx_lm'")
try:
    version = importlib.metadata.version("mlx-lm")
except importlib.metadata.PackageNotFoundError:
    import mlx_lm
    version = mlx_lm.__version__
sys.stdout.write(version)
"""


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


@functools.cache
def probe(python: str) -> tuple[str | None, str | None]:
    """(mlx-lm version, None) when `python` can import mlx-lm, else (None, the reason). Cached per Python."""
    try:
        done = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        return None, f"the worker Python {python!r} does not exist"
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"the worker Python {python!r} could not be run: {e}"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        return None, f"mlx-lm cannot be imported by {python}: {last}"
    version = done.stdout.strip()
    if _version_tuple(version) < MIN_MLX_LM:
        need = ".".join(map(str, MIN_MLX_LM))
        return None, f"mlx-lm {version} in {python} is older than the {need} the worker needs"
    return version, None


class MlxLmBackend:
    """Runs models with mlx-lm in worker processes speaking the bridge's JSON Lines protocol.

    `python` (else $PYMLXC_MLX_LM_PYTHON, else this interpreter) runs the worker. A worker silent
    for `response_timeout` seconds mid-call is killed; loading may take up to `load_timeout`.
    """

    name = "mlx_lm"

    def __init__(
        self,
        python: str | None = None,
        *,
        response_timeout: float = 120.0,
        load_timeout: float = 600.0,
        worker_args: Sequence[str] = (),
    ) -> None:
        self._python = python
        self.response_timeout, self.load_timeout = response_timeout, load_timeout
        self.worker_args = tuple(worker_args)

    @property
    def python(self) -> str:
        return self._python or settings.current().mlx_lm_python or sys.executable

    def available(self) -> bool:
        return self.unavailable_reason() is None

    def unavailable_reason(self) -> str | None:
        return probe(self.python)[1]

    def load(self, path: str, config: LoadConfig) -> MlxLmModel:
        from pymlxc.hub import resolve

        if config.dtype != "auto":  # mlx-lm computes in the checkpoint's dtype: refused, not ignored
            raise ValueError(
                f"dtype={config.dtype!r} is not supported by the mlx_lm backend (the metal backend takes it)"
            )

        if config.distributed is not None:  # each rank would load and run the whole model, silently
            raise ValueError(f"distributed={config.distributed!r} is not supported by the mlx_lm backend "
                             "(the metal backend takes it)")

        model_dir = resolve(path).resolve()  # a repo id is fetched here: the worker gets a local directory
        if not model_dir.is_dir():
            raise FileNotFoundError(f"the mlx_lm backend loads model directories; {path!r} is not one")
        adapter = None
        if config.adapter_path is not None:
            adapter_dir = Path(config.adapter_path).expanduser().resolve()
            if not adapter_dir.is_dir():
                raise FileNotFoundError(f"adapter path {config.adapter_path!r} is not a directory")
            adapter = str(adapter_dir)
        config = dataclasses.replace(config, adapter_path=adapter)
        return MlxLmModel(
            str(model_dir),
            config,
            python=self.python,
            response_timeout=self.response_timeout,
            load_timeout=self.load_timeout,
            worker_args=self.worker_args,
        )

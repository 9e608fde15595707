"""The Backend object: availability from a cached probe of the worker's Python, registry, load checks."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from pymlxc import registry, settings
from pymlxc.backends.mlx_lm import MlxLmBackend, probe, register_backend
from pymlxc.options import LoadConfig


def _fake_python(path: Path, body: str) -> str:
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return str(path)


def test_available_with_this_python_which_has_mlx_lm() -> None:
    backend = MlxLmBackend(sys.executable)
    assert backend.name == "mlx_lm"
    assert backend.available() and backend.unavailable_reason() is None


def test_unavailable_with_the_reason_when_the_python_lacks_mlx_lm(tmp_path: Path) -> None:
    log = tmp_path / "runs"
    python = _fake_python(
        tmp_path / "python", f'echo run >> "{log}"; echo "ModuleNotFoundError: No module named \'mlx_lm\'" >&2; exit 1'
    )
    backend = MlxLmBackend(python)
    assert not backend.available()
    reason = backend.unavailable_reason()
    assert reason is not None and "mlx-lm cannot be imported" in reason and "No module named 'mlx_lm'" in reason
    assert log.read_text().count("run") == 1  # probed once, then cached


def test_unavailable_when_the_python_is_missing_or_mlx_lm_too_old(tmp_path: Path) -> None:
    assert "does not exist" in str(MlxLmBackend(str(tmp_path / "no-python")).unavailable_reason())
    old = _fake_python(tmp_path / "old-python", "printf 0.19.3")
    assert probe(old) == (None, f"mlx-lm 0.19.3 in {old} is older than the 0.32 the worker needs")


def test_python_comes_from_the_settings_when_not_given() -> None:
    read = settings.Settings.from_env({"PYMLXC_MLX_LM_PYTHON": "/opt/other/python"})
    with settings.override(mlx_lm_python=read.mlx_lm_python):
        assert MlxLmBackend().python == "/opt/other/python"
    with settings.override(mlx_lm_python=None):
        assert MlxLmBackend().python == sys.executable


def test_register_backend_puts_mlx_lm_in_the_registry(tmp_path: Path) -> None:
    backend = register_backend()
    assert registry.get("mlx_lm") is backend
    registry.register(MlxLmBackend(str(tmp_path / "no-python")))
    try:
        with pytest.raises(registry.BackendUnavailableError, match="does not exist"):
            registry.load_model(str(tmp_path), backend="mlx_lm")
    finally:
        register_backend()


def test_load_refuses_missing_directories_at_once(tmp_path: Path, tiny_model: Path) -> None:
    backend = MlxLmBackend(sys.executable)
    with pytest.raises(FileNotFoundError, match="not one"):
        backend.load(str(tmp_path / "missing"), LoadConfig())
    with pytest.raises(FileNotFoundError, match="adapter"):
        backend.load(str(tiny_model), LoadConfig(adapter_path=str(tmp_path / "missing")))

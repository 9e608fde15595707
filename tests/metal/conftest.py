"""Fixtures of the native backend's tests."""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from pymlxc import settings


class Switches:
    """The process's settings (pymlxc/settings.py) changed for one test: `switches(decode="graph")`,
    or `switches.env("PYMLXC_DECODE", "graph")` to change one as the environment would (parsed
    strictly: a bad value raises SettingsError naming the variable). Changes stack."""

    def __init__(self, stack: contextlib.ExitStack) -> None:
        self._stack = stack

    def __call__(self, **changes: Any) -> settings.Settings:
        return self._stack.enter_context(settings.override(**changes))

    def env(self, variable: str, value: str) -> settings.Settings:
        name = variable.removeprefix(settings.PREFIX).lower()
        read = settings.Settings.from_env({variable: value})
        return self(**{name: getattr(read, name)})


@pytest.fixture
def switches() -> Iterator[Switches]:
    with contextlib.ExitStack() as stack:
        yield Switches(stack)


@pytest.fixture
def tiny(tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """`tiny(arch="llama", bits=None, **kw)`: a 3-layer float16 model, quantized to `bits`
    (write_tiny_model's `kw`), freed at the end (a test module may define its own `tiny`)."""
    from .cuda_decode_helpers import tiny_models

    models = tiny_models(tmp_path)
    load = next(models)
    yield lambda arch="llama", bits=None, **kw: load(arch, quantize_bits=bits, **kw)
    next(models, None)

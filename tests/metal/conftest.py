"""Fixtures of the native backend's tests."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
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

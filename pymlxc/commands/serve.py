"""`pymlxc serve MODEL`: the OpenAI-compatible server (`pymlxc.server`; needs the `server` extra)."""
from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any


def _configure(parser: argparse.ArgumentParser) -> None:
    from pymlxc.server.main import configure

    configure(parser)


def _run(args: argparse.Namespace) -> int:
    from pymlxc.server.main import run

    return run(args)


def register_commands(register: Callable[[Any], None]) -> None:
    from pymlxc.cli import Command

    register(Command("serve", "serve a model over an OpenAI-compatible HTTP API", _configure, _run))

"""Run a reliability case in a child process with a timeout, so that a crash or a hang fails one
test instead of ending the run.

A case is a snippet of Python run with the checkout importable (as `tests/conftest.py` arranges).
It reports by printing one line `RESULT <json>` on stdout; `run_case` returns that value. A child
that dies by a signal, exits non-zero, prints no result or outlives `timeout` fails the test with
its exit status and the tail of its output.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]

PRELUDE = f"""
import json, sys
sys.path.insert(0, {str(ROOT / "tests")!r})
import conftest  # noqa: F401 - installs the checkout's module names
def report(value):
    print("RESULT " + json.dumps(value), flush=True)
"""


def run_case(code: str, *, timeout: float = 120.0, env: dict[str, str] | None = None) -> Any:
    """Run `code` (which calls `report(value)` once) in a fresh interpreter; return `value`."""
    source = PRELUDE + textwrap.dedent(code)
    child_env = {**os.environ, **(env or {})}
    try:
        done = subprocess.run([sys.executable, "-c", source], capture_output=True, text=True,
                              timeout=timeout, env=child_env, cwd=str(ROOT))
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stdout or b"")[-2000:] if isinstance(exc.stdout, bytes) else (exc.stdout or "")[-2000:]
        pytest.fail(f"the case hung: no exit within {timeout} s\n{tail}")
    if done.returncode != 0:
        how = f"signal {-done.returncode}" if done.returncode < 0 else f"exit status {done.returncode}"
        pytest.fail(f"the case died ({how})\nstdout:\n{done.stdout[-2000:]}\nstderr:\n{done.stderr[-4000:]}")
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    pytest.fail(f"the case printed no result\nstdout:\n{done.stdout[-2000:]}\nstderr:\n{done.stderr[-4000:]}")

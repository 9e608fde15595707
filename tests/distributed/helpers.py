"""Run tests/distributed/worker.py as one process (the reference) or as N ranks over the ring on
127.0.0.1 (`pymlxc.launch.run_local`), and read the RESULT line each printed."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from pymlxc.launch import RankResult, run_local

WORKER = str(Path(__file__).resolve().parent / "worker.py")


def result_of(stdout: str) -> dict[str, Any]:
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"no RESULT line in:\n{stdout[-2000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def reference(model: Path, *args: str, timeout: float = 120) -> dict[str, Any]:
    done = subprocess.run([sys.executable, WORKER, str(model), "none", *args], capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return result_of(done.stdout)


def ranks(n: int, model: Path, mode: str, *args: str, timeout: float = 180) -> list[RankResult]:
    return run_local(n, [sys.executable, WORKER, str(model), mode, *args], timeout=timeout)

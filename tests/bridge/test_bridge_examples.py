"""The examples in other languages drive the worker by PROTOCOL.md alone, and get the worker's text."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from bridge_raw_worker import BRIDGE_DIR, RawWorker  # type: ignore[import-not-found]

EXAMPLES = {
    "node": ["node", str(BRIDGE_DIR / "examples" / "generate.mjs")],
    "jq": ["bash", str(BRIDGE_DIR / "examples" / "generate.sh")],
}
RUNNABLE = [name for name in EXAMPLES if shutil.which(name)]
PROMPT = "The baker counted"


def test_at_least_one_example_can_run_here() -> None:
    if not RUNNABLE:
        pytest.skip("neither node nor jq is installed (apt-get install -y jq)")


@pytest.mark.parametrize("name", RUNNABLE)
def test_example_streams_what_the_worker_streams(name: str, loaded_worker: RawWorker, tiny_model: Path) -> None:
    loaded_worker.send(cmd="generate", id="ref", prompt=PROMPT, max_tokens=12)
    expected = "".join(line["token"] for line in loaded_worker.until_terminal("ref") if line["type"] == "token")
    env = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run([*EXAMPLES[name], str(tiny_model), PROMPT, "12"], capture_output=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-2000:]
    assert done.stdout.decode() == expected + "\n"


@pytest.mark.parametrize("name", RUNNABLE)
def test_example_fails_loudly_on_a_worker_error(name: str, tmp_path: Path) -> None:
    env: dict[str, Any] = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run(
        [*EXAMPLES[name], str(tmp_path / "missing"), "x", "3"], capture_output=True, env=env, timeout=120
    )
    assert done.returncode != 0
    assert b"load_failed" in done.stderr

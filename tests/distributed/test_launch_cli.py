"""`pymlxc launch -n 2 -- generate ...` prints what one process prints (rank 0 answers, once); a
failing rank ends the launch with status 1 and names the rank."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pymlxc.testing import write_tiny_model

TESTS = str(Path(__file__).resolve().parents[1])
CLI = f"import sys; sys.path.insert(0, {TESTS!r}); import conftest; from pymlxc.cli import main; sys.exit(main())"


def _cli(*argv: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", CLI, *argv], capture_output=True, text=True, timeout=180,
                          input=stdin if stdin is not None else "")


@pytest.mark.parametrize("mode", ["tensor", "pipeline"])
def test_launch_generate_answers_once_like_one_process(tmp_path: Path, mode: str) -> None:
    model = str(write_tiny_model(tmp_path / "q", "qwen3"))
    alone = _cli("generate", model, "Hello there", "--max-tokens", "8", "-q")
    assert alone.returncode == 0, alone.stderr
    launched = _cli("launch", "-n", "2", "--mode", mode, "--", "generate", model, "Hello there", "--max-tokens", "8",
                    "-q")
    assert launched.returncode == 0, launched.stderr
    assert launched.stdout == alone.stdout and alone.stdout.strip()


def test_launch_chat_reads_the_messages_like_one_process(tmp_path: Path) -> None:
    """The ranks' stdin was /dev/null: `launch -- chat MODEL` (docs/distributed.md) read no message
    and exited 0 having answered nothing."""
    model = str(write_tiny_model(tmp_path / "q", "qwen3"))
    messages = "Hello there\nand again\n"
    alone = _cli("chat", model, "--max-tokens", "6", "-q", stdin=messages)
    assert alone.returncode == 0, alone.stderr
    launched = _cli("launch", "-n", "2", "--", "chat", model, "--max-tokens", "6", "-q", stdin=messages)
    assert launched.returncode == 0, launched.stderr
    assert launched.stdout == alone.stdout and alone.stdout.count("\n") == 2


def test_launch_reports_the_failing_rank(tmp_path: Path) -> None:
    launched = _cli("launch", "-n", "2", "--", "generate", str(tmp_path / "missing"), "hi", "-q")
    assert launched.returncode == 1
    assert "pymlxc launch: rank 0 exited with status" in launched.stderr or "rank 1 exited" in launched.stderr


def test_a_launch_error_shows_every_failed_rank() -> None:
    """Where several ranks fail, the error shows each one's stderr: the first seen failing may only
    have lost a peer that failed for the real reason."""
    from pymlxc.launch import LaunchError, run_local

    code = ("import os, sys, time; r = int(os.environ['MLX_RANK']); time.sleep(2.0 * (1 - r)); "
            "sys.stderr.write(f'the reason of rank {r}\\n'); sys.exit(3 + r)")
    with pytest.raises(LaunchError) as caught:
        run_local(2, [sys.executable, "-c", code], timeout=60, grace=5)
    message = str(caught.value)
    assert "the reason of rank 0" in message and "the reason of rank 1" in message
    assert message.startswith("rank 1 exited")  # rank 1 ended first

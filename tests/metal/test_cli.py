"""`python -m pymlxc.cli` on a tiny model, as a user runs it (subprocesses)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import pymlxc
from pymlxc.cli import Command, build_parser, commands, register_command
from pymlxc.testing import write_tiny_model

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("cli") / "llama", "llama", seed=2)


def cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    # The checkout first, then whatever the tests run with (packages installed outside the venv).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    return subprocess.run([sys.executable, "-m", "pymlxc.cli", *args], input=stdin, capture_output=True, text=True,
                          timeout=120, env=env, cwd=ROOT)


def test_generate_prints_the_greedy_text_and_metrics(model_dir: Path) -> None:
    with pymlxc.load_model(str(model_dir), backend="metal") as model:
        want = "".join(t.text for t in model.generate("Once upon a time", max_tokens=8))
    run = cli("generate", str(model_dir), "Once upon a time", "--max-tokens", "8", "--backend", "metal")
    assert run.returncode == 0, run.stderr
    assert run.stdout == want + "\n"
    assert "generated 8 tokens" in run.stderr and "tok/s" in run.stderr and "peak memory" in run.stderr


def test_generate_with_sampling_options_is_reproducible(model_dir: Path) -> None:
    args = ("generate", str(model_dir), "hello", "--max-tokens", "6", "--temperature", "0.9", "--top-k", "20",
            "--top-p", "0.9", "--min-p", "0.05", "--seed", "3", "-q")
    first, second = cli(*args), cli(*args)
    assert first.returncode == 0, first.stderr
    assert first.stdout == second.stdout and first.stderr == ""


def test_bad_option_is_a_clear_error(model_dir: Path) -> None:
    run = cli("generate", str(model_dir), "hello", "--temperature", "-2", "-q")
    assert run.returncode == 1
    assert "temperature" in run.stderr and "Traceback" not in run.stderr


def test_info(model_dir: Path) -> None:
    run = cli("info", str(model_dir), "--json", "-q")
    assert run.returncode == 0, run.stderr
    info = json.loads(run.stdout)
    assert (info["architecture"], info["num_layers"], info["vocab_size"]) == ("llama", 2, 512)
    text = cli("info", str(model_dir), "-q")
    assert "architecture: llama" in text.stdout


def test_discover(model_dir: Path) -> None:
    run = cli("discover", str(model_dir.parent), "--json")
    assert run.returncode == 0, run.stderr
    records = [json.loads(line) for line in run.stdout.splitlines()]
    assert [(r["path"], r["model_type"], r["format"]) for r in records] == [(str(model_dir), "llama", "safetensors")]


def test_chat_reads_stdin_until_exit_and_keeps_history(model_dir: Path) -> None:
    run = cli("chat", str(model_dir), "--max-tokens", "5", stdin="hello\nand again\n/exit\nnot read\n")
    assert run.returncode == 0, run.stderr
    with pymlxc.load_model(str(model_dir), backend="metal") as model:
        first = "".join(t.text for t in model.chat([{"role": "user", "content": "hello"}], max_tokens=5))
        history = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": first},
                   {"role": "user", "content": "and again"}]
        second = "".join(t.text for t in model.chat(history, max_tokens=5))
    assert run.stdout == f"{first}\n{second}\n"
    assert run.stderr.count("generated 5 tokens") == 2


def test_commands_can_be_added() -> None:
    register_command(Command("tiny-test", "a test command", lambda p: p.add_argument("x"), lambda a: 0))
    assert "tiny-test" in commands()
    args = build_parser().parse_args(["tiny-test", "7"])
    assert args.x == "7" and args._run(args) == 0

"""The `pymlxc` command line driven carelessly: options out of range, paths that are not what they
should be, an exception no handler expected, Ctrl-C. Each ends with a non-zero status and one line
naming the option or path, never a traceback; nothing is loaded or launched before the options are
checked. (tests/metal/test_cli.py runs the commands on a working model.)"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pymlxc import cli, settings
from pymlxc.testing import write_tiny_model

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = ("bench", "chat", "discover", "fuse", "generate", "info", "launch", "lora", "serve")


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pymlxc.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=_env(), cwd=ROOT, stdin=subprocess.DEVNULL)


def one_line_error(done: subprocess.CompletedProcess[str], code: int, *needles: str) -> None:
    assert done.returncode == code, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("cli-errors") / "llama", "llama", seed=4)


@pytest.mark.parametrize("command", COMMANDS)
def test_help_of_every_command(command: str) -> None:
    done = run(command, "--help", timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: pymlxc {command}") and done.stderr == ""


def test_python_dash_m_pymlxc_runs_the_command_line() -> None:
    done = subprocess.run([sys.executable, "-m", "pymlxc", "discover", "--help"], capture_output=True, text=True,
                          timeout=60, env=_env(), cwd=ROOT, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: pymlxc discover")


def test_an_unknown_option_is_refused_with_the_commands_usage(tmp_path: Path) -> None:
    """Was the top-level usage (`pymlxc [-h] COMMAND ...`), which does not show the command's options."""
    done = run("info", str(tmp_path / "no-model"), "--bogus", timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith("usage: pymlxc info ")
    assert done.stderr.strip().splitlines()[-1] == "pymlxc info: error: unrecognized arguments: --bogus"


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX pipes")
@pytest.mark.parametrize("command", [["--help"], ["discover", "{tmp}"], ["info", "{model}", "-q"]])
def test_a_reader_gone_before_the_output_ends_quietly(command: list[str], model_dir: Path, tmp_path: Path) -> None:
    """`pymlxc info MODEL | head -c 1`: output still buffered at exit met the closed pipe in the
    interpreter's own flush, which printed "Exception ignored ... BrokenPipeError" and exited 120."""
    write_tiny_model(tmp_path / "m", "llama", seed=1)
    argv = [a.format(tmp=tmp_path, model=model_dir) for a in command]
    env = {k: v for k, v in _env().items() if k != "PYTHONUNBUFFERED"}  # stdout block-buffered, as in a shell
    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run([sys.executable, "-m", "pymlxc.cli", *argv], stdout=write, stderr=subprocess.PIPE,
                              stdin=subprocess.DEVNULL, text=True, timeout=120, env=env, cwd=ROOT)
    finally:
        os.close(write)
    assert (done.returncode, done.stderr) == (0, "")


@pytest.mark.parametrize("command,option,value,message", [
    ("generate", "--top-p", "1.5", "--top-p must be in [0, 1], not 1.5"),
    ("generate", "--max-tokens", "-1", "--max-tokens must be >= 0, not -1"),
    ("generate", "--seed", "-1", "--seed must be in [0, 18446744073709551616), not -1"),
    ("chat", "--temperature", "nan", "--temperature must be finite, not nan"),
    ("chat", "--min-p", "3", "--min-p must be in [0, 1], not 3.0"),
])
def test_sampling_options_are_checked_before_the_model_loads(command: str, option: str, value: str, message: str,
                                                             tmp_path: Path) -> None:
    """They were checked by the backend after the load (or a download): a missing model was named
    first, and a real one loaded for minutes before the typo was."""
    argv = [command, str(tmp_path / "no-model"), *(["hi"] if command == "generate" else []), option, value, "-q"]
    one_line_error(run(*argv), 1, message)


# ---------------------------------------------------------------------- discover

def test_discover_of_a_missing_folder_is_an_error(tmp_path: Path) -> None:
    """Was "no models under ..." and status 0: a typo looked like an empty folder."""
    one_line_error(run("discover", str(tmp_path / "nowhere")), 1, "folder to search not found", "nowhere")


def test_discover_of_a_file_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("x")
    one_line_error(run("discover", str(tmp_path / "notes.txt")), 1, "notes.txt is a regular file, not a directory")


# ---------------------------------------------------------------------- bench

@pytest.mark.parametrize("option,value,message", [
    ("--runs", "0", "--runs must be >= 1, not 0"),  # was one run, silently
    ("--runs", "-3", "--runs must be >= 1, not -3"),
    ("--warmup", "-1", "--warmup must be >= 0, not -1"),  # was no warm-up, silently
    ("--prompt-tokens", "0", "--prompt-tokens must be >= 1, not 0"),  # was 128 tokens, silently
    ("--max-tokens", "0", "--max-tokens must be >= 1, not 0"),  # was a prefill of millions of tok/s, no decode
])
def test_bench_counts_are_checked_before_anything_loads(option: str, value: str, message: str,
                                                        tmp_path: Path) -> None:
    one_line_error(run("bench", str(tmp_path / "no-model"), option, value, "-q"), 1, message)


def test_bench_prompt_longer_than_the_context_is_refused(model_dir: Path) -> None:
    """The prompt text was built (quadratically) to any size asked, past what the model keeps."""
    done = run("bench", str(model_dir), "--backend", "metal", "--context-len", "32", "--prompt-tokens", "100",
               "--runs", "1", "--warmup", "0", "--max-tokens", "1", "-q")
    one_line_error(done, 1, "--prompt-tokens 100 is more than the model's context length 32")


# ---------------------------------------------------------------------- launch

@pytest.mark.parametrize("options,message", [
    (["-n", "1"], "-n must be at least 2 with --backend ring"),  # was a 30 s wait, then a ring error
    (["-n", "100000"], "-n must be at most 256"),  # was "Too many open files"
    (["-n", "2", "--timeout", "-5"], "--timeout must be a positive number of seconds, not -5.0"),  # ranks started
    (["-n", "2", "--timeout", "nan"], "--timeout must be a positive number of seconds, not nan"),
    (["-n", "2", "--grace", "-1"], "--grace must be a number of seconds >= 0, not -1.0"),
])
def test_launch_options_are_checked_before_any_rank_starts(options: list[str], message: str,
                                                           tmp_path: Path) -> None:
    done = run("launch", *options, "--", "generate", str(tmp_path / "no-model"), "hi", "-q", timeout=90)
    one_line_error(done, 2, message)


@pytest.mark.parametrize("command,message", [
    (["discover", "."], "'discover' loads no model to split over ranks; the commands that run as ranks: bench, chat"),
    (["nope"], "'nope' is not a pymlxc command"),
])
def test_launch_refuses_a_command_that_cannot_run_as_ranks(command: list[str], message: str) -> None:
    """Every rank started, then each refused the `--distributed` the launcher adds ("unrecognized
    arguments: --distributed tensor", an option the user never typed) and the launch exited 1."""
    one_line_error(run("launch", "-n", "2", "--", *command, timeout=90), 2, f"pymlxc launch: {message}")


def test_launch_reports_the_commands_usage_error_before_any_rank_starts(tmp_path: Path) -> None:
    """Was "rank 0 exited with status 2" with each rank's usage message, after starting them all."""
    done = run("launch", "-n", "2", "--", "generate", str(tmp_path / "no-model"), timeout=90)
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last == "pymlxc generate: error: the following arguments are required: prompt"
    assert "rank" not in done.stderr


# ---------------------------------------------------------------------- main's handlers

def _command(monkeypatch: pytest.MonkeyPatch, error: BaseException) -> None:
    def fail(args: argparse.Namespace) -> int:
        raise error

    monkeypatch.setitem(cli._commands, "fail-test", cli.Command("fail-test", "raises", lambda p: None, fail))


@pytest.mark.parametrize("error,message", [
    (MemoryError("cannot allocate 1 TB on the GPU"), "pymlxc: error: out of memory: cannot allocate 1 TB on the GPU"),
    (ImportError("GGUF models need the `gguf` package"), "pymlxc: error: GGUF models need the `gguf` package"),
    (ZeroDivisionError("division by zero"), "pymlxc: error: internal error: ZeroDivisionError: division by zero"),
    (IndexError("list index out of range"), "pymlxc: error: internal error: IndexError: list index out of range"),
    (KeyError(), "pymlxc: error: KeyError"),
])
def test_any_exception_ends_with_one_line_and_status_1(error: BaseException, message: str,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """MemoryError (the device's DeviceMemoryError among them), ImportError and any other bug ended
    the process with a traceback; a KeyError without arguments raised IndexError in the handler."""
    _command(monkeypatch, error)
    with settings.override(traceback=False):
        assert cli.main(["fail-test"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1, err


def test_the_traceback_is_there_when_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    _command(monkeypatch, ZeroDivisionError("boom"))
    with settings.override(traceback=True), pytest.raises(ZeroDivisionError):
        cli.main(["fail-test"])


def test_ctrl_c_while_the_commands_load_exits_130(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C before the command ran (extensions importing, arguments parsed) ended with a traceback."""
    def interrupted() -> list[str]:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "load_extensions", interrupted)
    assert cli.main(["info", "x"]) == 130


def _sigint_default() -> None:
    """In the child before its exec: SIGINT as a terminal gives it. Started with SIGINT ignored (pytest
    as a background job of a non-interactive shell: `pytest &`), Python would install no handler and
    Ctrl-C would do nothing, whatever the command does."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_ctrl_c_while_generating_exits_130_without_a_traceback(model_dir: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "pymlxc.cli", "generate", str(model_dir), "Once upon a time",
                             "--backend", "metal", "--max-tokens", "100000", "-q"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, env=_env(), cwd=ROOT,
                            preexec_fn=_sigint_default)
    try:
        assert proc.stdout is not None
        proc.stdout.read(1)  # generating: the first token is out
        time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert b"Traceback" not in err, err


INTERRUPTED_IN_A_DESTRUCTOR = """
import sys
from pymlxc import cli
from pymlxc.core import _gen

free_vector, print_stream, state = _gen._free_vector, cli._print_stream, {"armed": False, "fired": False}

def interrupted(p):
    free_vector(p)
    if state["armed"] and not state["fired"]:
        state["fired"] = True
        print("interrupting", file=sys.stderr)
        raise KeyboardInterrupt  # what the SIGINT handler raises where the signal lands

def arming(tokens, out):
    def armed():
        for token in tokens:
            yield token
            state["armed"] = True
    return print_stream(armed(), out)

_gen._free_vector, cli._print_stream = interrupted, arming
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_ctrl_c_landing_in_a_destructor_still_exits_130(model_dir: Path) -> None:
    """Python runs the SIGINT handler wherever the main thread is, destructors included, and a
    KeyboardInterrupt raised in one is printed ("Exception ignored ...") and dropped. About one
    Ctrl-C in 120 landed in the destructor of an MLX vector (`_gen._free_vector`, run at every
    evaluation) and `generate` ran on to --max-tokens (the test above then timed out). Here that
    destructor raises it, as the handler would, after the first token."""
    done = subprocess.run([sys.executable, "-c", INTERRUPTED_IN_A_DESTRUCTOR, "generate", str(model_dir),
                           "Once upon a time", "--backend", "metal", "--max-tokens", "2000", "-q"],
                          capture_output=True, text=True, timeout=120, env=_env(), cwd=ROOT, stdin=subprocess.DEVNULL,
                          preexec_fn=_sigint_default)
    assert "interrupting" in done.stderr, done.stderr
    assert done.returncode == 130, done.stderr
    assert "Traceback" not in done.stderr, done.stderr


# ---------------------------------------------------------------------- lora

@pytest.mark.parametrize("option,value,message", [
    ("--learning-rate", "nan", "--learning-rate must be a finite number, not nan"),  # was a traceback at step 1
    ("--alpha", "inf", "--alpha must be a finite number, not inf"),
    ("--weight-decay", "nan", "--weight-decay must be a finite number, not nan"),
    ("--warmup-steps", "-5", "--warmup-steps must be >= 0, not -5"),  # was a negative learning rate, silently
])
def test_lora_numbers_are_checked_before_the_model_loads(option: str, value: str, message: str,
                                                         tmp_path: Path) -> None:
    done = run("lora", str(tmp_path / "no-model"), "--data", str(tmp_path), option, value, "-q")
    one_line_error(done, 1, message)


def test_lora_batch_size_past_the_dataset_is_refused_before_the_model_loads(tmp_path: Path) -> None:
    """--batch-size 32 on 10 examples trained batches of 10 (after loading the model)."""
    (tmp_path / "train.jsonl").write_text("".join(f'{{"text": "line {i}"}}\n' for i in range(10)))
    done = run("lora", str(tmp_path / "no-model"), "--data", str(tmp_path), "--batch-size", "32", "-q")
    one_line_error(done, 1, "--batch-size 32 is larger than the training set", "train.jsonl has only 10 examples")
    done = run("lora", str(tmp_path / "no-model"), "--data", str(tmp_path), "--batch-size", "9", "--valid-split",
               "0.2", "-q")
    one_line_error(done, 1, "has only 8 examples (after holding out 2 for validation)")


def test_a_diverged_training_is_an_error_not_an_internal_one(monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """training raises FloatingPointError naming the step (the loss or the weights went non-finite)."""
    _command(monkeypatch, FloatingPointError("the loss is nan at step 3; lower the learning rate"))
    assert cli.main(["fail-test"]) == 1
    assert capsys.readouterr().err == "pymlxc: error: the loss is nan at step 3; lower the learning rate\n"


# ---------------------------------------------------------------------- chat

def test_chat_reads_a_bounded_line_from_stdin(model_dir: Path) -> None:
    """`pymlxc chat MODEL < /dev/zero` read one endless line into memory. (Finite here: 5 MiB on one
    line, more than the 4 MiB a message may have, so that a regression times out, not exhausts memory.)"""
    done = subprocess.run([sys.executable, "-m", "pymlxc.cli", "chat", str(model_dir), "--backend", "metal",
                           "--max-tokens", "1", "-q"], input=b"\0" * (5 << 20), capture_output=True, timeout=60,
                          env=_env(), cwd=ROOT)
    assert done.returncode == 1, done.stderr
    assert done.stderr.decode().strip() == "pymlxc: error: a message on stdin is longer than 4194304 characters"

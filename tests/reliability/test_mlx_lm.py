"""The mlx_lm backend where it used to hang or kill its worker, each case in a child process."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.reliability.subproc import run_case


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pymlxc.testing import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("reliability-mlx-lm") / "llama", "llama", seed=5)


def test_loading_a_model_with_custom_tokenizer_code_fails_at_once(tiny: Path, tmp_path: Path) -> None:
    """It used to wait the whole load timeout on transformers' "[y/N]" question, asked on the protocol pipe."""
    value = run_case(f"""
        import json, shutil, sys, time
        from pymlxc.backends.mlx_lm import MlxLmBackend, WorkerReplyError
        from pymlxc.options import LoadConfig
        model = {str(tmp_path / "custom")!r}
        shutil.copytree({str(tiny)!r}, model)
        config = json.load(open(model + "/tokenizer_config.json"))
        config["auto_map"] = {{"AutoTokenizer": ["tokenization_custom.CustomTokenizer", None]}}
        json.dump(config, open(model + "/tokenizer_config.json", "w"))
        start = time.monotonic()
        try:
            MlxLmBackend(sys.executable).load(model, LoadConfig())  # the default 600 s load timeout
            report({{"loaded": True}})
        except WorkerReplyError as e:
            report({{"code": e.code, "message": str(e), "seconds": time.monotonic() - start}})
    """, timeout=120)
    assert value["code"] == "load_failed" and "pymlxc never runs" in value["message"]
    assert value["seconds"] < 60


def test_a_nan_temperature_neither_reaches_nor_kills_the_worker(tiny: Path) -> None:
    """It used to be taken for a dead pipe: the healthy worker was killed (signal 9 after 5 s) and reloaded."""
    value = run_case(f"""
        import sys, time
        from pymlxc.backends.mlx_lm import MlxLmBackend
        from pymlxc.options import LoadConfig
        with MlxLmBackend(sys.executable).load({str(tiny)!r}, LoadConfig()) as m:
            pids = m.worker_pids()
            start = time.monotonic()
            try:
                list(m.generate("x", temperature=float("nan"), max_tokens=2))
                raised = None
            except ValueError as e:
                raised = str(e)
            seconds = time.monotonic() - start
            tokens = len(list(m.generate("x", max_tokens=3)))
            report({{"raised": raised, "seconds": seconds, "same_worker": m.worker_pids() == pids, "tokens": tokens}})
    """, timeout=180)
    assert value["raised"] is not None and "temperature" in value["raised"]
    assert value["seconds"] < 1 and value["same_worker"] and value["tokens"] == 3


def test_a_timeout_against_a_worker_that_never_answers_returns_within_a_second(tiny: Path) -> None:
    """A worker frozen mid-stream (SIGSTOP) answers no cancel: the call used to return 10 s after its timeout."""
    value = run_case(f"""
        import os, signal, sys, time
        from pymlxc.backends.mlx_lm import MlxLmBackend
        from pymlxc.options import LoadConfig
        with MlxLmBackend(sys.executable).load({str(tiny)!r}, LoadConfig()) as m:
            [pid] = m.worker_pids()
            start = time.monotonic()
            n = 0
            for _ in m.generate("x", max_tokens=100_000, timeout=1.0):
                n += 1
                if n == 1:
                    os.kill(pid, signal.SIGSTOP)
            report({{"seconds": time.monotonic() - start, "err": repr(m.err()), "tokens": n}})
    """, timeout=120)
    assert value["seconds"] < 1.0 + 1.0 + 0.7  # the timeout, CANCEL_WAIT_S, and slack for this busy machine
    assert "timed out" in value["err"] and value["tokens"] >= 1

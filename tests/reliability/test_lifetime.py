"""close() racing with generations, and calls behind paused streams, in child processes: a crash (a
freed weight used by a running step) or a deadlock fails one test instead of the run."""
from __future__ import annotations

from pathlib import Path

import pytest

from pymlxc.testing import write_tiny_model

from .subproc import run_case


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("lifetime") / "llama", "llama", seed=4)


@pytest.mark.parametrize("compiled", ["1", "0"])
def test_close_while_another_thread_generates(model_dir: Path, compiled: str) -> None:
    # Ten rounds of: a thread iterates generate(max_tokens=500), the main thread closes the model
    # after its first token. Before the fix: FreedArrayError in err(), garbage shapes, segfaults.
    rounds = run_case(f"""
        import threading
        import pymlxc
        out = []
        for _ in range(10):
            m = pymlxc.load_model({str(model_dir)!r}, backend="metal")
            first = threading.Event()
            result = {{}}
            def work():
                n = 0
                try:
                    for _ in m.generate("Once upon a time", max_tokens=500):
                        n += 1
                        first.set()
                except BaseException as exc:
                    result["raised"] = type(exc).__name__
                result["n"] = n
                result["err"] = type(m.err()).__name__
                first.set()
            thread = threading.Thread(target=work)
            thread.start()
            first.wait(60)
            m.close()
            thread.join(60)
            result["alive"] = thread.is_alive()
            out.append(result)
        report(out)
    """, timeout=300, env={"PYMLXC_COMPILE": compiled})
    assert len(rounds) == 10
    for r in rounds:
        assert r == {"n": r["n"], "err": "ModelClosedError", "alive": False}, r
        assert 1 <= r["n"] < 500


@pytest.mark.parametrize("compiled", ["1", "0"])
def test_close_on_the_generating_thread_between_tokens(model_dir: Path, compiled: str) -> None:
    # The stream is paused (inside the for loop's body) when close() frees the weights: its next
    # step must end it before touching them.
    got = run_case(f"""
        import pymlxc
        m = pymlxc.load_model({str(model_dir)!r}, backend="metal")
        n = 0
        for token in m.generate("Once upon a time", max_tokens=200):
            n += 1
            if n == 3:
                m.close()
        report({{"n": n, "err": type(m.err()).__name__}})
    """, timeout=120, env={"PYMLXC_COMPILE": compiled})
    assert got == {"n": 3, "err": "ModelClosedError"}


def test_close_releases_a_call_waiting_for_a_slot(model_dir: Path) -> None:
    # parallel_slots=1: the main thread's paused stream holds the slot, a second thread waits for it;
    # close() ends the waiting call (ModelClosedError, quietly) and the paused stream (when resumed).
    got = run_case(f"""
        import threading, time
        import pymlxc
        m = pymlxc.load_model({str(model_dir)!r}, backend="metal", parallel_slots=1)
        paused = m.generate("Once upon a time", max_tokens=50)
        next(paused)
        result = {{}}
        def waiter():
            result["tokens"] = len(list(m.generate("hi", max_tokens=5)))
            result["err"] = type(m.err()).__name__
            try:
                m.classify(["hi"])
            except Exception as exc:
                result["classify"] = type(exc).__name__
        thread = threading.Thread(target=waiter)
        thread.start()
        time.sleep(0.5)
        started = time.monotonic()
        m.close()
        thread.join(30)
        report({{"waiter": result, "alive": thread.is_alive(), "close_s": time.monotonic() - started,
                 "rest": len(list(paused)), "err": type(m.err()).__name__}})
    """, timeout=120)
    assert got["waiter"] == {"tokens": 0, "err": "ModelClosedError", "classify": "ModelClosedError"}
    assert not got["alive"] and got["close_s"] < 10
    assert (got["rest"], got["err"]) == (0, "ModelClosedError")


def test_a_call_behind_this_threads_only_slot_raises_instead_of_waiting(model_dir: Path) -> None:
    got = run_case(f"""
        import pymlxc
        m = pymlxc.load_model({str(model_dir)!r}, backend="metal")  # parallel_slots=1
        paused = m.generate("Once upon a time", max_tokens=50)
        next(paused)
        out = {{}}
        for name, call in [("generate", lambda: list(m.generate("hi", max_tokens=3))),
                           ("classify", lambda: m.classify(["hi"])),
                           ("batch", lambda: m.batch_generate(["hi"], max_tokens=3)[0].error),
                           ("warm", lambda: m.warm_prompt_cache("hi")),
                           ("inspect", lambda: m.inspect_attention("hi") and None)]:
            try:
                out[name] = call()
            except RuntimeError as exc:
                out[name] = str(exc)
        paused.close()
        out["after"] = len(list(m.generate("hi", max_tokens=3)))
        report(out)
    """, timeout=120)
    for name in ("generate", "classify", "batch", "warm", "inspect"):
        assert "parallel_slots" in got[name] and "this thread" in got[name], (name, got[name])
    assert got["after"] == 3


def test_close_while_another_thread_trains(model_dir: Path, tmp_path: Path) -> None:
    # Training runs as one counted step: close() waits for it, and the run's next step raises
    # ModelClosedError instead of using weights that close() is about to free.
    data = tmp_path / "train.jsonl"
    data.write_text("".join(f'{{"text": "Once upon a time there was a tiny model {i}"}}\n' for i in range(8)))
    result = run_case(f"""
        import threading, time
        import pymlxc
        m = pymlxc.load_model({str(model_dir)!r}, backend="metal")
        started = threading.Event()
        result = {{}}
        def work():
            try:
                pymlxc.train(m, {str(data)!r}, {str(tmp_path / "adapters")!r}, iters=100000, batch_size=2,
                             steps_per_report=1, save_every=100000, progress=False,
                             callback=lambda r: started.set())
                result["raised"] = None
            except BaseException as exc:
                result["raised"] = type(exc).__name__
            started.set()
        thread = threading.Thread(target=work)
        thread.start()
        started.wait(120)
        t0 = time.monotonic()
        m.close()
        result["close_s"] = time.monotonic() - t0
        thread.join(60)
        result["alive"] = thread.is_alive()
        report(result)
    """, timeout=300)
    assert result["raised"] == "ModelClosedError" and not result["alive"], result
    assert result["close_s"] < 20, result

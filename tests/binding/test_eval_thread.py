"""The evaluation thread (pymlxc.core.eval_thread): graphs built here on its stream and scheduled
there give the values of evaluating them here; errors come back as exceptions; the caller's own
stream is untouched outside `building()`."""
from __future__ import annotations

import numpy as np
import pytest

import pymlxc.core as mx
from pymlxc import settings
from pymlxc.core import eval_thread


@pytest.fixture(scope="module")
def worker():
    t = eval_thread.EvalThread(mx.default_device(), name="test-eval")
    yield t
    t.close()


def test_values_equal_evaluating_here(worker) -> None:
    x = mx.array(np.arange(12, dtype=np.float32).reshape(3, 4))
    mx.eval(x)
    here = mx.sum(mx.exp(x * 0.1) @ mx.transpose(x), axis=1)
    with worker.building():
        there = mx.sum(mx.exp(x * 0.1) @ mx.transpose(x), axis=1)
        shown = mx.copy(there)
    worker.submit([there, shown]).wait()
    assert shown.tolist() == here.tolist()  # the same kernels on the same device: identical


def test_pipelined_steps_read_through_copies(worker) -> None:
    """The decode pattern: build step n+1 from step n's (lazy) output while the thread schedules
    step n; read each step through its own copy. 200 steps of a running sum, checked exactly."""
    state = mx.array(np.zeros(4, dtype=np.int32))
    mx.eval(state)
    handles, shown = [], []
    for n in range(1, 201):
        with worker.building():
            state = state + mx.array(n, dtype=mx.int32)
            shown.append(mx.copy(state))
        handles.append(worker.submit([state, shown[-1]]))
        if len(handles) > 1:
            handles[-2].wait()
            assert shown[-2].tolist() == [n * (n - 1) // 2] * 4
    handles[-1].wait()
    assert shown[-1].tolist() == [200 * 201 // 2] * 4


def test_an_array_of_the_callers_stream_fails_cleanly_and_the_thread_lives(worker) -> None:
    lazy = mx.ones((3,)) + 1.0  # built on this thread's stream, not scheduled
    with worker.building():
        y = lazy * 2.0
    with pytest.raises(mx.MLXError, match="Stream"):
        worker.submit([y]).wait()
    assert worker.alive
    mx.eval(lazy)  # once scheduled here, the thread may use it
    with worker.building():
        z = lazy * 2.0
    worker.submit([z]).wait()
    assert z.tolist() == [4.0, 4.0, 4.0]


def test_building_restores_the_callers_stream(worker) -> None:
    before = mx.default_stream()
    with worker.building() as s:
        assert mx.default_stream() is s
    assert mx.default_stream() is before
    a = mx.ones((2,)) * 3.0  # the caller's stream again: evaluating here works
    assert a.tolist() == [3.0, 3.0]


def test_shared_is_one_thread_and_a_closed_thread_refuses_work() -> None:
    dev = mx.default_device()
    assert eval_thread.shared(dev) is eval_thread.shared(dev)
    t = eval_thread.EvalThread(dev, name="test-closed")
    t.close()
    assert not t.alive
    with pytest.raises(RuntimeError, match="stopped"):
        t.submit([mx.ones((1,))])


@pytest.mark.parametrize(("value", "expected"), [("1", True), ("0", False), ("off", False), ("yes", True)])
def test_enabled_follows_the_environment(value: str, expected: bool) -> None:
    with settings.override(**vars(settings.Settings.from_env({eval_thread.ENV_VAR: value}))):
        assert eval_thread.enabled(mx.cpu) is expected


def test_enabled_by_default_on_gpus_only() -> None:
    with settings.override(eval_thread="auto"):
        assert eval_thread.enabled(mx.Device("gpu")) is True
        assert eval_thread.enabled(mx.cpu) is False

"""ThreadSetting, behind shapeless_trace, mlx_kernels_only and layer_listener: a value set for a
`with` block on one thread, invisible to other threads, restored on leaving (also on an error)."""
from __future__ import annotations

import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pymlxc.backends.metal import kernel_choice, nn
from pymlxc.backends.metal.thread_setting import ThreadSetting


@given(st.lists(st.integers(), max_size=6))
def test_nested_blocks_restore_each_value(values: list[int]) -> None:
    setting = ThreadSetting(-1)

    def enter(rest: list[int], outer: int) -> None:
        if not rest:
            return
        with setting.set(rest[0]):
            assert setting.get() == rest[0]
            enter(rest[1:], rest[0])
        assert setting.get() == outer

    enter(values, -1)
    assert setting.get() == -1


def test_value_is_per_thread_and_restored_after_an_error() -> None:
    setting = ThreadSetting("default")
    seen: list[str] = []
    with setting.set("here"):
        worker = threading.Thread(target=lambda: seen.append(setting.get()))
        worker.start()
        worker.join()
        assert setting.get() == "here"
    assert seen == ["default"]
    with pytest.raises(RuntimeError), setting.set("failing"):
        raise RuntimeError("boom")
    assert setting.get() == "default"


def test_backend_switches_use_it() -> None:
    assert kernel_choice.kernels_allowed()
    with kernel_choice.mlx_kernels_only():
        assert not kernel_choice.kernels_allowed()
    assert kernel_choice.kernels_allowed()
    assert not nn._shapeless.get()
    with nn.shapeless_trace():
        assert nn._shapeless.get()
    assert not nn._shapeless.get()

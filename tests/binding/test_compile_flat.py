"""`Compiled.call_flat` and `FixedArrays`: the flat calling convention the compiled decode step uses."""
from __future__ import annotations

import gc

import numpy as np
import pytest

import pymlxc.core as mx
from pymlxc.core import FreedArrayError
from pymlxc.core.transforms import FixedArrays


def step(xs: list[mx.Array]) -> list[mx.Array]:
    x, state, w1, w2 = xs
    return [mx.tanh(x @ w1 + state), state + mx.sum(w2)]


def test_call_flat_with_and_without_tail() -> None:
    w1, w2 = mx.random.normal((4, 4), key=mx.random.key(0)), mx.ones((3,))
    x, state = mx.ones((2, 4)), mx.zeros((2, 4))
    f = mx.compile(step)
    want = step([x, state, w1, w2])
    plain = f.call_flat([x, state, w1, w2])
    tail = FixedArrays([w1, w2])
    with_tail = f.call_flat([x, state], tail)
    for a, b, c in zip(want, plain, with_tail, strict=True):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-6)
        np.testing.assert_allclose(np.array(a), np.array(c), rtol=1e-6)
    # Replayed with new per-call inputs, the same tail.
    again = f.call_flat([with_tail[0], with_tail[1]], tail)
    np.testing.assert_allclose(np.array(again[1]), np.array(state + 6.0), rtol=1e-6)


def test_tail_holds_its_own_references() -> None:
    """Freeing a given Array afterwards changes nothing for the FixedArrays (it owns handles to the
    same arrays); a freed Array cannot be given; a released FixedArrays cannot be called."""
    w1, w2 = mx.ones((4, 4)), mx.ones((3,)) * 2.0
    f = mx.compile(step)
    tail = FixedArrays([w1, w2])
    inputs = [mx.ones((2, 4)), mx.zeros((2, 4))]
    want = [np.array(a) for a in f.call_flat(inputs, tail)]
    w2.free()
    got = [np.array(a) for a in f.call_flat(inputs, tail)]
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)
    with pytest.raises(FreedArrayError):
        FixedArrays([w1, w2])
    tail.release()
    with pytest.raises(FreedArrayError, match="released"):
        f.call_flat(inputs, tail)


def test_releasing_the_tail_frees_its_arrays() -> None:
    gc.collect()
    mx.clear_cache()
    before = mx.get_active_memory()
    w = mx.ones((256, 1024))
    mx.eval(w)
    tail = FixedArrays([w])
    w.free()
    assert mx.get_active_memory() >= before + 256 * 1024 * 4  # still held by the tail
    tail.release()
    mx.synchronize()  # a GPU backend drops a kernel's inputs only once the device has run it
    assert mx.get_active_memory() <= before


def test_tree_helpers_leave_no_cycles() -> None:
    """tree_flatten/unflatten (used by every compiled call) keep no arrays alive after returning."""
    from pymlxc.core.transforms import tree_flatten, tree_unflatten

    gc.collect()
    gc.disable()
    try:
        a = mx.ones((8,))
        leaves, treedef = tree_flatten({"x": [a, (a,)]})
        tree_unflatten(leaves, treedef)
        del leaves
        assert not [o for o in gc.get_objects() if type(o) is list and any(x is a for x in o)]
    finally:
        gc.enable()


def test_compile_modes_trace_the_same_values() -> None:
    """A function traced with elementwise fusion off ("no_fuse") or with compile off ("disabled")
    gives the fused trace's values; "disabled" runs the Python function at every call (the mode is
    really set); an unknown mode is refused by name."""
    x = mx.array([[-2.0, -0.5, 0.0, 0.5, 3.0]])
    calls = []

    def silu_scaled(xs: list[mx.Array]) -> list[mx.Array]:
        calls.append(1)
        return [mx.sigmoid(xs[0]) * xs[0] * 1.5]

    def later_call(mode: str) -> list[float]:
        """The values of a third call, with `calls` counting only that call."""
        mx.set_compile_mode(mode)
        fn = mx.compile(silu_scaled)
        fn([x]), fn([x])  # the trace (the first function compiled in a process traces twice)
        calls.clear()
        return fn([x])[0].tolist()

    try:
        want = later_call("enabled")
        assert calls == []  # replayed
        for mode in ("no_fuse", "no_simplify"):
            assert later_call(mode) == want, mode
            assert calls == [], mode
        assert later_call("disabled") == want
        assert calls == [1]  # not compiled: the function ran
    finally:
        mx.set_compile_mode("enabled")
    with pytest.raises(ValueError, match="no_fuse"):
        mx.set_compile_mode("fast")

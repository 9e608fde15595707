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
    for a, b, c in zip(want, plain, with_tail):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-6)
        np.testing.assert_allclose(np.array(a), np.array(c), rtol=1e-6)
    # Replayed with new per-call inputs, the same tail.
    again = f.call_flat([with_tail[0], with_tail[1]], tail)
    np.testing.assert_allclose(np.array(again[1]), np.array(state + 6.0), rtol=1e-6)


def test_freed_tail_array_raises() -> None:
    w1, w2 = mx.ones((4, 4)), mx.ones((3,))
    f = mx.compile(step)
    tail = FixedArrays([w1, w2])
    w2.free()
    with pytest.raises(FreedArrayError):
        f.call_flat([mx.ones((2, 4)), mx.zeros((2, 4))], tail)
    with pytest.raises(FreedArrayError):
        FixedArrays([w1, w2])


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

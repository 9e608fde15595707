"""pymlxc.core.distributed: a process alone is a group of one (every collective the identity); two
processes over the ring (127.0.0.1) sum, gather, reduce, scatter and pass arrays as mlx.core does;
errors name what is wrong."""
from __future__ import annotations

import sys
import textwrap

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import pymlxc.core as mx
from pymlxc.core import MLXError
from pymlxc.core import distributed as dist
from pymlxc.launch import run_local
from tests.distributed.helpers import result_of


def test_availability() -> None:
    assert dist.is_available() is True
    assert dist.is_available("ring") is True
    with pytest.raises(ValueError, match="unknown distributed backend 'tcp'"):
        dist.is_available("tcp")
    with pytest.raises(TypeError, match="backend must be a str"):
        dist.init(backend=3)  # type: ignore[arg-type]


def test_a_process_alone_is_a_group_of_one() -> None:
    g = dist.init()
    assert (g.rank(), g.size()) == (0, 1)
    assert repr(g) == "Group(rank=0, size=1)"
    with pytest.raises(MLXError, match="Cannot split"):
        g.split(0)
    with pytest.raises(ValueError, match="dst=1 is not a rank of a group of size 1"):
        dist.send(mx.ones(2), 1)
    with pytest.raises(MLXError, match="send: Cannot send to a singleton group"):
        dist.send(mx.ones(2), 0)


def test_strict_init_without_a_launcher_says_why() -> None:
    with pytest.raises(MLXError, match="MLX_RANK"):
        dist.init(strict=True, backend="ring")


@settings(max_examples=25, deadline=None)
@given(hnp.arrays(np.float32, hnp.array_shapes(min_dims=1, max_dims=3, max_side=5),
                  elements=st.floats(-1e3, 1e3, width=32)))
def test_collectives_of_one_process_are_the_identity(x: np.ndarray) -> None:
    a = mx.array(x)
    for op in (dist.all_sum, dist.all_max, dist.all_min, dist.all_gather, dist.sum_scatter):
        np.testing.assert_array_equal(np.array(op(a)), x, err_msg=op.__name__)


TWO_RANKS = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, TESTS); import conftest  # noqa
    import numpy as np
    import pymlxc.core as mx
    from pymlxc.core import distributed as dist
    g = dist.init(strict=True, backend="ring")
    r = g.rank()
    x = mx.array(np.arange(4, dtype=np.float32) + 10 * r)
    out = dict(rank=r, size=g.size(), sum=dist.all_sum(x).tolist(), max=dist.all_max(x).tolist(),
               min=dist.all_min(x, group=g).tolist(), gather=dist.all_gather(x).tolist())
    try:  # the ring backend has no reduce-scatter: MLX's error, not a crash
        out["scatter"] = dist.sum_scatter(x).tolist()
    except Exception as exc:
        out["scatter"] = f"{type(exc).__name__}: {exc}"
    if r == 0:
        s = dist.send(mx.array([[1.5, 2.5]]), 1, group=g); mx.eval(s)
        out["passed"] = dist.recv([3], mx.int32, 1).tolist()
    else:
        out["passed"] = dist.recv_like(mx.zeros((1, 2)), 0).tolist()
        mx.eval(dist.send(mx.array([7, 8, 9], mx.int32), 0))
    print("RESULT " + json.dumps(out), flush=True)
""")


def test_two_processes_over_the_ring() -> None:
    from pathlib import Path

    code = TWO_RANKS.replace("TESTS", repr(str(Path(__file__).resolve().parents[1])))
    results = [result_of(r.stdout) for r in run_local(2, [sys.executable, "-c", code], timeout=120)]
    for r, got in enumerate(results):
        assert got["rank"] == r and got["size"] == 2
        assert got["sum"] == [10, 12, 14, 16]
        assert got["max"] == [10, 11, 12, 13] and got["min"] == [0, 1, 2, 3]
        assert got["gather"] == [0, 1, 2, 3, 10, 11, 12, 13]
        assert got["scatter"] == "MLXError: [ring] sum_scatter not supported."
    assert results[0]["passed"] == [7, 8, 9]
    assert results[1]["passed"] == [[1.5, 2.5]]

"""Deliberate errors: each raises MLXError (or a subclass) with MLX's own message, and the process
goes on working."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import mlx.core as mlx
import pytest

import pymlxc.core as mx
from pymlxc.core import FreedArrayError, MLXError


def mlx_message(fn) -> str:  # noqa: ANN001
    """The message mlx.core gives for the same mistake (it raises ValueError)."""
    with pytest.raises(Exception) as info:
        fn()
    return str(info.value)


CASES = {
    "broadcast mismatch": (lambda m: m.add(m.ones((2, 3)), m.ones((4,))),
                           "[broadcast_shapes] Shapes (2,3) and (4) cannot be broadcast."),
    "bad reshape": (lambda m: m.reshape(m.ones((2, 3)), (4,)),
                    "[reshape] Cannot reshape array of size 6 into shape (4)."),
    "matmul of ints": (lambda m: m.matmul(m.ones((2, 2), m.int32), m.ones((2, 2), m.int32)),
                       "[matmul] Only inexact types"),
    "quantize an int array": (lambda m: m.quantize(m.ones((32, 64), m.int32)), "[quantize] Only real floating types"),
    "matmul shapes": (lambda m: m.matmul(m.ones((2, 3)), m.ones((2, 3))), "[matmul]"),
    "concatenate shapes": (lambda m: m.concatenate([m.ones((2, 3)), m.ones((2, 4))], axis=0), "[concatenate]"),
    "invalid axis": (lambda m: m.sum(m.ones((2, 3)), axis=5), "Invalid axis 5"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_mlx_errors_raise_mlxerror_with_mlx_message(case: str) -> None:
    make, expected = CASES[case]
    with pytest.raises(MLXError) as info:
        make(mx)
    assert expected in str(info.value)
    assert str(info.value) == mlx_message(lambda: make(mlx))  # word for word what MLX says
    assert "mlx/c/" not in str(info.value)  # mlx-c's source location is trimmed off
    # ... and the process carries on, with no stale error left behind
    assert (mx.ones((2,)) + 1).tolist() == [2.0, 2.0]


def test_operator_errors_too() -> None:
    with pytest.raises(MLXError, match="cannot be broadcast"):
        mx.ones((2, 3)) + mx.ones((4,))
    with pytest.raises(MLXError, match=r"\[matmul\]"):
        mx.ones((2, 3)) @ mx.ones((2, 3))
    with pytest.raises(MLXError):
        -mx.array([True])  # MLX: "Not supported for bool, use logical_not instead"
    a = mx.ones((2, 3))
    with pytest.raises(MLXError, match="cannot be broadcast"):
        a[0] = mx.ones((4,))
    assert a.tolist() == [[1.0] * 3] * 2  # a failed assignment changes nothing


def test_use_after_free() -> None:
    a = mx.array([1.0, 2.0])
    b = a * 2
    a.free()
    a.free()  # idempotent
    assert a.is_freed and repr(a) == "array(<freed>)"
    for use in [lambda: a + 1, lambda: 1 + a, lambda: a + b, lambda: mx.add(a, b), lambda: mx.sum(a),
                lambda: a.tolist(), lambda: a[0], lambda: mx.eval(a), lambda: mx.concatenate([a, b]),
                lambda: mx.where(a > 0, a, b), lambda: mx.clip(b, a, None), lambda: a.item()]:
        with pytest.raises(FreedArrayError, match="after free"):
            use()
    assert issubclass(FreedArrayError, MLXError)
    assert b.tolist() == [2.0, 4.0]  # arrays computed from it are independent
    with mx.array([3.0]) as c:
        assert c.item() == 3.0
    assert c.is_freed


def test_errors_of_submodules_and_transforms() -> None:
    x = mx.array([1.0, 2.0])
    with pytest.raises(MLXError, match="square"):
        mx.linalg.inv(mx.ones((2, 3)), stream=mx.cpu)
    with pytest.raises(MLXError, match="cotangent"):
        mx.grad(lambda v: v * 2)(x)  # not a scalar loss
    assert mx.sum(x).item() == 3.0


def test_a_failing_call_in_a_subprocess_leaves_it_alive() -> None:
    """mlx-c's default error handler calls exit(); ours must keep the process running to the end."""
    code = textwrap.dedent("""
        import pymlxc.core as mx
        for _ in range(3):
            try:
                mx.reshape(mx.ones((2, 3)), (4,))
            except mx.MLXError as exc:
                print("caught:", exc)
        a = mx.ones((2,)); a.free()
        try:
            a + 1
        except mx.FreedArrayError:
            print("freed")
        print("still alive", (mx.ones((2,)) * 3).tolist())
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("caught: [reshape] Cannot reshape") == 3
    assert "freed" in out.stdout and "still alive [3.0, 3.0]" in out.stdout

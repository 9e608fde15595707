"""The typed declarations of the generated wrappers (pymlxc/core/_generated.pyi): the committed stub is
what `_stubgen` writes from the signatures now, it describes the functions as they are made, and a
type checker reading it accepts typed code on `pymlxc.core` and refuses wrong code."""
from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

import pytest

import pymlxc.core as mx
from pymlxc.core import _generated, _stubgen
from pymlxc.core._gen import RAW

ROOT = Path(__file__).resolve().parents[2]


def test_the_committed_stub_is_what_the_generator_writes_now() -> None:
    committed = _stubgen.STUB.read_text()
    assert committed == _stubgen.render(), "run: python -m pymlxc.core._stubgen"
    assert _stubgen.main(["--check"]) == 0


def test_check_mode_refuses_a_stale_stub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    stale = tmp_path / "_generated.pyi"
    stale.write_text(_stubgen.render().replace("def abs(", "def abs_old(", 1))
    monkeypatch.setattr(_stubgen, "STUB", stale)
    assert _stubgen.main(["--check"]) == 1
    assert "out of date" in capsys.readouterr().err


def test_every_wrapper_is_annotated_parameter_by_parameter() -> None:
    for name, fn in RAW.items():
        params = list(inspect.signature(fn).parameters)
        annotations = dict(fn.__annotations__)
        returned = annotations.pop("return")
        assert sorted(annotations) == sorted(params), name
        assert params[-1] == "stream" and annotations["stream"] == "StreamLike", name
        assert returned == "Array" or returned == "list[Array]" or returned.startswith("tuple["), name
        assert getattr(_generated, name) is fn  # the module the stub describes holds the wrapper itself


def test_the_stub_exports_exactly_the_wrappers_ops_reexports() -> None:
    exported = _stubgen.reexported()
    assert exported and "sum" not in exported and "load" not in exported  # redefined in ops / io.load
    for name in exported:
        assert getattr(mx, name) is RAW[name]
    header = _stubgen.render().split("\ndef ", 1)[0]
    for name in exported:
        assert f'"{name}"' in header


GOOD = '''
import pymlxc.core as mx

a = mx.array([[1.0, 2.0], [3.0, 4.0]])
b: mx.Array = mx.exp(a) * 2.0 + 1 - a @ a / mx.sqrt(a)
c: mx.Array = (a > 0.5) & (a < 3.0)
d: mx.Array = a.sum(axis=0, keepdims=True).astype(mx.float16).reshape(1, 2).T[0]
e: list[mx.Array] = mx.split(a, 2)
f: mx.Array = mx.fft.fft(a, axis=0)
g: mx.Array = -abs(a) + mx.maximum(a, 0.0, stream=mx.cpu)
'''

BAD = '''
import pymlxc.core as mx

a = mx.array([1.0, 2.0])
wrong_result: int = mx.exp(a)
wrong_argument = mx.sum_axis(a, "0")
wrong_operator: str = a + 1
'''


def _mypy(tmp_path: Path, source: str) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "probe.py"
    path.write_text(source)
    return subprocess.run([sys.executable, "-m", "mypy", "--strict", "--no-incremental", str(path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def test_a_type_checker_reads_ops_and_operators_from_the_declarations(tmp_path: Path) -> None:
    good = _mypy(tmp_path, GOOD)
    assert good.returncode == 0, good.stdout + good.stderr
    bad = _mypy(tmp_path, BAD)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert 'probe.py:5: error: Incompatible types in assignment (expression has type "Array"' in bad.stdout
    assert 'probe.py:6: error: Argument 2 to "sum_axis" has incompatible type "str"' in bad.stdout
    assert 'probe.py:7: error: Incompatible types in assignment (expression has type "Array"' in bad.stdout

"""benchmarks/profile/ab.py on the CPU: the cases run in turn, a process each, and the report has
every run, each case's median and whether the tokens agree; a case whose process fails is recorded
with its error while the others go on; a malformed case is refused."""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest

from pymlxc.testing import write_tiny_model

PROFILE = Path(__file__).resolve().parents[2] / "benchmarks" / "profile"
sys.path.insert(0, str(PROFILE))
import ab  # noqa: E402 - a benchmark script, importable from its folder


def test_the_cases_alternate_and_a_failing_one_is_recorded(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                                           ) -> None:
    model = write_tiny_model(tmp_path / "tiny", hidden_size=64, num_layers=2)
    out = tmp_path / "ab.json"
    code = ab.main([str(model), "--case", "thread", "PYMLXC_EVAL_THREAD=1", "--case", "inline", "PYMLXC_EVAL_THREAD=0",
                    "--case", "bad", "PYMLXC_EVAL_THREAD=sometimes", "--rounds", "2", "--runs", "2",
                    "--max-tokens", "6", "--timeout", "240", "--out", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    cases = report["cases"]
    assert list(cases) == ["thread", "inline", "bad"]
    assert cases["inline"]["env"] == {"PYMLXC_EVAL_THREAD": "0"}
    for name in ("thread", "inline"):
        processes = cases[name]["processes"]
        assert [p["round"] for p in processes] == [1, 2] and not any("error" in p for p in processes)
        runs = [r for p in processes for r in p["runs"]]
        assert len(runs) == 4 and all(r["decode_tps"] > 0 and r["generated"] == 6 for r in runs)
        summary = report["summary"]["cases"][name]
        assert summary["decode_tps"] == [r["decode_tps"] for r in runs]
        assert summary["median"] == pytest.approx(statistics.median(summary["decode_tps"]))
        assert all(low <= high for low, high in summary["us_per_token"].values())
    # The eval thread moves no token: every run of both cases gave the same ones.
    assert report["summary"]["same_tokens"]
    bad = cases["bad"]["processes"]
    assert len(bad) == 2 and all(p["runs"] == [] and "PYMLXC_EVAL_THREAD" in p["error"] for p in bad)
    assert report["summary"]["cases"]["bad"]["failed_processes"] == 2
    assert report["summary"]["cases"]["bad"]["median"] is None
    printed = capsys.readouterr().out
    assert printed.index("round 1 thread") < printed.index("round 1 inline") < printed.index("round 2 thread")


@pytest.mark.parametrize("case", [["off", "PYMLXC_X"], ["off", "=1"]])
def test_a_case_word_without_a_value_is_refused(tmp_path: Path, case: list[str]) -> None:
    with pytest.raises(SystemExit):
        ab.main([str(tmp_path), "--case", *case, "--out", str(tmp_path / "x.json")])
    assert not (tmp_path / "x.json").exists()


def test_repeated_case_names_are_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        ab.main([str(tmp_path), "--case", "a", "X=1", "--case", "a", "X=2", "--out", str(tmp_path / "x.json")])

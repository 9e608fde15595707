"""BENCHMARKS.md shows what benchmarks/results/<device>.json hold, and `compare_mlx_lm.py --merge`
keeps the latest run of each case with the commit, date and command that measured it."""
from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT / "benchmarks"))
import compare_mlx_lm  # noqa: E402

DEVICES = sorted(p for p in RESULTS.glob("*.json")
                 if isinstance(report := json.loads(p.read_text()), dict) and report.get("kind") == "compare_mlx_lm")


def test_there_are_results_for_the_gpu_and_this_cpu() -> None:
    assert {p.stem for p in DEVICES} >= {"h100", "cpu"}


@pytest.mark.parametrize("path", DEVICES, ids=lambda p: p.stem)
def test_the_page_shows_each_device_file_as_merged(path: Path) -> None:
    report = json.loads(path.read_text())
    for case in report["cases"]:
        run = case["run"]
        assert run["command"].startswith("python benchmarks/compare_mlx_lm.py --shapes " + case["shape"])
        assert run["versions"]["pymlxc_git"] and run["date"]
    page = (ROOT / "BENCHMARKS.md").read_text()
    table = compare_mlx_lm.results_page_table(report)
    assert table in page, f"BENCHMARKS.md does not show {path.name} as merged: regenerate its table"
    assert (path.with_suffix(".png")).is_file(), f"{path.name} has no chart beside it"


def test_merge_keeps_the_latest_run_of_each_case(tmp_path: Path) -> None:
    base = json.loads((RESULTS / "cpu.json").read_text())
    for case in base["cases"]:
        case.pop("run")
    old = dict(base, date="2026-01-01T00:00:00+00:00", versions=dict(base["versions"], pymlxc_git="aaaaaaa"))
    new = copy.deepcopy(dict(base, date="2026-02-01T00:00:00+00:00", versions=dict(base["versions"], pymlxc_git="bbbbbbb")))
    new["cases"] = new["cases"][:1]
    new["cases"][0]["sides"]["pymlxc"]["decode_tps"]["median"] = 12345.0
    (tmp_path / "old.json").write_text(json.dumps(old))
    (tmp_path / "new.json").write_text(json.dumps(new))
    out = tmp_path / "merged" / "dev.json"
    # The newer file first on the command line: the dates decide, not the order.
    assert compare_mlx_lm.merge([tmp_path / "new.json", tmp_path / "old.json"], out) == 0
    merged = json.loads(out.read_text())
    assert len(merged["cases"]) == len(base["cases"])
    commits = [c["run"]["versions"]["pymlxc_git"] for c in merged["cases"]]
    first = merged["cases"][0]
    assert first["shape"] == new["cases"][0]["shape"] and first["prompt_tokens"] == new["cases"][0]["prompt_tokens"]
    assert commits[0] == "bbbbbbb" and set(commits[1:]) == {"aaaaaaa"}
    assert first["sides"]["pymlxc"]["decode_tps"]["median"] == 12345.0
    assert first["run"]["source"] == "new.json" and merged["date"] == new["date"]
    # Merging the merged file again changes nothing.
    again = tmp_path / "again.json"
    assert compare_mlx_lm.merge([out], again) == 0
    assert json.loads(again.read_text())["cases"] == merged["cases"]

"""A killed rank ends the others with an error within 30 s; sizes that cannot be split, and a
process that was not launched as a rank, get errors that say why."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from pymlxc.launch import LaunchError, run_local
from pymlxc.testing import write_tiny_model
from tests.reliability.subproc import run_case

from .helpers import WORKER, ranks, result_of


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("dist") / "llama", "llama", num_layers=2)


@pytest.mark.parametrize("mode", ["tensor", "pipeline"])
def test_a_killed_rank_ends_the_others_with_an_error(llama: Path, mode: str) -> None:
    started = time.monotonic()
    with pytest.raises(LaunchError, match=r"rank \d (exited with status|was killed)") as info:
        # grace 30: the survivor must end on its own, with an error, before the launcher would kill it.
        run_local(2, [sys.executable, WORKER, str(llama), mode, "--tokens", "64", "--die-rank", "1"],
                  timeout=120, grace=30)
    assert time.monotonic() - started < 60
    assert [r.returncode for r in info.value.results] == [3, 7]  # rank 0 ended itself (worker's error status)


def test_the_survivor_reports_a_lost_peer(llama: Path) -> None:
    with pytest.raises(LaunchError) as info:
        run_local(2, [sys.executable, WORKER, str(llama), "tensor", "--tokens", "64", "--die-rank", "1"],
                  timeout=120, grace=30)
    survivor = info.value.results[0]
    assert survivor.returncode == 3, survivor.stderr[-2000:]  # ended by itself, not by the launcher
    got = result_of(survivor.stdout)
    assert "connection to a peer was lost" in got["error"]
    assert got["after_s"] < 30


def test_heads_not_divisible_by_the_ranks(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "m", "llama", num_heads=3, num_kv_heads=3, hidden_size=48, num_layers=2)
    with pytest.raises(LaunchError) as info:
        ranks(2, model, "tensor", timeout=120)
    assert "needs the attention heads divisible by 2" in str(info.value)
    assert "3 query heads and 3 key/value heads" in str(info.value)


def test_quantized_columns_not_whole_groups(tmp_path: Path) -> None:
    # 64 MLP columns in groups of 64 cannot be halved at a group boundary.
    model = write_tiny_model(tmp_path / "m", "llama", quantize_bits=4, group_size=64, intermediate_size=64,
                             num_layers=2)
    with pytest.raises(LaunchError) as info:
        ranks(2, model, "tensor", timeout=120)
    assert "o_proj: 64 inputs in groups of 64 cannot be split in 2 equal parts" in str(info.value)


def test_more_pipeline_ranks_than_layers(llama: Path) -> None:
    with pytest.raises(LaunchError) as info:
        run_local(4, [sys.executable, WORKER, str(llama), "pipeline"], timeout=120)
    assert "needs at least 4 layers; the model has 2" in str(info.value)


def test_a_process_not_launched_as_a_rank(llama: Path) -> None:
    got = run_case(f"""
        import pymlxc
        try:
            pymlxc.load_model({str(llama)!r}, distributed="tensor")
        except Exception as exc:
            report([type(exc).__name__, str(exc)])
    """, timeout=120)
    assert got[0] == "ShardingError"
    assert "pymlxc launch -n N" in got[1] and "Couldn't initialize any backend" in got[1]


def test_a_bad_mode_is_refused_at_the_call(llama: Path) -> None:
    import pymlxc

    with pytest.raises(ValueError, match="distributed must be one of 'tensor', 'pipeline' or None, not 'data'"):
        pymlxc.load_model(str(llama), distributed="data")


def test_timeout_is_refused_on_a_distributed_model(llama: Path) -> None:
    results = run_local(2, [sys.executable, "-c", f"""
import sys; sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r}); import conftest, json, pymlxc
with pymlxc.load_model({str(llama)!r}, distributed="pipeline") as m:
    try:
        list(m.generate("hi", max_tokens=2, timeout=5.0))
    except ValueError as exc:
        print("RESULT " + json.dumps(str(exc)))
"""], timeout=120)
    for r in results:
        assert "timeout and cancel are not supported on a distributed model" in result_of(r.stdout)

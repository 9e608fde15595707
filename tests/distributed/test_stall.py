"""A rank that stalls (SIGSTOP: alive, its sockets open, silent) ends the others with an error that
names it within a bounded time (the watchdog's timeout), never a hang; the launcher then ends the
stopped one. Each case runs its ranks as child processes under a timeout (`run_local`)."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from pymlxc.backends.metal.distributed.watchdog import PEER_STALLED_EXIT, STALL_TIMEOUT, rank0_host
from pymlxc.launch import LaunchError, run_local
from pymlxc.testing import write_tiny_model

from .helpers import WORKER


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("stall") / "llama", "llama", num_layers=2)


@pytest.mark.parametrize("mode,stopped", [("tensor", 1), ("pipeline", 0)])
def test_a_stopped_rank_ends_the_others_within_the_timeout(llama: Path, mode: str, stopped: int) -> None:
    survivor = 1 - stopped
    started = time.monotonic()
    with pytest.raises(LaunchError, match=rf"rank {survivor} exited with status {PEER_STALLED_EXIT}") as info:
        # The run's own timeout (120 s) would end a hang: the survivor must end long before it.
        run_local(2, [sys.executable, WORKER, str(llama), mode, "--tokens", "64", "--stop-rank", str(stopped)],
                  timeout=120, grace=5)
    assert time.monotonic() - started < STALL_TIMEOUT + 30
    results = info.value.results
    assert results[survivor].returncode == PEER_STALLED_EXIT
    assert results[stopped].returncode is None  # still stopped: the launcher killed it
    err = results[survivor].stderr
    if survivor == 0:
        assert f"rank {stopped} sent no heartbeat for" in err, err[-2000:]
    else:  # rank 0 stalled: the survivor heard nothing from it
        assert "rank 0 sent no heartbeat for" in err, err[-2000:]


def test_ranks_that_end_normally_are_not_taken_for_stalled(llama: Path) -> None:
    """Rank 1 finishes and says goodbye; rank 0 then sleeps past the timeout and still ends well."""
    code = f"""
import sys, time; sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r}); import conftest, pymlxc
with pymlxc.load_model({str(llama)!r}, distributed="tensor") as m:
    list(m.generate("hi", max_tokens=2))
    rank = pymlxc.core.distributed.init().rank()
if rank == 0:
    time.sleep({STALL_TIMEOUT + 3})
print("done", rank)
"""
    results = run_local(2, [sys.executable, "-c", code], timeout=120)
    assert [r.returncode for r in results] == [0, 0]
    assert [r.stdout.split()[-2:] for r in results] == [["done", "0"], ["done", "1"]]


@pytest.mark.parametrize("env,want", [
    ({"MLX_HOSTFILE": "HOSTS", "hosts": '[["10.1.2.3:5000"], ["10.1.2.4:5000"]]'}, "10.1.2.3"),
    ({"MLX_HOSTFILE": "HOSTS", "hosts": '[{"ssh": "a", "ips": ["10.9.9.9"]}]'}, "10.9.9.9"),
    ({"NCCL_HOST_IP": "10.0.0.7"}, "10.0.0.7"),
    ({"MLX_JACCL_COORDINATOR": "10.0.0.8:1234"}, "10.0.0.8"),
    ({}, "127.0.0.1"),
])
def test_rank0_address_from_the_launcher(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, env: dict[str, str],
                                         want: str) -> None:
    for var in ("MLX_HOSTFILE", "NCCL_HOST_IP", "MLX_JACCL_COORDINATOR"):
        monkeypatch.delenv(var, raising=False)
    if "hosts" in env:
        (tmp_path / "hosts.json").write_text(env["hosts"])
        monkeypatch.setenv("MLX_HOSTFILE", str(tmp_path / "hosts.json"))
    for var, value in env.items():
        if var not in ("MLX_HOSTFILE", "hosts"):
            monkeypatch.setenv(var, value)
    assert rank0_host() == want

"""Start N processes of one command on this machine as the ranks of an MLX distributed group, and
watch them: `pymlxc launch -n N -- COMMAND...` (the ring backend over 127.0.0.1, or NCCL with one
GPU per rank). For several machines, MLX's own launcher does the same over ssh (`mlx.launch
--hosts ...`, docs/distributed.md).

Every rank runs the same command; rank 0's output is shown, the others' only when they fail. When
a rank ends with an error or is killed, the others get `grace` seconds to end on their own (a ring
peer sees the lost connection at once) and are then killed, so a launch never hangs on a dead rank;
`timeout` bounds the whole run.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

LAUNCH_BACKENDS = ("ring", "nccl")


class LaunchError(RuntimeError):
    """A rank failed, or the run outlived its timeout; the message names the rank and its end.
    `results`: every rank's result (returncode None: killed by the launcher)."""

    def __init__(self, message: str, results: list[RankResult]) -> None:
        super().__init__(message)
        self.results = results


@dataclass
class RankResult:
    rank: int
    returncode: int | None  # None: killed by the launcher
    stdout: str
    stderr: str


def free_ports(n: int) -> list[int]:
    """n TCP ports free on 127.0.0.1 now (held open together so that they differ)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def rank_environments(n: int, backend: str, workdir: Path) -> list[dict[str, str]]:
    """The environment each rank needs to join the group (what mlx.launch sets)."""
    if backend == "ring":
        hostfile = workdir / "hosts.json"
        hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(n)]))
        return [{"MLX_RANK": str(r), "MLX_HOSTFILE": str(hostfile)} for r in range(n)]
    if backend == "nccl":
        port = free_ports(1)[0]
        # NCCL_NVLS_ENABLE=0: no NVLink multicast (NVLS), which on shared hosts can take every GPU of the
        # host out of service; plain all-reduce over NVLink/PCIe is what tensor parallelism needs here.
        return [{"MLX_RANK": str(r), "MLX_WORLD_SIZE": str(n), "NCCL_HOST_IP": "127.0.0.1", "NCCL_PORT": str(port),
                 "CUDA_VISIBLE_DEVICES": str(r), "NCCL_NVLS_ENABLE": "0"} for r in range(n)]
    raise ValueError(f"backend must be one of {', '.join(LAUNCH_BACKENDS)}, not {backend!r}")


def _describe(code: int | None) -> str:
    if code is None:
        return "was killed by the launcher"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def run_local(n: int, command: Sequence[str], *, backend: str = "ring", timeout: float | None = None,
              grace: float = 10.0, env: dict[str, str] | None = None, echo: bool = False,
              stdin: int | None = None) -> list[RankResult]:
    """Run `command` as ranks 0..n-1 here; return every rank's result once all have ended. Raises
    LaunchError naming the first rank that failed (with its stderr's end) or the timeout.
    `echo`: rank 0's stdout is copied to this process's as it comes. `stdin`: a file descriptor whose
    input every rank reads on its stdin, each a copy as it comes (the ranks run the same steps, so
    they need the same input); None: /dev/null."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"the number of ranks must be an int >= 1, not {n!r}")
    if not command:
        raise ValueError("no command to launch")
    with tempfile.TemporaryDirectory(prefix="pymlxc-launch-") as tmp:
        envs = rank_environments(n, backend, Path(tmp))
        procs: list[subprocess.Popen[bytes]] = []
        logs = []
        try:
            for r in range(n):
                out = open(Path(tmp) / f"rank{r}.out", "w+b")  # noqa: SIM115 - closed below
                err = open(Path(tmp) / f"rank{r}.err", "w+b")  # noqa: SIM115
                logs.append((out, err))
                procs.append(subprocess.Popen(list(command), stdout=out, stderr=err,
                                              stdin=subprocess.DEVNULL if stdin is None else subprocess.PIPE,
                                              env={**os.environ, **(env or {}), **envs[r]}))
            if stdin is not None:
                # A daemon: a read of a terminal that never ends must not keep the launcher alive.
                threading.Thread(target=_copy_to_all, args=(stdin, [p.stdin for p in procs if p.stdin]),
                                 daemon=True, name="pymlxc-launch-stdin").start()
            failed, killed = _watch(procs, logs[0][0] if echo else None, timeout, grace)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
                if p.stdin is not None:  # the copying thread may still wait on a terminal
                    with contextlib.suppress(OSError, ValueError):
                        p.stdin.close()
        results = []
        for r, (p, (out, err)) in enumerate(zip(procs, logs, strict=True)):
            out.seek(0)
            err.seek(0)
            results.append(RankResult(r, None if r in killed else p.returncode,
                                      out.read().decode(errors="replace"), err.read().decode(errors="replace")))
            out.close()
            err.close()
    if failed is not None:
        rank, why = failed
        # The first rank seen failing may only have lost a peer that failed first: every failed
        # rank's stderr ends the message (the first one's longest).
        shown = [rank] if rank >= 0 else []
        shown += [r.rank for r in results if r.rank != rank and r.returncode not in (0, None)]
        tails = [(r, results[r].stderr[-(3000 if i == 0 else 1500):]) for i, r in enumerate(shown)]
        raise LaunchError(why + "".join(f"\n--- rank {r} stderr ---\n{tail}" for r, tail in tails if tail), results)
    return results


def _copy_to_all(source: int, sinks: list[IO[bytes]]) -> None:
    """Copy the file descriptor `source` to every sink as it comes (a line typed on a terminal at
    once), closing each at its end; a rank that has ended (its pipe broken) is dropped. os.read, not
    sys.stdin.buffer: this daemon thread blocked in a buffered read holds the buffer's lock, and the
    interpreter's exit then aborts ("could not acquire lock ... at interpreter shutdown")."""
    live = list(sinks)
    try:
        while live:
            try:
                chunk = os.read(source, 1 << 16)
            except OSError:  # the descriptor closed under us
                break
            if not chunk:
                break
            for sink in list(live):
                try:
                    sink.write(chunk)
                    sink.flush()
                except (OSError, ValueError):  # BrokenPipeError: the rank ended; ValueError: closed here
                    live.remove(sink)
    finally:
        for sink in sinks:
            with contextlib.suppress(OSError, ValueError):
                sink.close()


def _watch(procs: list[subprocess.Popen[bytes]], echo_file: IO[bytes] | None, timeout: float | None,
           grace: float) -> tuple[tuple[int, str] | None, set[int]]:
    start = time.monotonic()
    failed: tuple[int, str] | None = None
    stop_at: float | None = None
    echoed = 0
    killed: set[int] = set()
    while True:
        if echo_file is not None:
            echo_file.flush()
            data = Path(echo_file.name).read_bytes()[echoed:]
            if data:
                sys.stdout.buffer.write(data)
                sys.stdout.flush()
                echoed += len(data)
        codes = [p.poll() for p in procs]
        if failed is None:
            for r, c in enumerate(codes):
                if c is not None and c != 0:
                    failed = (r, f"rank {r} {_describe(c)}")
                    stop_at = time.monotonic() + grace
                    break
        if all(c is not None for c in codes):
            return failed, killed
        now = time.monotonic()
        if failed is None and timeout is not None and now - start > timeout:
            failed = (-1, f"the ranks did not finish within {timeout:g} s")
            stop_at = now
        if stop_at is not None and now >= stop_at:
            for r, p in enumerate(procs):
                if p.poll() is None:
                    p.kill()
                    killed.add(r)
            for p in procs:
                p.wait()
            return failed, killed
        time.sleep(0.05)


__all__ = ["LAUNCH_BACKENDS", "LaunchError", "RankResult", "free_ports", "rank_environments", "run_local"]

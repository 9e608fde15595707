"""Per-op call cost of pymlxc.core against MLX's own Python binding (mlx.core), in the same run.

Each case builds a small graph node without evaluating it, so the time is the binding's overhead
(argument conversion, the C call, wrapping the result) plus MLX's graph-node construction, which both
bindings pay alike. Prints a table with the ratio pymlxc / mlx and writes JSON.

The clock is the calling thread's CPU time by default (`--clock thread`): on a shared, busy machine
wall time mostly measures the other processes. `--clock wall` uses time.perf_counter.

    python benchmarks/op_overhead.py [--json out.json] [--repeat 25] [--number 2000] [--clock thread|wall]
"""
from __future__ import annotations

import argparse
import gc
import datetime
import json
import platform
import sys
import time
import timeit
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mlx

import pymlxc.core as pmx
from pymlxc.core._gen import RAW


def _cases(m: Any, generated_add: Callable[..., Any] | None) -> dict[str, Callable[[], Any]]:
    """The same operations, written once against either binding `m`."""
    a = m.ones((4, 4))
    b = m.ones((4, 4))
    m.eval(a, b)
    add = generated_add or m.add
    cases: dict[str, Callable[[], Any]] = {
        "a + b": lambda: a + b,
        "a + 1.5 (scalar)": lambda: a + 1.5,
        "add (generated)": lambda: add(a, b),
        "mx.add(a, b)": lambda: m.add(a, b),
        "mx.exp(a)": lambda: m.exp(a),
        "mx.sum(a)": lambda: m.sum(a),
        "mx.sum(a, axis=1)": lambda: m.sum(a, axis=1),
        "mx.array(1.5)": lambda: m.array(1.5),
        "a.reshape(16)": lambda: a.reshape(16),
        "a[1:3]": lambda: a[1:3],
        "a.shape": lambda: a.shape,  # pymlxc reads it once per Array, then keeps it
        "mx.matmul(a, b)": lambda: m.matmul(a, b),
    }
    return cases


CLOCKS = {"thread": time.thread_time, "wall": time.perf_counter}


def _time_pair(ours: Callable[[], Any], theirs: Callable[[], Any], number: int, repeat: int,
               clock: Callable[[], float]) -> tuple[float, float]:
    """Best-of-`repeat` seconds per call of each, timed alternately (so that a busy machine slows
    both alike), with the GC paused for both."""
    ours()
    theirs()
    t_ours, t_theirs = timeit.Timer(ours, timer=clock), timeit.Timer(theirs, timer=clock)
    best_ours = best_theirs = float("inf")
    gc.collect()
    gc.disable()
    try:
        for _ in range(repeat):
            best_ours = min(best_ours, t_ours.timeit(number) / number)
            best_theirs = min(best_theirs, t_theirs.timeit(number) / number)
    finally:
        gc.enable()
    return best_ours, best_theirs


def run(number: int, repeat: int, clock: str = "thread") -> dict[str, Any]:
    ours = _cases(pmx, RAW["add"])
    theirs = _cases(mlx, None)
    rows = []
    for name in ours:
        t_ours, t_mlx = _time_pair(ours[name], theirs[name], number, repeat, CLOCKS[clock])
        rows.append({"case": name, "pymlxc_us": t_ours * 1e6, "mlx_us": t_mlx * 1e6, "ratio": t_ours / t_mlx})
    from compare_mlx_lm import versions  # the same version and commit record as the model benchmark

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": versions(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "mlx_version": mlx.__version__,
        "number": number,
        "repeat": repeat,
        "clock": clock,
        "rows": rows,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, default=Path("op_overhead.json"))
    ap.add_argument("--number", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=25)
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="thread")
    args = ap.parse_args()
    result = run(args.number, args.repeat, args.clock)
    print(f"{'case':<22} {'pymlxc us':>10} {'mlx us':>10} {'ratio':>7}")
    for r in result["rows"]:
        print(f"{r['case']:<22} {r['pymlxc_us']:>10.2f} {r['mlx_us']:>10.2f} {r['ratio']:>7.2f}")
    plain = {r["case"]: r["ratio"] for r in result["rows"]}
    print(f"plain elementwise op: mx.add(a, b) {plain['mx.add(a, b)']:.2f}x, a + b {plain['a + b']:.2f}x "
          "mlx.core's time (target: at most 3x)")
    args.json.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()

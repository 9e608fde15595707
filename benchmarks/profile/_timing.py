"""How the probes in benchmarks/profile/ time a batch of products, or a chain of operations, on the device."""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import pymlxc.core as mx


def timed_evaluation(build: Callable[[], list[Any]], repeats: int) -> float:
    """Median seconds to evaluate what `build` makes, the graph built before the clock starts: the
    Python calls that build products (several for a custom kernel, one for an MLX op) are not the
    device's time. Three untimed evaluations first: the first side of a shape came after the CPU's
    float64 reference, and clocks ramp up."""
    for _ in range(3):
        mx.eval(build())
    times = []
    for _ in range(repeats):
        outs = build()
        t = time.perf_counter()
        mx.eval(outs)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def time_chain(lib: Any, first: Any, op: Callable[[Any], Any], count: int, repeats: int,
               warmups: int = 1) -> dict[str, Any]:
    """A chain of `count` calls of `op`, each on the last one's output (none can be dropped or
    reordered), built from `first` and evaluated, `warmups` untimed times then `repeats` timed:
    medians per operation, in microseconds, of the build (Python and the binding), the encoding
    (`async_eval`: MLX's host work) and the wait for the device. `lib`: an MLX module, pymlxc's or
    MLX's own, whose `eval` / `async_eval` take the chain."""
    runs: list[tuple[float, float, float]] = []
    for i in range(warmups + repeats):
        t0 = time.perf_counter()
        y = first
        for _ in range(count):
            y = op(y)
        t1 = time.perf_counter()
        lib.async_eval(y)
        t2 = time.perf_counter()
        lib.eval(y)
        t3 = time.perf_counter()
        if i >= warmups:
            runs.append((t1 - t0, t2 - t1, t3 - t2))

    def per_op(j: int) -> float:
        return round(statistics.median(r[j] for r in runs) / count * 1e6, 3)

    return {"ops": count, "build_us_per_op": per_op(0), "encode_us_per_op": per_op(1), "wait_us_per_op": per_op(2),
            "eval_us_runs": [round((r[1] + r[2]) / count * 1e6, 2) for r in runs]}

"""How the probes in benchmarks/profile/ time a batch of products on the device."""
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

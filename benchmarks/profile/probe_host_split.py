"""Where a decode token's host time goes: the building thread against the evaluation thread.

Runs greedy generations of MODEL (a 128-token prompt, `--max-tokens` tokens, after one warm-up)
with timers wrapped around the segmented decode's parts, and prints per token: the wall time, the
time the caller spent building steps (`build(step)`, split into the compiled segment calls and the
per-layer attention built from Python where the segments run), the time the evaluation thread
spent in MLX's `async_eval` (encoding the step for the device, and waiting to take the interpreter
lock back), and the time the caller waited for a step to be scheduled. A short hash of the tokens
lets runs under different settings be compared for equal output.

    python benchmarks/profile/probe_host_split.py MODEL [--max-tokens 256] [--runs 3] [--switch-interval S]
        [--json PATH]   # the runs as JSON too (what `ab.py` reads)
"""
from __future__ import annotations

import _path  # noqa: F401 - the checkout as installed (backends as pymlxc.backends)

import argparse
import collections
import hashlib
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from compare_mlx_lm import Pymlxc, probe_prompt, timed_run

from pymlxc.backends.metal.decode import segments
from pymlxc.core import eval_thread

totals: collections.defaultdict[str, float] = collections.defaultdict(float)
calls: collections.defaultdict[str, int] = collections.defaultdict(int)


def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - start
            calls[name] += 1
    return wrapper


def instrument() -> None:
    eval_thread.async_eval = timed("encode(async_eval)", eval_thread.async_eval)  # type: ignore[assignment]
    session = segments.SegmentedSession
    session._step = timed("build(step)", session._step)  # type: ignore[method-assign] # noqa: SLF001
    session._attend = timed("build.attend", session._attend)  # type: ignore[method-assign] # noqa: SLF001
    segments.call_segment = timed("build.call_segment", segments.call_segment)  # type: ignore[assignment]
    segments.StepQueue.ready = timed("main.wait_ready", segments.StepQueue.ready)  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--switch-interval", type=float, default=None,
                        help="the interpreter's thread switch interval (seconds; default: Python's)")
    parser.add_argument("--json", type=Path, default=None, help="also write the runs here as JSON")
    args = parser.parse_args()
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    instrument()
    side = Pymlxc()
    side.load(args.model)
    prompt = probe_prompt(128, side.vocab)
    timed_run(side, prompt, min(32, args.max_tokens))
    runs: list[dict[str, Any]] = []
    for _ in range(args.runs):
        totals.clear()
        calls.clear()
        r = timed_run(side, prompt, args.max_tokens)
        n = r["generated"]
        parts = "; ".join(f"{k} {1e6 * v / n:.0f} us/token ({calls[k] / n:.1f}/token)" for k, v in sorted(totals.items()))
        digest = hashlib.sha1(str(r["tokens"]).encode()).hexdigest()[:8]
        print(f"decode {r['decode_tps']:.1f} tok/s, wall {1e6 / max(r['decode_tps'], 1e-9):.0f} us/token; {parts}; "
              f"tokens {digest}", flush=True)
        runs.append({"decode_tps": r["decode_tps"], "generated": n, "tokens": digest,
                     "us_per_token": {k: 1e6 * v / n for k, v in sorted(totals.items())}})
        if args.json is not None:  # after every run: a process cut short keeps what it measured
            args.json.write_text(json.dumps(runs, indent=1) + "\n")
    side.free()


if __name__ == "__main__":
    main()

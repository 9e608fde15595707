"""Where a served token's time goes, without HTTP: the continuous batch's decode step per batch size.

For a model directory and each batch size N this measures, in one process:

* `step_ms`: one decode step of N rows as the scheduler builds it op by op (`Batch.logits`),
  then the argmax read back, median over `--steps` steps after a warm-up;
* `scheduler_ms`: N greedy requests through `Scheduler` (prefill one by one, then the running
  batch with its look-ahead), wall time over decode steps, and its tok/s;

and, for reference, `generate` alone (one stream, the compiled decode path) in tok/s. Compared with
`serve_load.py`'s inter-token latency at the same N, the difference is what the HTTP layer adds.

    python benchmarks/profile/probe_batch_step.py MODEL_DIR [--batch 1 4 8 16 32] [--out probe.json]
"""
from __future__ import annotations

import _path  # noqa: F401 - the checkout as installed (backends as pymlxc.backends)

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import pymlxc
import pymlxc.core as mx
from pymlxc.backends.metal import batching


def _prompt(i: int) -> str:
    return f"request {i}: the quick brown fox jumps over the lazy dog " * 3


def step_times(lm: Any, n: int, steps: int) -> list[float]:
    """Milliseconds per uncompiled decode step of an n-row batch (as `Scheduler._decode_step` runs it)."""
    batch = batching.Batch()
    for i in range(n):
        cache = lm.make_cache(None)
        mx.eval(lm(mx.array([[5 + i, 6, 7, 8]], dtype=mx.int32), cache=cache))
        batch.add(object(), cache)
    times = []
    ids = mx.zeros((n, 1), mx.int32)
    for k in range(steps + 3):
        t = time.perf_counter()
        logits = batch.logits(lm, ids, None)  # the scheduler's step, built op by op
        ids = mx.expand_dims(mx.argmax(logits, axis=-1).astype(mx.int32), 1)
        ids.tolist()
        if k >= 3:
            times.append(1e3 * (time.perf_counter() - t))
    return times


def scheduler_run(model: Any, n: int, max_tokens: int) -> dict[str, float]:
    scheduler = model.scheduler(max_batch=n, max_queue=n)
    tokenizer = model.tokenizer
    before = scheduler.steps
    collectors = []
    start = time.perf_counter()
    for i in range(n):
        collector = batching.Collector()
        params = batching.SamplingParams(max_tokens=max_tokens, temperature=0.0)
        scheduler.submit(batching.Request(tokenizer.encode(_prompt(i)), params, collector))
        collectors.append(collector)
    for collector in collectors:
        collector.wait(600)
    wall = time.perf_counter() - start
    tokens = sum(len(c.tokens()) for c in collectors)
    steps = max(scheduler.steps - before, 1)
    return {"wall_s": wall, "tokens": tokens, "tok_per_s": tokens / wall, "steps": steps,
            "scheduler_ms": 1e3 * wall / steps}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", type=Path)
    p.add_argument("--batch", nargs="+", type=int, default=[1, 4, 8, 16, 32])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)

    model = pymlxc.load_model(str(args.model), backend="metal")
    rows: list[dict[str, Any]] = []
    try:
        list(model.generate(_prompt(0), max_tokens=8))  # warm-up
        t = time.perf_counter()
        generated = len(list(model.generate(_prompt(0), max_tokens=args.max_tokens)))
        single = generated / (time.perf_counter() - t)
        print(f"generate, one stream: {single:.1f} tok/s (prefill included)", flush=True)
        scheduler = model.scheduler(max_batch=max(args.batch), max_queue=max(args.batch))
        scheduler.warm()
        lm = model.model
        for n in args.batch:
            times = step_times(lm, n, args.steps)
            scheduler_run(model, n, 4)  # the sizes' first appearance, untimed
            run = scheduler_run(model, n, args.max_tokens)
            row = {"batch": n, "step_ms": statistics.median(times), "step_ms_min": min(times), **run}
            rows.append(row)
            print(f"N={n:3d}  step {row['step_ms']:.2f} ms (min {row['step_ms_min']:.2f})  scheduler "
                  f"{run['scheduler_ms']:.2f} ms/step, {run['tok_per_s']:.1f} tok/s over {run['steps']} steps",
                  flush=True)
        stats = dict(model._batch_step.stats)  # noqa: SLF001 - whether the compiled batch step ran
        print(f"compiled batch step: {stats}", flush=True)
    finally:
        model.close()
    if args.out is not None:
        args.out.write_text(json.dumps({"model": str(args.model), "device": str(mx.default_device()),
                                        "generate_tok_per_s": single, "batch_step": stats, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

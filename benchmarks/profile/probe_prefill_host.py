"""Where a compiled prefill's time goes: Python building the graph, MLX running it, and the two
pipelined.

For MODEL (segmented decode; the compiled prefill runner) and each prompt length, after a warm-up,
medians of --repeats:

- `runner`: the decoder handing out its prefill runner (a generation does this once);
- `build`: the runner building one chunk's graph with nothing evaluated (Python, the binding and
  MLX's graph construction: the host's share that no device can hide);
- `eval`: one `eval` of that whole graph (MLX's encoding of every kernel and the device's work,
  overlapped by MLX alone);
- `pipelined`: the time to the first token of a greedy generation (`compare_mlx_lm.timed_run`),
  where the prefill hands each layer to the evaluation thread as it is built.

If `build` is most of `pipelined`, Python is the bound; if `eval` is, MLX's per-kernel work or the
device. `--profile N`: cProfile of `build`, the N costliest functions by own time.

    python benchmarks/profile/probe_prefill_host.py MODEL [MODEL ...] [--lengths 128] [--repeats 7]
        [--profile 25] [--out PATH]
"""
from __future__ import annotations

import _path  # noqa: F401 - the checkout as installed

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time
from pathlib import Path
from typing import Any

from compare_mlx_lm import Pymlxc, probe_prompt, timed_run

import pymlxc.core as mx


def measure(side: Pymlxc, n: int, repeats: int, profile: int) -> dict[str, Any]:
    model, decoder = side.loaded.model, side.decoder
    assert decoder is not None
    prompt = probe_prompt(n, side.vocab)
    tokens = mx.array([prompt], dtype=mx.int32)
    timed_run(side, prompt, 1)  # warm-up: traces and kernels for this length
    rows: list[tuple[float, float, float]] = []
    prof = cProfile.Profile() if profile else None
    for i in range(repeats + 1):
        cache = model.make_cache(side.context_len)
        decoder.reserve(cache, n, 1)
        start = time.perf_counter()
        runner = decoder.prefill_runner(True)
        made = time.perf_counter()
        if runner is None or not runner.takes(tokens):
            raise SystemExit(f"{n} tokens do not go through the compiled prefill of this model")
        if prof is not None and i == repeats:
            prof.enable()
        h = runner(tokens, cache)
        built = time.perf_counter()
        if prof is not None and i == repeats:
            prof.disable()
        mx.eval(h)
        done = time.perf_counter()
        decoder.unreserve(cache)
        if i < repeats:
            rows.append((made - start, built - made, done - built))
    pipelined = [timed_run(side, prompt, 1)["ttft_s"] for _ in range(repeats)]
    out = {"prompt": n, **{k: 1e3 * statistics.median(r[j] for r in rows)
                           for j, k in enumerate(("runner_ms", "build_ms", "eval_ms"))},
           "pipelined_ms": 1e3 * statistics.median(pipelined)}
    if prof is not None:
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(profile)
        out["profile"] = text.getvalue()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("models", nargs="+", type=Path)
    p.add_argument("--lengths", nargs="+", type=int, default=[128])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--profile", type=int, default=0, help="cProfile the build: this many functions")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    results = []
    for path in args.models:
        side = Pymlxc(compiled=True, mode="segmented")
        side.load(path)
        try:
            for n in args.lengths:
                row = {"model": str(path), **measure(side, n, args.repeats, args.profile)}
                results.append(row)
                print(f"{path.name:40s} {n:5d} tokens  runner {row['runner_ms']:6.2f} ms  build {row['build_ms']:6.2f} ms  "
                      f"eval {row['eval_ms']:6.2f} ms  pipelined {row['pipelined_ms']:6.2f} ms", flush=True)
                if "profile" in row:
                    print(row["profile"], flush=True)
        finally:
            side.free()
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

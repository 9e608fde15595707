"""Where a decode token's time goes, per implementation: host work (building or replaying the step,
MLX's dispatch in `async_eval`) against waiting for the device (`item`/`eval`), from cProfile.

A step that waits for the device most of its time is device bound (fewer or faster kernels help);
one that is busy on the host is host bound (less Python, fewer graph nodes help). Runs on any
device.

    python benchmarks/profile/profile_generation.py --shape llama-3.2-1b --quant bf16 --prompt 128 \\
        --max-tokens 128 --modes mlx_lm graph segmented uncompiled --out DIR
"""
from __future__ import annotations

import _path  # noqa: F401 - the checkout as installed

import argparse
import cProfile
import io
import json
import pstats
import time
from pathlib import Path
from typing import Any

import numpy as np

import mlx.core as mlx

from compare_mlx_lm import MlxLm, Pymlxc, model_dir, warm_up
from pymlxc.testing.shapes import SHAPES, shape_config

# cProfile entries (substrings of "file:line(function)") that are waits for the device, and host dispatch.
WAIT = ("item", "to_numpy", "tolist", "'eval'", "(eval)", "method 'item'")
DISPATCH = ("async_eval",)
REPLAY = ("mlx_closure_apply", "call_flat", "(apply)")


def profile(side: Any, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    warm_up(side, prompt, max_tokens)
    prof = cProfile.Profile()
    start = time.perf_counter()
    prof.enable()
    n = sum(1 for _ in side.stream(prompt, max_tokens))
    prof.disable()
    wall = time.perf_counter() - start
    stats = pstats.Stats(prof)
    wait = dispatch = 0.0
    for (file, line, name), (cc, nc, tt, ct, callers) in stats.stats.items():  # type: ignore[attr-defined]
        label = f"{file}:{line}({name})"
        if any(w in label for w in WAIT):
            wait += tt
        elif any(d in label for d in DISPATCH):
            dispatch += tt
        elif name == "generate_step" and "mlx_lm" in file:
            # mlx.core's functions are not seen by cProfile: their time (dispatch and waiting, as
            # `mx.async_eval` and `.item()` inside the generator) is the generator's own time.
            dispatch += tt
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
    return {"tokens": n, "wall_s": wall, "wait_s": wait, "dispatch_s": dispatch,
            "host_other_s": max(wall - wait - dispatch, 0.0), "top": out.getvalue()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama-3.2-1b", choices=sorted(SHAPES))
    p.add_argument("--quant", default="bf16", choices=["bf16", "4bit", "f32", "4bit-f32"])
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--modes", nargs="+", default=["mlx_lm", "graph", "segmented", "uncompiled"],
                   choices=["mlx_lm", "graph", "segmented", "uncompiled"])
    p.add_argument("--models-dir", type=Path, default=Path("/tmp/pymlxc-bench-models"))
    p.add_argument("--out", type=Path, default=Path("."))
    p.add_argument("--cpu", action="store_true")
    args = p.parse_args(argv)
    if args.cpu:
        mlx.set_default_device(mlx.cpu)
    args.out.mkdir(parents=True, exist_ok=True)
    path = model_dir(args.models_dir, args.shape, args.quant, args.layers)
    vocab = shape_config(args.shape, args.layers)["vocab_size"]
    prompt = [int(i) for i in np.random.default_rng(0).integers(1000, vocab - 1000, size=args.prompt)]
    sides = {"mlx_lm": lambda: MlxLm(), "graph": lambda: Pymlxc(True, "graph"),
             "segmented": lambda: Pymlxc(True, "segmented"), "uncompiled": lambda: Pymlxc(False)}
    report = {"shape": args.shape, "quant": args.quant, "prompt": args.prompt, "max_tokens": args.max_tokens,
              "device": str(mlx.default_device()), "modes": {}}
    print(f"{args.shape} {args.quant}, prompt {args.prompt}, {args.max_tokens} tokens on {mlx.default_device()} "
          "(ms per generated token, under cProfile)")
    print(f"{'mode':<12} {'total':>8} {'device wait':>12} {'dispatch':>9} {'other host':>11}  "
          "(mlx_lm: wait is counted in dispatch; on a CPU, dispatch includes the compute)")
    for mode in args.modes:
        side = sides[mode]()
        side.load(path)
        r = profile(side, prompt, args.max_tokens)
        side.free()
        per = 1e3 / max(r["tokens"], 1)
        print(f"{mode:<12} {r['wall_s'] * per:>8.2f} {r['wait_s'] * per:>12.2f} {r['dispatch_s'] * per:>9.2f} "
              f"{r['host_other_s'] * per:>11.2f}", flush=True)
        (args.out / f"profile-{mode}.txt").write_text(r.pop("top"))
        report["modes"][mode] = r
    (args.out / "profile.json").write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Device time per kernel of a few decode steps, measured by Nsight Compute (`ncu`).

Run under ncu with profiling off at start; the script turns the CUDA profiler on (cudaProfilerStart)
only around `--steps` decode steps of a warm generation, so only those kernels are measured:

    ncu --profile-from-start off --metrics gpu__time_duration.sum --cache-control none --csv \
        --log-file OUT.csv python benchmarks/profile/probe_kernel_times.py --side pymlxc
        [--model PATH]   # a checkpoint folder or a .gguf file instead of --shape / --quant
    python benchmarks/profile/probe_kernel_times.py --summarize OUT.csv --steps 4

`--prefill` measures one prefill of `--prompt-tokens` and its first token instead (`--summarize
OUT.csv --steps 1`). ncu runs every kernel on its own, so the sum of their durations is the step's device time without
the gaps between kernels; the difference to the step's wall time is the gaps and the host.
"""
from __future__ import annotations

import argparse
import collections
import csv
import ctypes
import glob
import os
import re
import sys
import time
from pathlib import Path

import _path  # noqa: F401 - the checkout as installed


def _cudart() -> ctypes.CDLL:
    import mlx  # noqa: PLC0415 - its wheel's CUDA runtime, next to it in site-packages

    roots = {str(Path(p).parent) for p in mlx.__path__}
    for root in roots:
        for lib in sorted(glob.glob(os.path.join(root, "nvidia", "cu*", "lib", "libcudart.so*"))
                          + glob.glob(os.path.join(root, "nvidia", "cuda_runtime", "lib", "libcudart.so*"))):
            return ctypes.CDLL(lib)
    return ctypes.CDLL("libcudart.so")


def run(side_name: str, shape: str, quant: str, prompt_tokens: int, steps: int, models: Path,
        model: Path | None = None, prefill: bool = False) -> None:
    import compare_mlx_lm as bench  # noqa: PLC0415
    import mlx.core as mlx  # noqa: PLC0415

    path = model if model is not None else bench.model_dir(models, shape, quant, None)
    side = bench.Pymlxc() if side_name == "pymlxc" else bench.MlxLm()
    side.load(path)
    prompt = bench.probe_prompt(prompt_tokens, side.vocab)
    for _ in range(2):
        list(side.stream(prompt, 16))
    t = time.perf_counter()
    n = len(list(side.stream(prompt, 64)))
    wall = time.perf_counter() - t
    print(f"unprofiled: {n} tokens in {wall * 1e3:.1f} ms", flush=True)
    cudart = _cudart()
    # Profiled: one prefill and its first token, or `steps` decode steps after 8 unprofiled ones.
    stream = side.stream(prompt, 1 if prefill else 8 + steps + 4)
    for _ in range(0 if prefill else 8):
        next(stream)
    mlx.synchronize()
    cudart.cudaProfilerStart()
    for _ in range(1 if prefill else steps):
        next(stream)
    mlx.synchronize()
    cudart.cudaProfilerStop()
    for _ in stream:
        pass
    side.free()


def summarize(path: Path, steps: int) -> None:
    rows = []
    with path.open() as f:
        lines = [line for line in f if line.startswith('"')]
    for row in csv.DictReader(lines):
        if row.get("Metric Name") == "gpu__time_duration.sum":
            value = float(row["Metric Value"].replace(",", ""))
            unit = row.get("Metric Unit", "nsecond")
            scale = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}[unit]
            name = re.sub(r"\(.*", "", row["Kernel Name"])
            rows.append((name[:110], value * scale))
    by = collections.defaultdict(list)
    for name, us in rows:
        by[name].append(us)
    total = sum(us for _, us in rows)
    print(f"{len(rows)} kernels, {total:.1f} us in all; per step {len(rows) / steps:.1f} kernels, "
          f"{total / steps:.1f} us")
    for name, times in sorted(by.items(), key=lambda kv: -sum(kv[1])):
        print(f"  {sum(times) / steps:8.1f} us/step  {len(times) / steps:6.1f}/step  "
              f"mean {sum(times) / len(times):7.2f} us  {name}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--side", choices=["pymlxc", "mlx_lm"], default="pymlxc")
    p.add_argument("--shape", default="llama-3.2-1b")
    p.add_argument("--quant", default="bf16", choices=["bf16", "4bit"])
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--models-dir", type=Path, default=Path("/tmp/pymlxc-bench-models"))
    p.add_argument("--model", type=Path, default=None,
                   help="this checkpoint folder or GGUF file rather than --shape / --quant's random model")
    p.add_argument("--prefill", action="store_true",
                   help="measure one prefill of --prompt-tokens and its first token instead (summarize with --steps 1)")
    p.add_argument("--summarize", type=Path, default=None, help="an ncu CSV log to summarize instead")
    args = p.parse_args(argv)
    if args.summarize is not None:
        summarize(args.summarize, args.steps)
    else:
        run(args.side, args.shape, args.quant, args.prompt_tokens, args.steps, args.models_dir, args.model,
            args.prefill)
    return 0


if __name__ == "__main__":
    sys.exit(main())

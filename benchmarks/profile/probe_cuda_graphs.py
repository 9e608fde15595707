"""Which CUDA kernels one side runs per decode step and per prompt, from MLX's own graph dumps.

MLX's CUDA backend records each evaluation into CUDA graphs; with MLX_SAVE_CUDA_GRAPHS_DOT_FILE set
it writes every graph it launches as a DOT file. This script runs one side (pymlxc or mlx-lm) on a
random-weight model of a real shape, in its own process (MLX reads the variable once), and counts the
kernel nodes of two greedy generations that differ only in length: the difference divided by the
extra tokens is the kernels of one decode step, the rest the prompt's.

    python benchmarks/profile/probe_cuda_graphs.py --side pymlxc --shape llama-3.2-1b --quant bf16 --out DIR
    python benchmarks/profile/probe_cuda_graphs.py --side mlx_lm ...

Prints and writes DIR/<side>.json: graphs and kernels per step, and the kernel names by count.
Needs MLX's CUDA build (on a CPU no graph is written and it says so).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

_DUMP_DIR = Path(tempfile.mkdtemp(prefix="mlx-graphs-"))
os.environ["MLX_SAVE_CUDA_GRAPHS_DOT_FILE"] = str(_DUMP_DIR / "g")  # before MLX's first graph

import _path  # noqa: E402, F401 - the checkout as installed
import compare_mlx_lm as bench  # noqa: E402

_KERNEL_LABEL = re.compile(r"KERNEL\s*\|\s*\{?\s*ID\s*\|\s*\d+\s*\|\s*([^}\\|]+)")
_MANGLED = re.compile(r"\b(_Z[\w$.]+)")


def _dumps() -> list[Path]:
    return sorted(_DUMP_DIR.glob("g_*.dot"), key=lambda p: int(p.stem.split("_")[1]))


def _kernel_names(paths: list[Path]) -> list[str]:
    names = []
    for p in paths:
        text = p.read_text(errors="replace")
        found = _KERNEL_LABEL.findall(text)
        if not found:  # another label layout: every mangled name once per node line
            found = [m for line in text.splitlines() if "->" not in line for m in _MANGLED.findall(line)[:1]]
        names += [n.strip() for n in found]
    return names


def _demangle(names: list[str]) -> dict[str, str]:
    unique = sorted(set(names))
    if not unique or shutil.which("c++filt") is None:
        return {n: n for n in unique}
    out = subprocess.run(["c++filt"], input="\n".join(unique), capture_output=True, text=True).stdout.splitlines()
    return dict(zip(unique, out)) if len(out) == len(unique) else {n: n for n in unique}


def _short(name: str) -> str:
    """The kernel's function name without namespaces' noise and with templates cut at 120 chars."""
    name = re.sub(r"^void ", "", name)
    return name if len(name) <= 160 else name[:157] + "..."


def _generate(side: bench.Side, prompt: list[int], max_tokens: int) -> tuple[list[Path], int]:
    before = len(_dumps())
    produced = sum(1 for _ in side.stream(prompt, max_tokens))
    import mlx.core as mlx  # noqa: PLC0415

    mlx.synchronize()
    return _dumps()[before:], produced


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--side", choices=["pymlxc", "mlx_lm"], required=True)
    p.add_argument("--shape", default="llama-3.2-1b")
    p.add_argument("--quant", default="bf16", choices=["bf16", "4bit"])
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--short", type=int, default=4, help="tokens of the shorter generation")
    p.add_argument("--extra", type=int, default=20, help="tokens the longer one adds")
    p.add_argument("--models-dir", type=Path, default=Path("/tmp/pymlxc-bench-models"))
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)

    path = bench.model_dir(args.models_dir, args.shape, args.quant, None)  # written on first use
    side: bench.Side = bench.Pymlxc() if args.side == "pymlxc" else bench.MlxLm()
    side.load(path)
    prompt = bench.probe_prompt(args.prompt_tokens, side.vocab)
    for _ in range(2):  # traces, compiles, caches
        _generate(side, prompt, args.short + args.extra)
    short_files, n_short = _generate(side, prompt, args.short)
    long_files, n_long = _generate(side, prompt, args.short + args.extra)
    if not long_files:
        print("no CUDA graph was written (not MLX's CUDA build?)", file=sys.stderr)
        return 1
    short_names, long_names = _kernel_names(short_files), _kernel_names(long_files)
    steps = n_long - n_short
    names = _demangle(short_names + long_names)
    per_step = collections.Counter(names[n] for n in long_names)
    per_step.subtract(collections.Counter(names[n] for n in short_names))
    result: dict[str, Any] = {
        "side": args.side, "shape": args.shape, "quant": args.quant, "prompt_tokens": args.prompt_tokens,
        "generations": {"short": {"tokens": n_short, "graphs": len(short_files), "kernels": len(short_names)},
                        "long": {"tokens": n_long, "graphs": len(long_files), "kernels": len(long_names)}},
        "kernels_per_step": (len(long_names) - len(short_names)) / steps,
        "graphs_per_step": (len(long_files) - len(short_files)) / steps,
        "prompt_and_short_kernels": len(short_names),
        "per_step_by_name": {_short(k): v / steps for k, v in per_step.most_common() if v},
        "short_generation_by_name": {_short(k): v for k, v in
                                     collections.Counter(names[n] for n in short_names).most_common()},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    samples = args.out / f"{args.side}-dot"  # a few raw dumps, to check the parsing against
    samples.mkdir(exist_ok=True)
    for f in short_files[:2] + long_files[-2:]:
        shutil.copy(f, samples / f.name)
    (args.out / f"{args.side}-{args.shape}-{args.quant}.json").write_text(json.dumps(result, indent=1))
    print(f"{args.side} {args.shape} {args.quant} p{args.prompt_tokens}: "
          f"{result['kernels_per_step']:.1f} kernels and {result['graphs_per_step']:.2f} graphs per decode step; "
          f"{len(short_names)} kernels in {len(short_files)} graphs for the prompt and {n_short} tokens")
    for name, count in list(result["per_step_by_name"].items())[:25]:
        print(f"  {count:7.2f}  {name}")
    if len(short_names) == 0:
        sample = short_files[0].read_text(errors="replace")[:3000] if short_files else ""
        print("no kernel names parsed; a dump starts:\n" + sample)
    side.free()
    shutil.rmtree(_DUMP_DIR, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

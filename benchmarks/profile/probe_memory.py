"""Where pymlxc's GPU memory goes in one generation: MLX's own counts beside what nvidia-smi lists.

For each stage of one greedy generation as `compare_llama_cpp.py --peak-memory` runs it (start, model
loaded, prompt prefilled, tokens generated), prints MLX's active, cache and peak bytes and the
process's GPU memory as nvidia-smi lists it. The gap between nvidia-smi and MLX's active + cache is
what MLX does not count (the CUDA context, library kernels and handles' workspaces).

    python benchmarks/profile/probe_memory.py MODEL [--prompt-tokens 2048] [--max-tokens 256]
        [--cache-limit BYTES] [--lead LAYERS] [--keep-cache] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from compare_mlx_lm import Pymlxc  # noqa: E402 - the checkout as installed, through its _path
from gpu_memory import process_memory, prompt_ids  # noqa: E402

import pymlxc.core as mx  # noqa: E402

MIB = 1 << 20


def _smi_mib() -> int | None:
    """This process's GPU memory as nvidia-smi lists it (MiB), or None without nvidia-smi."""
    try:
        return process_memory().get(os.getpid())
    except (OSError, RuntimeError, subprocess.SubprocessError):
        return None


def _stage(name: str, rows: list[dict[str, Any]], started: float) -> None:
    row = {"stage": name, "seconds": round(time.perf_counter() - started, 2),
           "active_mib": mx.get_active_memory() // MIB, "cache_mib": mx.get_cache_memory() // MIB,
           "peak_mib": mx.get_peak_memory() // MIB, "nvidia_smi_mib": _smi_mib()}
    rows.append(row)
    print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", type=Path)
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--cache-limit", type=int, help="mx.set_cache_limit before loading (bytes)")
    p.add_argument("--lead", type=int, help="generate.PREFILL_LEAD_LAYERS (layers the host may run ahead)")
    p.add_argument("--keep-cache", action="store_true",
                   help="no clearing of MLX's buffer cache after a long prompt (generate.CLEAR_CACHE_PROMPT_TOKENS)")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    from pymlxc.backends.metal import generate

    if args.lead is not None:
        generate.PREFILL_LEAD_LAYERS = args.lead
        generate.PREFILL_DENSE_BYTES = 1 << 62  # the lead given, for every chunk
    if args.keep_cache:
        generate.CLEAR_CACHE_PROMPT_TOKENS = 1 << 62
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    if args.cache_limit is not None:
        mx.set_cache_limit(args.cache_limit)
    mx.eval(mx.zeros((1,)))  # the device's context
    _stage("context", rows, started)
    side = Pymlxc()
    side.load(args.model)
    _stage("loaded", rows, started)
    stream = side.stream(prompt_ids(side.loaded.config, args.prompt_tokens), args.max_tokens)
    next(stream)
    _stage("prefilled", rows, started)
    n = 1 + sum(1 for _ in stream)
    _stage(f"generated {n}", rows, started)
    side.free()
    _stage("freed", rows, started)
    if args.json is not None:
        args.json.write_text(json.dumps({"model": str(args.model), "prompt_tokens": args.prompt_tokens,
                                         "max_tokens": args.max_tokens, "cache_limit": args.cache_limit,
                                         "lead_layers": generate.PREFILL_LEAD_LAYERS,
                                         "clear_cache_prompt_tokens": generate.CLEAR_CACHE_PROMPT_TOKENS,
                                         "stages": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

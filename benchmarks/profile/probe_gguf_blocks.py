"""GGUF Q2_K/Q3_K/Q6_K block layers on this device: what a product of a few rows costs with the
block kernels (`backends/metal/kernels/gguf_blocks.py`) against MLX ops (the whole matrix
dequantized per call), MLX's 4-bit `quantized_matmul` (group 64) and a dense float16 matmul, for the
shapes of Llama-3.2-1B's and Llama-3.1-8B's decode steps (the Q6_K output head is the case that
matters: llama.cpp's default Q4_0 and Q4_K_M recipes keep it in Q6_K).

Per shape and side: microseconds per call when distinct weights totalling at least --bytes are
applied in one evaluation (so they come from memory, not the L2 cache; the clock on the evaluation
alone, not the Python calls that build it), the weight bytes read per
second, and the largest difference from a float64 product over its largest value.

    python benchmarks/profile/probe_gguf_blocks.py [--types Q6_K Q3_K Q2_K] [--rows 1] [--out DIR]
    python benchmarks/profile/probe_gguf_blocks.py --cpu --shapes 1b.o --bytes 50000000   # MLX ops only

Under Nsight Compute each kernel's own device time (the host's launches left out, which bound the
narrow shapes' clock above): profile the Q6_K and 4-bit kernels of one copy per shape, then
summarize the launches per shape and kernel geometry (rows of x, rows a warp, warps a row):

    ncu --clock-control none --kernel-name regex:"q6k|qmv4" --metrics gpu__time_duration.sum --csv \
        --log-file OUT.csv python benchmarks/profile/probe_gguf_blocks.py --types Q6_K \
        --shapes 1b.v 1b.down 8b.v 8b.down --bytes 1 --repeats 1
    python benchmarks/profile/probe_gguf_blocks.py --ncu-summary OUT.csv --shapes 1b.v 1b.down 8b.v 8b.down
"""
from __future__ import annotations

import _path  # noqa: F401 - the checkout as installed
from _timing import timed_evaluation

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

import pymlxc.core as mx
from pymlxc.backends.metal import gguf_layers, kernel_choice
from pymlxc.backends.metal.formats.gguf_quants import dequantize_blocks
from pymlxc.backends.metal.kernels import gguf_blocks

SHAPES = {  # name: (K, N)
    "1b.v": (2048, 512), "1b.o": (2048, 2048), "1b.gate_up": (2048, 16384), "1b.down": (8192, 2048),
    "1b.head": (2048, 128256),
    "8b.v": (4096, 1024), "8b.o": (4096, 4096), "8b.down": (14336, 4096), "8b.head": (4096, 128256),
}


def probe(qtype: Q, k: int, n: int, rows: int, min_bytes: int, repeats: int) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    blocks_np = gguf_blocks.random_blocks(rng, (n, k // 256), qtype)
    block_bytes = blocks_np.nbytes
    copies = max(1, -(-min_bytes // block_bytes))
    blocks = [mx.array(blocks_np) for _ in range(copies)]
    x = mx.array(rng.standard_normal((rows, k)).astype(np.float32)).astype(mx.float16)
    dense64 = gguf.quants.dequantize(blocks_np.reshape(n, -1), qtype).astype(np.float64)
    want = np.asarray(x.astype(mx.float32)).astype(np.float64) @ dense64.T
    scale = float(np.abs(want).max()) or 1.0
    out: dict[str, Any] = {"type": qtype.name, "K": k, "N": n, "rows": rows, "copies": copies}
    kind = gguf_blocks.device_kind()
    sides: dict[str, tuple[Callable[[mx.Array], mx.Array], int]] = {}
    # The same weights rearranged into Q6_K planes, where their kernels serve x's dtype here.
    with_planes = kind == "cuda" and qtype == Q.Q6_K and gguf_blocks.planes_ready(x.dtype)
    planes = {id(b): gguf_blocks.to_planes(b) for b in blocks} if with_planes else {}
    if rows <= gguf_blocks.MAX_X_ROWS or kind is None:  # (a prompt chunk's block layer dequantizes in chunks: below)
        sides["mlx_ops"] = (lambda w: mx.matmul(x, mx.swapaxes(dequantize_blocks(w, qtype).astype(x.dtype), -1, -2)),
                            block_bytes)
    if kind is not None and rows <= gguf_blocks.MAX_X_ROWS:  # the matvec kernels' rows (a template per count)
        zero = mx.zeros((1,), mx.int32)
        forms: dict[str, dict[str, Any]] = {"kernel": {}}
        if kind == "cuda" and qtype == Q.Q6_K:  # its own kernel: each split of a row, and the generic one
            forms.update({f"kernel_w{w}_r{r}": {"warps": w, "rows_per_warp": r}
                          for r in (4, 2, 1) for w in (1, 2, 4)})
            if with_planes:  # the same kernel on the weights rearranged into planes
                forms["planes"] = {"planes": True}
                forms.update({f"planes_w{w}_r{r}": {"warps": w, "rows_per_warp": r, "planes": True}
                              for r in (4, 2, 1) for w in (1, 2, 4)})
            forms["kernel_generic"] = {"generic": True}
        for name, form in forms.items():
            sides[name] = (lambda w, form=form: mx.reshape(gguf_blocks.matvec(
                mx.reshape(x, (1, rows, k)), mx.expand_dims(planes[id(w)] if form.get("planes") else w, 0), zero,
                qtype, kind, **form), (rows, n)), block_bytes)
    if rows > gguf_blocks.MAX_X_ROWS:  # a prompt chunk: the block layer's own product (dequantized row chunks)
        sides["block_matmul"] = (lambda w: gguf_layers.block_matmul(x, w, qtype), block_bytes)
        if with_planes:
            sides["block_matmul_planes"] = (lambda w: gguf_layers.block_matmul(x, planes[id(w)], qtype, True),
                                            block_bytes)
    dense = mx.array(dense64.astype(np.float16))
    q, s, b = mx.quantize(dense, 64, 4)
    mx.eval(q, s, b)
    q4 = [(q, s, b)] + [(q + 0, s + 0, b + 0) for _ in range(copies - 1)]
    d16 = [dense] + [dense + 0 for _ in range(copies - 1)]
    for name, (fn, nbytes) in sides.items():
        got = np.asarray(fn(blocks[0]).astype(mx.float32))
        t = timed_evaluation(lambda: [fn(w) for w in blocks], repeats) / copies
        out[name] = {"us": t * 1e6, "GBps": nbytes / t / 1e9, "error": float(np.abs(got - want).max()) / scale}
    t = timed_evaluation(lambda: [mx.quantized_matmul(x, *w, True, 64, 4) for w in q4], repeats) / copies
    out["mlx_4bit_g64"] = {"us": t * 1e6, "GBps": (q.nbytes + s.nbytes + b.nbytes) / t / 1e9}
    if kind == "cuda" and rows <= 8:  # pymlxc's own 4-bit kernel, which the native 4-bit format decodes with
        t = timed_evaluation(lambda: [kernel_choice.quantized_matmul(x, *w, 64, 4, cuda_matvec=True) for w in q4],
                  repeats) / copies
        out["pymlxc_4bit_g64"] = {"us": t * 1e6, "GBps": (q.nbytes + s.nbytes + b.nbytes) / t / 1e9}
    # Group 32: what GGUF's Q4_0 and Q4_K layers are repacked to.
    q32 = mx.quantize(dense, 32, 4)
    mx.eval(q32)
    q32s = [q32] + [tuple(a + 0 for a in q32) for _ in range(copies - 1)]
    t = timed_evaluation(lambda: [mx.quantized_matmul(x, *w, True, 32, 4) for w in q32s], repeats) / copies
    out["mlx_4bit_g32"] = {"us": t * 1e6, "GBps": sum(a.nbytes for a in q32) / t / 1e9}
    if kind == "cuda" and rows > gguf_blocks.MAX_X_ROWS and kernel_choice.qmm_ready(x.dtype, 32):
        # pymlxc's tensor-core product of a prompt chunk, which the group-32 layers take op by op
        t = timed_evaluation(lambda: [kernel_choice.qmm_product(x, *w, 32) for w in q32s], repeats) / copies
        out["pymlxc_qmm_g32"] = {"us": t * 1e6, "GBps": sum(a.nbytes for a in q32) / t / 1e9}
    t = timed_evaluation(lambda: [mx.matmul(x, mx.swapaxes(w, 0, 1)) for w in d16], repeats) / copies
    out["dense_f16"] = {"us": t * 1e6, "GBps": dense.nbytes / t / 1e9}
    return out


def ncu_summary(csv_path: Path, shapes: list[str]) -> list[dict[str, Any]]:
    """Median and least device microseconds per (shape, kernel, geometry) from an Nsight Compute CSV
    of a run over `shapes` in order (each shape's Q6_K launches, then its 4-bit ones; the load-time
    checks, three pairs of x, are left out)."""
    import csv  # noqa: PLC0415
    import re  # noqa: PLC0415
    import statistics  # noqa: PLC0415

    with csv_path.open() as f:
        lines = [line for line in f if line.startswith('"')]
    rows = [r for r in csv.DictReader(lines) if r.get("Metric Name") == "gpu__time_duration.sum"
            and r["Grid Size"].replace(" ", "").endswith(",1,1)")]
    times: dict[tuple[str, str], list[float]] = {}
    at, seen_4bit = 0, False
    for r in rows:
        name = re.sub(r"\(.*", "", r["Kernel Name"])
        us = float(r["Metric Value"].replace(",", "")) / 1000
        if "qmv4" in name:
            seen_4bit = True
            times.setdefault((shapes[at], "pymlxc_4bit_g64"), []).append(us)
            continue
        if seen_4bit:  # the next shape's first Q6_K launch
            at, seen_4bit = at + 1, False
        layout = "planes" if "planes" in name else "file"
        m, rows_per_warp, warps = name.split("_")[-3:]
        times.setdefault((shapes[at], f"{layout} m{m} r{rows_per_warp} w{warps}"), []).append(us)
    return [{"shape": shape, "kernel": kernel, "launches": len(v), "median_us": statistics.median(v), "min_us": min(v)}
            for (shape, kernel), v in times.items()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--types", nargs="+", default=["Q6_K", "Q3_K", "Q2_K"], choices=["Q6_K", "Q3_K", "Q2_K"])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--rows", type=int, nargs="+", default=[1], help="rows of x (decode: 1; prefill: the prompt's)")
    p.add_argument("--bytes", type=int, default=1 << 30, help="weight bytes per evaluation (beyond the L2 cache)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--chunk-weights", type=int, default=None,
                   help="weights a prompt chunk's block_matmul dequantizes at a time (gguf_layers.chunk_weights)")
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--ncu-summary", type=Path, default=None, help="summarize this Nsight Compute CSV instead")
    args = p.parse_args(argv)
    if args.ncu_summary is not None:
        summary = ncu_summary(args.ncu_summary, args.shapes)
        for e in summary:
            print(f"{e['shape']:8s} {e['kernel']:22s} {e['launches']:3d} launches  median {e['median_us']:7.2f} us"
                  f"  least {e['min_us']:7.2f} us")
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "probe_gguf_blocks_ncu.json").write_text(json.dumps(summary, indent=1) + "\n")
        return 0
    if args.cpu:
        mx.set_default_device(mx.cpu)
    if args.chunk_weights is not None:
        gguf_layers.CHUNK_WEIGHTS = gguf_layers.GPU_CHUNK_WEIGHTS = args.chunk_weights
    results = []
    for t in args.types:
        if gguf_blocks.device_kind() is not None:
            began = time.perf_counter()
            gguf_blocks.ready(Q[t], mx.float16)  # compile and check first, as a model's load does
            print(f"{t}: kernels compiled and checked in {time.perf_counter() - began:.1f} s", flush=True)
        for shape, rows in ((s, m) for m in args.rows for s in args.shapes):
            k, n = SHAPES[shape]
            r = probe(Q[t], k, n, rows, args.bytes, args.repeats)
            r["shape"] = shape
            results.append(r)
            cols = "  ".join(f"{side} {v['us']:.1f} us {v['GBps']:.0f} GB/s"
                             + (f" err {v['error']:.1e}" if "error" in v else "")
                             for side, v in r.items() if isinstance(v, dict))
            print(f"{t:5s} {shape:11s} m={rows:<5d} {cols}", flush=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "probe_gguf_blocks.json").write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Dense (bfloat16) matrix-vector products on this GPU: MLX's `x @ w.T` against pymlxc's
block-per-row kernel (`backends/metal/cuda_gemv.py`), device time per call from Nsight Compute.

A decode step's products are each short (3 to 170 us on an H100) and run back to back with small
kernels between them, so wall-clock loops measure MLX's host dispatch, not the device. Under ncu
(with the caches flushed before each kernel, as a step's weights come cold from memory) each
product's own duration is measured:

    ncu --profile-from-start off --metrics gpu__time_duration.sum --cache-control all --csv \
        --log-file OUT/gemv.csv python benchmarks/probe_gemv.py --out OUT
    python benchmarks/probe_gemv.py --out OUT --summarize OUT/gemv.csv

Runs through MLX's own Python API, so it needs no pymlxc build.
"""
from __future__ import annotations

import argparse
import collections
import csv
import importlib.util
import json
import re
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

_spec = importlib.util.spec_from_file_location(
    "cuda_gemv", Path(__file__).resolve().parents[1] / "backends" / "metal" / "cuda_gemv.py")
kernels = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kernels)

SHAPES = {  # name: (K, N)
    "1b.qkv": (2048, 3072), "1b.o": (2048, 2048), "1b.gate_up": (2048, 16384), "1b.down": (8192, 2048),
    "1b.head": (2048, 128256),
    "0.6b.qkv": (1024, 4096), "0.6b.o": (2048, 1024), "0.6b.gate_up": (1024, 6144), "0.6b.down": (3072, 1024),
    "0.6b.head": (1024, 151936),
}
REPEATS = 3


def _variants() -> dict[str, Any]:
    kernel = mx.fast.cuda_kernel(kernels.NAME, list(kernels.INPUTS), list(kernels.OUTPUTS), kernels.SOURCE)

    def ours(rows: int, threads_div: int) -> Any:
        def run(x: Any, w: Any) -> Any:
            k, n = x.shape[-1], w.shape[0]
            threads = kernels.threads_for(k) // threads_div
            return kernel(inputs=[x, w], output_shapes=[(1, n)], output_dtypes=[x.dtype],
                          **kernels.launch(k, n, x.dtype, rows, threads))[0]
        return run

    out: dict[str, Any] = {"mlx": lambda x, w: x @ w.T}
    for rows in (1, 2, 4):
        out[f"ours_r{rows}"] = ours(rows, 1)
    out["ours_r2_halfthreads"] = ours(2, 2)
    return out


def run(out: Path, shapes: list[str]) -> None:
    import ctypes  # noqa: PLC0415
    import glob  # noqa: PLC0415
    import os  # noqa: PLC0415

    import mlx  # noqa: PLC0415

    libs = [p for root in {str(Path(p).parent) for p in mlx.__path__}
            for p in glob.glob(os.path.join(root, "nvidia", "cu*", "lib", "libcudart.so*"))]
    cudart = ctypes.CDLL(libs[0] if libs else "libcudart.so")
    variants = _variants()
    order, errors = [], {}
    cases = {}
    for shape in shapes:
        k, n = SHAPES[shape]
        mx.random.seed(0)
        x = (mx.random.normal((1, k)) * 0.5).astype(mx.bfloat16)
        w = (mx.random.normal((n, k)) * 0.02).astype(mx.bfloat16)
        mx.eval(x, w)
        ref = np.asarray(x.astype(mx.float32), np.float64) @ np.asarray(w.astype(mx.float32), np.float64).T
        scale = float(np.abs(ref).max())
        for name, fn in variants.items():
            got = np.asarray(fn(x, w).astype(mx.float32), np.float64)  # also compiles it
            errors[f"{shape}.{name}"] = float(np.abs(got - ref).max() / scale)
        cases[shape] = (x, w)
    mx.synchronize()
    cudart.cudaProfilerStart()
    for shape, (x, w) in cases.items():
        for _ in range(REPEATS):
            for name, fn in variants.items():
                mx.eval(fn(x, w))
                order.append((shape, name))
    mx.synchronize()
    cudart.cudaProfilerStop()
    out.mkdir(parents=True, exist_ok=True)
    (out / "gemv_order.json").write_text(json.dumps({"order": order, "errors": errors}))


def summarize(out: Path, log: Path) -> None:
    meta = json.loads((out / "gemv_order.json").read_text())
    lines = [line for line in log.read_text().splitlines() if line.startswith('"')]
    units = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
    durations, names = [], []
    for row in csv.DictReader(lines):
        if row["Metric Name"] == "gpu__time_duration.sum":
            durations.append(float(row["Metric Value"].replace(",", "")) * units[row["Metric Unit"]])
            names.append(re.sub(r"\(.*", "", row["Kernel Name"])[:60])
    order = [tuple(o) for o in meta["order"]]
    if len(durations) != len(order):
        print(f"!!! {len(durations)} kernels measured for {len(order)} calls; kernels: "
              f"{collections.Counter(names).most_common(8)}")
        return
    per: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    for key, us in zip(order, durations):
        per[key].append(us)
    result = {}
    for shape in dict.fromkeys(s for s, _ in order):
        k, n = SHAPES[shape]
        mb = k * n * 2 / 1e6
        row = {}
        for (s, name), times in per.items():
            if s == shape:
                best = min(times)
                row[name] = {"us": round(best, 2), "tb_s": round(mb / best / 1e6, 3),
                             "error": meta["errors"][f"{shape}.{name}"]}
        result[shape] = row
        cells = "  ".join(f"{name} {v['us']:7.2f}us {v['tb_s']:.2f}TB/s" for name, v in row.items())
        print(f"{shape:14s} {mb:7.1f}MB  {cells}")
    (out / "probe_gemv.json").write_text(json.dumps(result, indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES))
    p.add_argument("--summarize", type=Path, default=None, help="the ncu CSV log of a run")
    args = p.parse_args()
    if args.summarize is not None:
        summarize(args.out, args.summarize)
    else:
        run(args.out, args.shapes)


if __name__ == "__main__":
    main()

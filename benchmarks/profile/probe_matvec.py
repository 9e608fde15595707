"""The 4-bit matrix-vector product on this GPU: MLX's `quantized_matmul` against pymlxc's CUDA kernel.

(A dense bfloat16 kernel was probed the same way at commit 97ce951, `--kind dense`: no faster than
MLX's matmul, so it was removed; docs/performance.md gives its figures.)

Run through MLX's own Python API, so it needs no pymlxc build. For each weight shape of the
Llama-3.2-1B and Llama-3.1-8B decode steps (fused q/k/v, o, fused gate/up, down, output head):

* `error`: the largest difference of each kernel from a float32 reference (dequantized weights),
  over the largest reference value;
* `us_per_call`: wall time per product when distinct weights totalling at least `--bytes` are
  applied in one evaluation, so the weights come from memory, not the L2 cache;
* `stacked`: the same weights as one product with that many more rows, which measures the device
  alone (one host encode for many bytes), as GB/s.

`--x-rows` above the kernel's MAX_X_ROWS compares MLX with the kernel run on slices of that many
rows (`ours_slices`): a continuous batch's decode step has as many rows as running requests.

    python benchmarks/profile/probe_matvec.py --out DIR

Other layouts of the product, and the streaming read of the same bytes that bounds them, are
measured outside MLX by `probe_matvec_variants.py`.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from _matvec import SHAPES, load_matvec

kernels = load_matvec()
GROUP = 64  # --group-size: MLX's default; GGUF's Q4_0 / Q4_K repack to 32
DTYPE = mx.bfloat16  # --dtype: x and the scales (GGUF files compute in float16)


def _kernel(module: Any = kernels) -> Any:
    return mx.fast.cuda_kernel(module.QUANTIZED_NAME, list(module.QUANTIZED_INPUTS), list(module.OUTPUT_NAMES),
                               module.QUANTIZED_SOURCE, header=getattr(module, "QUANTIZED_HEADER", module.HEADER))


def _ours(kernel: Any, x: Any, q: Any, module: Any = kernels) -> Any:
    n, k = q[0].shape[0], x.shape[-1]
    geo = module.launch(x.shape[0], k, n, x.dtype, GROUP)
    return kernel(inputs=[x, *q], output_shapes=[(x.shape[0], n)], output_dtypes=[x.dtype], **geo)[0]


def _ours_slices(kernel: Any, x: Any, q: Any) -> Any:
    step = kernels.MAX_X_ROWS
    return mx.concatenate([_ours(kernel, x[i:i + step], q)
                           for i in range(0, x.shape[0], step)], axis=0)


def _mlx(x: Any, q: Any) -> Any:
    return mx.quantized_matmul(x, *q, transpose=True, group_size=GROUP, bits=4)


def _time(make_outputs: Any, repeats: int) -> float:
    mx.eval(make_outputs())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval(make_outputs())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def probe(shape: str, kernel: Any, min_bytes: int, x_rows: int, repeats: int, baseline: Any = None) -> dict[str, Any]:
    k, n = SHAPES[shape]
    mx.random.seed(0)
    x = (mx.random.normal((x_rows, k)) * 0.5).astype(DTYPE)
    dense = (mx.random.normal((n, k)) * 0.02).astype(DTYPE)
    q = mx.quantize(dense, GROUP, 4)
    mx.eval(x, *q)
    ref = np.array(x.astype(mx.float32) @ mx.dequantize(*q, group_size=GROUP, bits=4).astype(mx.float32).T)
    scale = float(np.abs(ref).max())
    out: dict[str, Any] = {"K": k, "N": n, "x_rows": x_rows, "error": {}}
    variants = {"mlx": lambda xx, qq: _mlx(xx, qq)}
    if x_rows <= kernels.MAX_X_ROWS:
        variants["ours"] = lambda xx, qq: _ours(kernel, xx, qq)
        if baseline is not None:
            module, base_kernel = baseline
            variants["baseline"] = lambda xx, qq: _ours(base_kernel, xx, qq, module=module)
    else:  # more rows than the kernel takes: in slices of MAX_X_ROWS rows, one launch each
        variants["ours_slices"] = lambda xx, qq: _ours_slices(kernel, xx, qq)
    for name, fn in variants.items():
        got = np.array(fn(x, q).astype(mx.float32))
        out["error"][name] = float(np.abs(got - ref).max() / scale)
    del dense
    weight_bytes = sum(a.nbytes for a in q)
    copies = max(1, -(-min_bytes // weight_bytes))
    many = [tuple(a + 0 for a in q) for _ in range(copies)]  # distinct buffers
    mx.eval(many)
    stacked = tuple(mx.concatenate([c[i] for c in many], axis=0) for i in range(3))
    mx.eval(stacked)
    out["copies"] = copies
    out["weight_mb"] = round(weight_bytes / 1e6, 2)
    out["us_per_call"], out["stacked_gbps"] = {}, {}
    for name, fn in variants.items():
        per = _time(lambda: [fn(x, c) for c in many], repeats) / copies
        out["us_per_call"][name] = round(per * 1e6, 2)
        whole = _time(lambda: fn(x, stacked), repeats)
        out["stacked_gbps"][name] = round(weight_bytes * copies / whole / 1e9, 1)
    mx.clear_cache()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--bytes", type=int, default=400_000_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--x-rows", type=int, nargs="+", default=[1])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
    parser.add_argument("--group-size", type=int, default=64, choices=(32, 64, 128))
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    parser.add_argument("--baseline", type=Path, help="another matvec.py to run beside this one")
    args = parser.parse_args()
    global GROUP, DTYPE
    GROUP, DTYPE = args.group_size, getattr(mx, args.dtype)
    kernel = _kernel()
    baseline = None
    if args.baseline is not None:
        module = load_matvec(args.baseline, "cuda_matvec_baseline")
        baseline = (module, _kernel(module))
    results = {"device": str(mx.default_device()), "mlx": mx.__version__, "group_size": GROUP,
               "dtype": args.dtype, "probes": {}}
    for rows in args.x_rows:
        for shape in args.shapes:
            key = f"{shape}.m{rows}"
            results["probes"][key] = r = probe(shape, kernel, args.bytes, rows, args.repeats, baseline)
            errs = " ".join(f"{k}={v:.1e}" for k, v in r["error"].items())
            us = " ".join(f"{k}={v}" for k, v in r["us_per_call"].items())
            gb = " ".join(f"{k}={v}" for k, v in r["stacked_gbps"].items())
            print(f"{key:16s} err {errs}\n{'':16s} us {us}\n{'':16s} GB/s {gb}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"probe_quantized_g{GROUP}.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

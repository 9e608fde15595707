"""The 4-bit product of a prompt chunk's rows on this GPU: pymlxc's tensor-core kernel
(`backends/metal/kernels/qmm.py`) against MLX's `quantized_matmul` at groups 64 and 32 (MLX 4-bit
and GGUF's Q4_0 / Q4_K repacked) and a dense float16 matmul, for the projections of Llama-3.2-1B
and Llama-3.1-8B (q/k/v and gate/up fused as the segmented decode fuses them).

Per shape, row count and side: microseconds per product when distinct weights totalling at least
--bytes are applied in one evaluation (so they come from memory, not the L2 cache; the clock covers
the evaluation alone, not the Python calls that build it), the tensor-core
rate that means (2 x rows x K x N over the time), and the largest difference from a float64 product
over the largest output.

    python benchmarks/profile/probe_qmm.py [--rows 16 128 512] [--shapes 1b.gate_up 8b.down] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import _path  # noqa: F401 - the checkout as installed
import numpy as np
from _timing import timed_evaluation

import pymlxc.core as mx
from pymlxc.backends.metal import kernel_choice
from pymlxc.backends.metal.kernels import qmm
from pymlxc.core.cuda_kernel import SharedKernel

SHAPES = {  # name: (K, N)
    "1b.qkv": (2048, 3072), "1b.o": (2048, 2048), "1b.gate_up": (2048, 16384), "1b.down": (8192, 2048),
    "8b.qkv": (4096, 6144), "8b.o": (4096, 4096), "8b.gate_up": (4096, 28672), "8b.down": (14336, 4096),
}


assert "pymlxc_qmm::dequant8<T>(q[j], s2, b2, d + 4 * j);" in qmm.SOURCE, "probe_qmm's variant no longer applies"
_NODEQUANT = SharedKernel("pymlxc_qmm4_nodequant", qmm.INPUTS, qmm.OUTPUT_NAMES, qmm.SOURCE.replace(
    "pymlxc_qmm::dequant8<T>(q[j], s2, b2, d + 4 * j);", "d[4 * j] = d[4 * j + 1] = d[4 * j + 2] = d[4 * j + 3] = q[j];"),
    header=qmm.HEADER)


def _nodequant(x: mx.Array, w: mx.Array, s: mx.Array, b: mx.Array, group: int) -> mx.Array:
    m, k = x.shape
    return _NODEQUANT()([x, w, s, b], output_shapes=[(m, w.shape[0])], output_dtypes=[x.dtype],
                        **qmm.launch(m, k, w.shape[0], x.dtype, group))[0]


def elementwise_dequantize(weight: mx.Array, scales: mx.Array, biases: mx.Array, group: int) -> mx.Array:
    """MLX's 4-bit `dequantize` as elementwise operations on broadcast views (one fused kernel
    inside `mx.compile`): each weight `scale * code + bias` in the scales' dtype."""
    n, words = weight.shape
    groups = words * 8 // group
    codes = mx.reshape(weight, (n, groups, group // 8, 1))
    q = mx.bitwise_and(mx.right_shift(codes, mx.arange(0, 32, 4, dtype=mx.uint32)), mx.array(15, dtype=mx.uint32))
    s, b = mx.reshape(scales, (n, groups, 1, 1)), mx.reshape(biases, (n, groups, 1, 1))
    return mx.reshape(q.astype(scales.dtype) * s + b, (n, words * 8))


def probe(k: int, n: int, rows: int, min_bytes: int, repeats: int, dtype: Any) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    dense = mx.array((rng.standard_normal((n, k)) * 0.02).astype(np.float32)).astype(dtype)
    x = mx.array(rng.standard_normal((rows, k)).astype(np.float32)).astype(dtype)
    xf = np.asarray(x.astype(mx.float32)).astype(np.float64)
    out: dict[str, Any] = {"K": k, "N": n, "rows": rows, "dtype": str(dtype)}
    flops = 2.0 * rows * k * n
    for group in (64, 32):
        w = mx.quantize(dense, group, 4)
        mx.eval(w)
        nbytes = sum(a.nbytes for a in w)
        copies = max(1, -(-min_bytes // nbytes))
        ws = [w] + [tuple(a + 0 for a in w) for _ in range(copies - 1)]
        deq = np.asarray(mx.dequantize(*w, group, 4).astype(mx.float32)).astype(np.float64)
        want = xf @ deq.T
        scale = float(np.abs(want).max()) or 1.0
        sides = {f"mlx_g{group}": lambda q, g=group: mx.quantized_matmul(x, *q, True, g, 4),
                 f"pymlxc_g{group}": lambda q, g=group: kernel_choice.qmm_product(x, *q, g)}
        # The kernel with the weights' codes copied into shared memory undequantized: what the
        # dequantization costs (its error is meaningless).
        sides[f"pymlxc_g{group}_nodequant"] = lambda q, g=group: _nodequant(x, *q, g)
        # MLX's dequantization of the weight alone, and followed by the dense product (what the
        # compiled prefill runs for large blocks, nn.dequantized_product); the first has no error.
        sides[f"dequantize_g{group}"] = lambda q, g=group: mx.dequantize(*q, g, 4)
        sides[f"dequantized_g{group}"] = lambda q, g=group: mx.matmul(x, mx.swapaxes(mx.dequantize(*q, g, 4), 0, 1))
        # The same two with the dequantization as shifts, masks and a multiply-add that MLX's
        # compiler fuses into one kernel, and with pymlxc's dequantization kernel (what the compiled
        # prefill hands its traces, kernel_choice.dequantized_weight).
        fused = mx.compile(lambda *q, g=group: elementwise_dequantize(*q, g))
        sides[f"elementwise_g{group}"] = lambda q, f=fused: f(*q)
        sides[f"elementwise_dequantized_g{group}"] = lambda q, f=fused: mx.matmul(x, mx.swapaxes(f(*q), 0, 1))
        takes = kernel_choice.dequantize_kernel_takes(*w, group, 4)  # False: MLX's dequantize, said below
        if not takes:
            print(f"kernel_dequantize*_g{group}: pymlxc's dequantization kernel does not run here; MLX's does")
        sides[f"kernel_dequantize_g{group}"] = lambda q, g=group, k=takes: kernel_choice.dequantized_weight(*q, g, 4, k)
        sides[f"kernel_dequantized_g{group}"] = lambda q, g=group, k=takes: mx.matmul(
            x, mx.swapaxes(kernel_choice.dequantized_weight(*q, g, 4, k), 0, 1))
        for name, fn in sides.items():
            got = np.asarray(fn(w).astype(mx.float32))
            t = timed_evaluation(lambda fn=fn, ws=ws: [fn(q) for q in ws], repeats) / copies
            out[name] = {"us": t * 1e6, "TFLOPs": flops / t / 1e12, "GBps": nbytes / t / 1e9,
                         "error": float(np.abs(got - want).max()) / scale if got.shape == want.shape else None}
    copies = max(1, -(-min_bytes // dense.nbytes))
    ds = [dense] + [dense + 0 for _ in range(copies - 1)]
    t = timed_evaluation(lambda: [mx.matmul(x, mx.swapaxes(d, 0, 1)) for d in ds], repeats) / copies
    out["dense"] = {"us": t * 1e6, "TFLOPs": flops / t / 1e12}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--rows", type=int, nargs="+", default=[16, 128, 512])
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    p.add_argument("--bytes", type=int, default=300_000_000, help="weight bytes per evaluation (beyond the L2 cache)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    results = []
    for rows in args.rows:
        for name in args.shapes:
            k, n = SHAPES[name]
            r = probe(k, n, rows, args.bytes, args.repeats, getattr(mx, args.dtype))
            r["shape"] = name
            results.append(r)
            sides = [s for s in r if isinstance(r[s], dict)]
            cells = [f"{s} {r[s]['us']:8.1f}us {r[s]['TFLOPs']:6.1f}TF" for s in sides]
            print(f"{name:12s} rows {rows:4d}  " + "  ".join(cells), flush=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "probe_qmm.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

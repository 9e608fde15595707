"""MLX's host cost per operation, by kind of operation, on this device.

A short prefill on a fast GPU is bound by the host: MLX's own work to encode each kernel (about 20
us a kernel in a 1B prefill of 128 tokens, docs/performance.md) rather than the kernels. This probe
says which kinds of operation cost the host most, so that the prefill can drop those first.

For each kind, a chain of --chain operations (each on the last one's output, so none can be
dropped or reordered) is built, then evaluated: `build_us` is Python's (the binding's) time per
operation, `encode_us` MLX's time per operation in `async_eval`, `eval_us` that and the wait for
the device (`_timing.time_chain`). With the `tiny` shapes (16 rows, 64 wide) the kernels do next to
no work, so `eval_us` is the host's cost; with the 1B prefill's shapes (128 rows, Llama-3.2-1B's
widths) it is the larger of host and device time. (`benchmarks/results/h100-op-host.json` predates
`encode_us`: its `eval_us` was one `eval`'s time.)

    python benchmarks/profile/probe_op_host.py [--chain 200] [--repeats 5] [--shapes tiny 1b-prefill-128] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _path  # noqa: F401 - the checkout as installed
import numpy as np
from _timing import time_chain

import pymlxc.core as mx
from pymlxc.backends.metal.kernels import add_rms_norm, qmm
from pymlxc.core.cuda_kernel import SharedKernel

_QMM = SharedKernel("pymlxc_qmm4_probe", qmm.INPUTS, qmm.OUTPUT_NAMES, qmm.SOURCE, header=qmm.HEADER)

Op = Callable[[Any], Any]


def _kinds(rows: int, width: int, heads: int, kv_heads: int, head_dim: int, dtype: Any) -> dict[str, tuple[Any, Op]]:
    """name: (the chain's first input, one operation on the last output)."""
    rng = np.random.default_rng(0)

    def arr(*shape: int) -> Any:
        return mx.array((rng.standard_normal(shape) * 0.05).astype(np.float32)).astype(dtype)

    x = arr(1, rows, width)
    w = arr(width, width)
    norm_w = arr(width)
    qw64, qw32 = mx.quantize(w, 64, 4), mx.quantize(w, 32, 4)
    q = arr(1, heads, rows, head_dim)
    k, v = arr(1, kv_heads, rows, head_dim), arr(1, kv_heads, rows, head_dim)
    silu_mul = mx.compile(lambda a: (a * mx.sigmoid(a)) * a)
    add_norm = mx.compile(lambda a: mx.fast.rms_norm(a + a, norm_w, 1e-5))
    buffer = mx.zeros((1, kv_heads, 4 * rows, head_dim), dtype)
    mx.eval(x, w, norm_w, *qw64, *qw32, q, k, v, buffer)

    return {
        "add": (x, lambda a: a + x),
        "compiled silu*mul": (x, silu_mul),
        "compiled add+rms_norm": (x, add_norm),
        "rms_norm": (x, lambda a: mx.fast.rms_norm(a, norm_w, 1e-5)),
        "matmul": (x, lambda a: a @ w.T),
        "quantized_matmul g64": (x, lambda a: mx.quantized_matmul(a, *qw64, transpose=True, group_size=64, bits=4)),
        "quantized_matmul g32": (x, lambda a: mx.quantized_matmul(a, *qw32, transpose=True, group_size=32, bits=4)),
        "rope": (q, lambda a: mx.fast.rope(a, head_dim, traditional=False, base=500000.0, scale=1.0, offset=0)),
        "sdpa causal": (q, lambda a: mx.fast.scaled_dot_product_attention(a, k, v, scale=head_dim ** -0.5,
                                                                            mask="causal")),
        "contiguous (transposed)": (q, lambda a: mx.contiguous(mx.swapaxes(a, 1, 2)).reshape(a.shape)),
        "cache write (slice_update)": (k, lambda a: _slice_update(buffer, a, rows)[:, :, rows:2 * rows, :]),
        "pymlxc custom kernel (add+rms_norm)": (x, lambda a: add_rms_norm.add_rms_norm(a, x, norm_w, 1e-5)[1]),
        "pymlxc qmm kernel g64": (x, lambda a: _qmm(a, qw64, 64)),
    }


def _qmm(x: Any, w: Any, group: int) -> Any:
    """pymlxc's tensor-core 4-bit product (kernels/qmm.py), as the op-by-op prefill calls it."""
    m, k = x.shape[1], x.shape[2]
    (y,) = _QMM()([mx.reshape(x, (m, k)), *w], output_shapes=[(m, w[0].shape[0])], output_dtypes=[x.dtype],
                  **qmm.launch(m, k, w[0].shape[0], x.dtype, group))
    return mx.reshape(y, (*x.shape[:-1], w[0].shape[0]))


def _slice_update(buffer: Any, update: Any, at: int) -> Any:
    start = [0, 0, at, 0]
    stop = [buffer.shape[0], buffer.shape[1], at + update.shape[2], buffer.shape[3]]
    return mx.slice_update(buffer, update, start, stop, [1, 1, 1, 1])


def _time_chain(first: Any, op: Op, chain: int, repeats: int) -> dict[str, Any]:
    """`_timing.time_chain`'s medians as this probe reports them: the build, and MLX's evaluation
    (its encoding and the wait for the device together)."""
    t = time_chain(mx, first, op, chain, repeats, warmups=2)  # two untimed: kernels compiled, clocks up
    return {"build_us": round(t["build_us_per_op"], 2), "encode_us": round(t["encode_us_per_op"], 2),
            "eval_us": round(t["encode_us_per_op"] + t["wait_us_per_op"], 2), "eval_us_runs": t["eval_us_runs"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chain", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--shapes", nargs="+", choices=("tiny", "1b-prefill-128"), default=["tiny", "1b-prefill-128"])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    results: dict[str, Any] = {"device": str(mx.default_device()), "chain": args.chain}
    shapes = {"tiny": (16, 64, 4, 1, 16), "1b-prefill-128": (128, 2048, 32, 8, 64)}
    for label in args.shapes:
        rows, width, heads, kv, hd = shapes[label]
        table = {}
        for name, (first, op) in _kinds(rows, width, heads, kv, hd, mx.bfloat16).items():
            try:
                table[name] = _time_chain(first, op, args.chain, args.repeats)
            except Exception as exc:  # a kind this device lacks: said, the others still timed
                table[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            print(f"{label:16s} {name:28s} {table[name]}", flush=True)
        results[label] = table
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "probe_op_host.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

"""Whether running a dense model first changes a 4-bit MoE model's logits, and on which side.

On the H100 the 4-bit qwen3_moe parity test passes alone but fails after the dense qwen3_moe case
in the same process. This writes both tiny models, then in one process runs (optionally) the dense
pair first and then the 4-bit pair, saving the 4-bit logits of each side; run it twice (with and
without --dense-first) and compare the saved logits: the side whose logits move is the one that
carries state from the dense model.

    python benchmarks/probe_moe_order.py --out DIR [--dense-first]
"""
from __future__ import annotations

import _path  # noqa: F401 - the checkout as installed

import argparse
from pathlib import Path

import mlx.core as mlx
import numpy as np
from mlx_lm.utils import load_model

import pymlxc.core as mx
from pymlxc.backends.metal.loader import load_weights_and_config
from pymlxc.testing import write_tiny_model


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--arch", default="qwen3_moe")
    p.add_argument("--dense-first", action="store_true")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    ids = np.random.default_rng(1).integers(16, 500, size=(2, 12)).astype(np.int32)
    order = [None, 4] if args.dense_first else [4]
    tag = "dense-first" if args.dense_first else "alone"
    for bits in order:
        path = write_tiny_model(args.out / f"{args.arch}-{bits}", args.arch, quantize_bits=bits)
        ours = load_weights_and_config(path)
        ref = load_model(path)[0]
        a = np.asarray(mx.astype(ours.model(mx.array(ids)), mx.float32))
        b = np.array(ref(mlx.array(ids)).astype(mlx.float32))
        print(f"{tag} bits={bits}: ours vs mlx-lm {np.abs(a - b).max():.3e}", flush=True)
        if bits == 4:
            np.save(args.out / f"ours-{tag}.npy", a)
            np.save(args.out / f"ref-{tag}.npy", b)
        ours.free()
    other = "alone" if args.dense_first else "dense-first"
    if (args.out / f"ours-{other}.npy").exists():
        for side in ("ours", "ref"):
            x, y = np.load(args.out / f"{side}-{tag}.npy"), np.load(args.out / f"{side}-{other}.npy")
            print(f"{side}: 4-bit logits alone vs after the dense model: {np.abs(x - y).max():.3e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

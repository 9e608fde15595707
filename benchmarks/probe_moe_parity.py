"""Where a quantized mixture-of-experts model's logits leave mlx-lm's, layer by layer.

On the H100 the 4-bit qwen3_moe / qwen2_moe / gemma4 parity tests differ from mlx-lm by up to 4 in
the logits, while the dense ones agree. This feeds the *same* hidden state (mlx-lm's) into each
layer of both models and compares, per layer: the router's probabilities, the chosen experts, the
smallest gap between the k-th and the (k+1)-th probability (a near tie flips on any rounding), the
experts' output for the *same* chosen experts, and the layer's output. A difference that starts in
the experts' output with equal choices is in the expert product; one that starts with a flipped
choice at a near tie is rounding amplified by the routing.

    python benchmarks/probe_moe_parity.py [--arch qwen3_moe] [--bits 4] [--tokens 48] [--batch 2]
"""
from __future__ import annotations

import _path  # noqa: F401 - the checkout as installed

import argparse
import tempfile
from pathlib import Path
from typing import Any

import mlx.core as mlx
import numpy as np
from mlx_lm.utils import load_model

import pymlxc.core as mx
from pymlxc.backends.metal.loader import load_weights_and_config
from pymlxc.testing import write_tiny_model


def _np(a: Any) -> np.ndarray:
    return np.array(a.astype(mlx.float32)) if isinstance(a, mlx.array) else np.asarray(mx.astype(a, mx.float32))


def _ours(a: np.ndarray | Any) -> Any:
    return mx.array(np.asarray(a))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="qwen3_moe", choices=["qwen3_moe", "qwen2_moe"])
    p.add_argument("--bits", type=int, default=4, help="0: dense")
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seed", type=int, default=8, help="of the prompt ids (the parity tests' prompt_ids: 1)")
    p.add_argument("--repeat", type=int, default=1, help="run the whole comparison this many times (determinism)")
    args = p.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        path = write_tiny_model(Path(tmp) / args.arch, args.arch, quantize_bits=args.bits or None)
        ours = load_weights_and_config(path)
        ref = load_model(path)[0]
    print(f"{args.arch} bits={args.bits or 'dense'}")
    ids = np.random.default_rng(args.seed).integers(16, 500, size=(args.batch, args.tokens)).astype(np.int32)
    for _ in range(args.repeat):
        _compare(ours, ref, ids)
    ours.free()
    return 0


def _compare(ours: Any, ref: Any, ids: np.ndarray) -> None:
    print(f"ids {ids.shape} on {mlx.default_device()}")
    h_ref = ref.model.embed_tokens(mlx.array(ids))
    print("embedding diff", float(np.abs(_np(ours.model.model.embed_tokens(_ours(ids))) - _np(h_ref)).max()))
    for i, (ol, rl) in enumerate(zip(ours.model.model.layers, ref.model.layers)):
        x_np = _np(h_ref)
        out_o = ol(_ours(x_np).astype(ol.input_layernorm.weight.dtype), "causal", None)
        out_r = rl(h_ref, "causal", None)
        line = f"layer {i:2d}: out diff {np.abs(_np(out_o) - _np(out_r)).max():.3e}"
        mlp_o, mlp_r = getattr(ol, "mlp", None), getattr(rl, "mlp", None)
        if mlp_o is not None and hasattr(mlp_o, "switch_mlp") and hasattr(mlp_r, "gate"):
            # The MoE block on the same normed input: mlx-lm's residual stream after attention.
            h_mid = h_ref + rl.self_attn(rl.input_layernorm(h_ref), "causal", None)
            xn_r = rl.post_attention_layernorm(h_mid)
            xn_o = _ours(_np(xn_r)).astype(ol.input_layernorm.weight.dtype)
            g_r = _np(mlx.softmax(mlp_r.gate(xn_r), axis=-1, precise=True))
            g_o = _np(mx.softmax(mlp_o.gate(xn_o), axis=-1, precise=True))
            k = mlp_o.top_k
            top_r = np.sort(np.argsort(-g_r, axis=-1)[..., :k], axis=-1)
            top_o = np.sort(np.argsort(-g_o, axis=-1)[..., :k], axis=-1)
            srt = np.sort(g_r, axis=-1)[..., ::-1]
            margin = float((srt[..., k - 1] - srt[..., k]).min())
            inds = mlx.array(top_r.astype(np.uint32))
            y_r = _np(mlp_r.switch_mlp(xn_r, inds))
            y_o = _np(mlp_o.switch_mlp(xn_o, _ours(top_r.astype(np.uint32))))
            line += (f" | router diff {np.abs(g_o - g_r).max():.2e}, choices equal "
                     f"{(top_o == top_r).all(axis=-1).mean():.3f}, min top-k gap {margin:.2e}"
                     f" | experts' output diff (same choices) {np.abs(y_o - y_r).max():.3e}"
                     f" of |y| {np.abs(y_r).max():.2f}")
        print(line, flush=True)
        h_ref = out_r
    logits_o = _np(ours.model(_ours(ids)))
    logits_r = _np(ref(mlx.array(ids)))
    print(f"logits diff {np.abs(logits_o - logits_r).max():.3e}")


if __name__ == "__main__":
    raise SystemExit(main())

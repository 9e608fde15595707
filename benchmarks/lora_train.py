"""LoRA training speed and memory: pymlxc against mlx-lm on the same weights and batches.

Two models, both random: a tiny llama (`pymlxc.testing.write_tiny_model`) and a model of
Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 heads, 2 kv heads, intermediate 4864, vocab 151936,
tied embeddings) built in memory. For each, LoRA (rank 8, alpha 16, q_proj/v_proj, all blocks) is
trained for a few AdamW steps on random tokens with float32 and with bfloat16 adapter weights (and,
with --checkpoint, per-block gradient checkpointing); mlx-lm trains the same adapter on the same
batches for comparison. Reported: trained tokens per second (after one warm-up step) and peak
memory (MLX's allocator, weights included), each configuration in a fresh process so that peaks do
not mix.

    python benchmarks/lora_train.py                      # both models, CPU
    python benchmarks/lora_train.py --skip-big --steps 10
    python benchmarks/lora_train.py --big-steps 2 --big-seq 32 --json results.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

QWEN05_SHAPE = {
    "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 896, "num_hidden_layers": 24,
    "num_attention_heads": 14, "num_key_value_heads": 2, "intermediate_size": 4864, "vocab_size": 151936,
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True,
    "hidden_act": "silu", "torch_dtype": "float32",
}


def _tiny_dir(root: Path) -> Path:
    from pymlxc.testing import write_tiny_model

    path = root / "tiny"
    if not (path / "config.json").is_file():
        write_tiny_model(path, "llama", seed=0)
    return path


def _random_weights(names_shapes: dict[str, tuple[int, ...]], dtype: str, seed: int) -> dict[str, Any]:
    import pymlxc.core as mx

    dt = {"float32": mx.float32, "bfloat16": mx.bfloat16}[dtype]
    keys = mx.random.split(mx.random.key(seed), len(names_shapes))
    out = {}
    for i, (name, shape) in enumerate(sorted(names_shapes.items())):
        if name.endswith("norm.weight"):
            out[name] = mx.ones(shape, dt)
        else:
            out[name] = (mx.random.normal(shape, mx.float32, key=keys[i]) * 0.02).astype(dt)
    return out


def _load_ours(which: str, root: Path, base_dtype: str) -> Any:
    """A MetalTextModel: the tiny model from disk, or the 0.5B shape built in memory."""
    import pymlxc
    from pymlxc.backends.metal import _model_info
    from pymlxc.backends.metal.loader import build_model
    from pymlxc.backends.metal.models import qwen2
    from pymlxc.backends.metal.textmodel import MetalTextModel
    from pymlxc.backends.metal.tokenizer import Tokenizer

    tiny = _tiny_dir(root)
    if which == "tiny":
        return pymlxc.load_model(str(tiny), backend="metal")
    config = dict(QWEN05_SHAPE, torch_dtype=base_dtype)
    skeleton = qwen2.Model(qwen2.ModelArgs.from_dict(config))
    shapes = {k: tuple(v.shape) for k, v in skeleton.parameters().items()}
    del skeleton
    raw = _random_weights(shapes, base_dtype, seed=0)
    loaded = build_model(config, raw, {k: Path("random") for k in raw}, source=Path("random/config.json"),
                         root=Path("random"), context_len=4096, progress=None)
    # the tokenizer is never used (batches are random ids); any will do
    return MetalTextModel(loaded.model, Tokenizer(tiny), model_type="qwen2", info=_model_info(loaded),
                          release=loaded.free)


def _batches(vocab: int, batch: int, seq: int, n: int, seed: int = 0) -> list[list[list[int]]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, (batch, seq + 1)).tolist() for _ in range(n)]


def run_ours(which: str, root: Path, adapter_dtype: str, base_dtype: str, steps: int, batch: int, seq: int,
             checkpoint: bool) -> dict[str, Any]:
    import pymlxc.core as mx
    from pymlxc.training import LoRAConfig, TrainConfig, Trainer
    from pymlxc.training.data import Example, make_batch

    model = _load_ours(which, root, base_dtype)
    vocab = model.info().vocab_size
    weights_bytes = mx.get_active_memory()
    adapter = model.apply_lora(LoRAConfig(rank=8, alpha=16, dtype=adapter_dtype), seed=0)
    trainer = Trainer(model, TrainConfig(learning_rate=1e-4, batch_size=batch, max_seq_length=seq), adapter)
    model.set_grad_checkpoint(checkpoint)
    adapter.set_training(True)
    batches = [make_batch([Example(tuple(row), 0, "random") for row in rows], seq)
               for rows in _batches(vocab, batch, seq, steps + 1)]
    mx.reset_peak_memory()
    losses, t0, tokens = [], 0.0, 0
    for i, b in enumerate(batches):
        if i == 1:
            t0 = time.perf_counter()
        losses.append(trainer.step(b))
        if i >= 1:
            tokens += b.ntokens
    seconds = time.perf_counter() - t0
    return {"impl": "pymlxc", "model": which, "adapter_dtype": adapter_dtype, "base_dtype": base_dtype,
            "grad_checkpoint": checkpoint, "steps": steps, "batch": batch, "seq": seq,
            "tokens_per_sec": tokens / seconds, "step_seconds": seconds / steps,
            "peak_memory_mb": mx.get_peak_memory() / 2**20, "weights_mb": weights_bytes / 2**20,
            "adapter_params": adapter.total_params(), "losses": losses}


def run_mlx_lm(which: str, root: Path, adapter_dtype: str, base_dtype: str, steps: int, batch: int, seq: int,
               checkpoint: bool) -> dict[str, Any]:
    import mlx.core as M
    import mlx.nn as nn
    import mlx.optimizers as optim
    import numpy as np
    from mlx.utils import tree_flatten, tree_map
    from mlx_lm.tuner.trainer import grad_checkpoint
    from mlx_lm.tuner.utils import linear_to_lora_layers

    if which == "tiny":
        import mlx_lm

        model, _ = mlx_lm.load(str(_tiny_dir(root)))
    else:
        from mlx_lm.models import qwen2 as ref_qwen2

        config = dict(QWEN05_SHAPE)
        model = ref_qwen2.Model(ref_qwen2.ModelArgs.from_dict(config))
        dt = {"float32": M.float32, "bfloat16": M.bfloat16}[base_dtype]
        key = M.random.key(0)
        params = []
        for name, p in tree_flatten(model.parameters()):
            key, sub = M.random.split(key)
            value = M.ones(p.shape, dt) if name.endswith("norm.weight") else (M.random.normal(p.shape, key=sub) * 0.02).astype(dt)
            params.append((name, value))
        model.load_weights(params)
        M.eval(model.parameters())
    vocab = model.args.vocab_size
    weights_bytes = M.get_active_memory()
    model.freeze()
    linear_to_lora_layers(model, len(model.layers), {"rank": 8, "scale": 2.0, "dropout": 0.0,
                                                      "keys": ["self_attn.q_proj", "self_attn.v_proj"]})
    if adapter_dtype == "bfloat16":
        model.update(tree_map(lambda a: a.astype(M.bfloat16), model.trainable_parameters()))
    if checkpoint:
        grad_checkpoint(model.layers[0])
    model.train()

    def loss_fn(model: Any, inputs: Any, targets: Any) -> Any:
        return nn.losses.cross_entropy(model(inputs), targets).astype(M.float32).mean()

    value_and_grad = nn.value_and_grad(model, loss_fn)
    opt = optim.AdamW(learning_rate=1e-4, weight_decay=0.01, bias_correction=True)
    M.reset_peak_memory()
    losses, t0, tokens = [], 0.0, 0
    for i, rows in enumerate(_batches(vocab, batch, seq, steps + 1)):
        if i == 1:
            t0 = time.perf_counter()
        x = M.array(np.array(rows, dtype=np.int32))
        loss, grads = value_and_grad(model, x[:, :-1], x[:, 1:])
        opt.update(model, grads)
        M.eval(loss, model.trainable_parameters(), opt.state)
        losses.append(loss.item())
        if i >= 1:
            tokens += batch * seq
    seconds = time.perf_counter() - t0
    return {"impl": "mlx-lm", "model": which, "adapter_dtype": adapter_dtype, "base_dtype": base_dtype,
            "grad_checkpoint": checkpoint, "steps": steps, "batch": batch, "seq": seq,
            "tokens_per_sec": tokens / seconds, "step_seconds": seconds / steps,
            "peak_memory_mb": M.get_peak_memory() / 2**20, "weights_mb": weights_bytes / 2**20,
            "losses": losses}


def _one(args: argparse.Namespace) -> int:
    """Child process: run one configuration, print its JSON on the last line."""
    fn = run_ours if args.impl == "pymlxc" else run_mlx_lm
    result = fn(args.model, Path(args.root), args.adapter_dtype, args.base_dtype, args.steps, args.batch, args.seq,
                args.checkpoint)
    print(json.dumps(result))
    return 0


def _spawn(impl: str, model: str, root: Path, adapter_dtype: str, base_dtype: str, steps: int, batch: int,
           seq: int, checkpoint: bool) -> dict[str, Any] | None:
    cmd = [sys.executable, __file__, "--one", "--impl", impl, "--model", model, "--root", str(root),
           "--adapter-dtype", adapter_dtype, "--base-dtype", base_dtype, "--steps", str(steps),
           "--batch", str(batch), "--seq", str(seq)] + (["--checkpoint"] if checkpoint else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if proc.returncode != 0:
        print(f"  {impl} {model} {adapter_dtype}: failed\n{proc.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=5, help="timed steps on the tiny model (after 1 warm-up)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--big-steps", type=int, default=2, help="timed steps on the 0.5B-shaped model")
    p.add_argument("--big-batch", type=int, default=1)
    p.add_argument("--big-seq", type=int, default=32)
    p.add_argument("--base-dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--skip-big", action="store_true")
    p.add_argument("--skip-mlx-lm", action="store_true")
    p.add_argument("--checkpoint", action="store_true", help="also measure per-block gradient checkpointing")
    p.add_argument("--json", default=None, help="write all results here")
    # child-process arguments
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--impl", default="pymlxc", help=argparse.SUPPRESS)
    p.add_argument("--model", default="tiny", help=argparse.SUPPRESS)
    p.add_argument("--root", default=None, help=argparse.SUPPRESS)
    p.add_argument("--adapter-dtype", default="float32", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        return _one(args)

    import pymlxc.core as mx

    print(f"device: {mx.default_device()}, {os.cpu_count()} CPU(s)", file=sys.stderr)
    root = Path(tempfile.mkdtemp(prefix="lora_bench_"))
    _tiny_dir(root)
    plan = [("tiny", args.steps, args.batch, args.seq)]
    if not args.skip_big:
        plan.append(("qwen2.5-0.5b-shape", args.big_steps, args.big_batch, args.big_seq))
    results = []
    for model, steps, batch, seq in plan:
        for checkpoint in ([False, True] if args.checkpoint else [False]):
            for dtype in ("float32", "bfloat16"):
                for impl in ("pymlxc",) + (() if args.skip_mlx_lm else ("mlx-lm",)):
                    print(f"{impl:7s} {model} {dtype} adapters{' + checkpointing' if checkpoint else ''} ...",
                          file=sys.stderr, flush=True)
                    r = _spawn(impl, "tiny" if model == "tiny" else "big", root, dtype, args.base_dtype, steps,
                               batch, seq, checkpoint)
                    if r is not None:
                        r["model"] = model
                        results.append(r)
    print(f"\n{'impl':8s} {'model':20s} {'adapters':9s} {'ckpt':5s} {'batch x seq':12s} {'tok/s':>9s} "
          f"{'s/step':>8s} {'peak MB':>9s} {'weights MB':>10s}")
    for r in results:
        print(f"{r['impl']:8s} {r['model']:20s} {r['adapter_dtype']:9s} {'yes' if r['grad_checkpoint'] else 'no':5s} "
              f"{str(r['batch']) + ' x ' + str(r['seq']):12s} {r['tokens_per_sec']:9.1f} {r['step_seconds']:8.2f} "
              f"{r['peak_memory_mb']:9.1f} {r['weights_mb']:10.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

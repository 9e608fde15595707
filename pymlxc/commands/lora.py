"""`pymlxc lora` (fine-tune a LoRA adapter) and `pymlxc fuse` (fold an adapter into the weights).

    pymlxc lora MODEL --data DIR --adapter-path adapters --iters 600 --rank 8 --alpha 16
    pymlxc lora MODEL --data DIR --adapter-path adapters --iters 1200 --resume
    pymlxc fuse MODEL --adapter-path adapters --save-path fused [--dequantize]
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pymlxc.training import LoRAConfig, TrainConfig


def _configure_lora(p: argparse.ArgumentParser) -> None:
    from pymlxc.cli import add_load_arguments

    add_load_arguments(p)
    p.set_defaults(backend="metal")
    p.add_argument("--data", required=True, help="directory with train.jsonl (and valid.jsonl), or one .jsonl file")
    p.add_argument("--adapter-path", default="adapters", help="where adapters and checkpoints go (default: adapters)")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint in --adapter-path")
    # LoRA options default to None, "not given": a resumed run takes the checkpoint's values for them.
    g = p.add_argument_group("LoRA (defaults, or with --resume the checkpoint's)")
    g.add_argument("--rank", type=int, default=None, help="default: 8")
    g.add_argument("--alpha", type=float, default=None, help="the update is scaled by alpha / rank (default: 16)")
    g.add_argument("--keys", nargs="+", default=None, help="linear layers to adapt, by name (default: q_proj v_proj)")
    g.add_argument("--num-layers", type=int, default=None, help="adapt the last N blocks (default: all)")
    g.add_argument("--dropout", type=float, default=None, help="default: 0")
    g.add_argument("--lora-dtype", choices=("float32", "bfloat16"), default=None, help="default: float32")
    t = p.add_argument_group("training")
    t.add_argument("--iters", type=int, default=1000)
    t.add_argument("--batch-size", type=int, default=4)
    t.add_argument("--learning-rate", type=float, default=1e-5)
    t.add_argument("--weight-decay", type=float, default=0.01)
    t.add_argument("--max-grad-norm", type=float, default=None, help="clip gradients to this global norm")
    t.add_argument("--lr-schedule", choices=("constant", "cosine"), default="constant")
    t.add_argument("--warmup-steps", type=int, default=0)
    t.add_argument("--max-seq-length", type=int, default=2048)
    t.add_argument("--no-mask-prompt", action="store_true", help="let prompt tokens count in the loss too")
    t.add_argument("--grad-checkpoint", action="store_true", help="recompute block activations in backward")
    t.add_argument(
        "--valid-split", type=float, default=None, help="hold out this fraction when there is no valid.jsonl"
    )
    t.add_argument("--steps-per-report", type=int, default=10)
    t.add_argument("--steps-per-eval", type=int, default=200)
    t.add_argument("--val-batches", type=int, default=25)
    t.add_argument("--save-every", type=int, default=100)
    t.add_argument("--seed", type=int, default=0)
    p.add_argument("--export-peft", default=None, metavar="DIR", help="also write the final adapter in PEFT's format")


def check_lora_arguments(args: argparse.Namespace) -> None:
    """The numbers LoRAConfig and TrainConfig also refuse (non-finite rates, scales and fractions, a
    negative warm-up), checked here before the model loads and named as the command's options;
    the configs, made after the load, keep the checks for API callers."""
    for option, value in (("--learning-rate", args.learning_rate), ("--weight-decay", args.weight_decay),
                          ("--alpha", args.alpha), ("--dropout", args.dropout),
                          ("--max-grad-norm", args.max_grad_norm), ("--valid-split", args.valid_split)):
        if value is not None and not math.isfinite(value):
            raise ValueError(f"{option} must be a finite number, not {value}")
    if args.warmup_steps < 0:
        raise ValueError(f"--warmup-steps must be >= 0, not {args.warmup_steps}")


def check_lora_data(data: str, config: TrainConfig) -> None:
    """The dataset's records read and counted against --batch-size before the model loads (which
    can take minutes): `train` refuses fewer examples than one batch, and a malformed line too."""
    from pymlxc.training.data import load_records

    train, valid = load_records(data, config.valid_split, config.seed)
    if len(train) < config.batch_size:
        held = f" (after holding out {len(valid)} for validation)" if valid and valid[0].source == train[0].source \
            else ""
        raise ValueError(f"--batch-size {config.batch_size} is larger than the training set: {train[0].source} has "
                         f"only {len(train)} examples{held}")


# command-line option (argparse's name) -> LoRAConfig field
_LORA_OPTIONS = {"rank": "rank", "alpha": "alpha", "keys": "target_keys", "num_layers": "num_layers",
                 "dropout": "dropout", "lora_dtype": "dtype"}


def lora_config(args: argparse.Namespace) -> LoRAConfig:
    """The LoRA options given, over LoRAConfig's defaults or, with --resume, over the checkpoint's
    config: that is the adapter that resumes (`train` refuses a config that differs from it), so
    a resumed run without LoRA options must not ask for the defaults."""
    from pymlxc.training import LoRAConfig
    from pymlxc.training.trainer import STATE_FILE, read_resume_state

    given: dict[str, Any] = {field: getattr(args, option) for option, field in _LORA_OPTIONS.items()
                             if getattr(args, option) is not None}
    if "target_keys" in given:
        given["target_keys"] = tuple(given["target_keys"])
    state_file = Path(args.adapter_path) / STATE_FILE
    if args.resume and state_file.is_file():  # when missing, `train` says it cannot resume
        _, saved = read_resume_state(state_file)
        return dataclasses.replace(saved, **given)
    return LoRAConfig(**given)


def _run_lora(args: argparse.Namespace) -> int:
    from pymlxc.cli import load
    from pymlxc.training import TrainConfig, train

    check_lora_arguments(args)
    config = TrainConfig(
        iters=args.iters, batch_size=args.batch_size, learning_rate=args.learning_rate,
        weight_decay=args.weight_decay, max_grad_norm=args.max_grad_norm, lr_schedule=args.lr_schedule,
        warmup_steps=args.warmup_steps, max_seq_length=args.max_seq_length, mask_prompt=not args.no_mask_prompt,
        grad_checkpoint=args.grad_checkpoint, valid_split=args.valid_split, steps_per_report=args.steps_per_report,
        steps_per_eval=args.steps_per_eval, val_batches=args.val_batches, save_every=args.save_every,
        seed=args.seed, resume=args.resume, progress=not args.quiet)
    check_lora_data(args.data, config)
    lora = lora_config(args)
    with load(args) as model:
        if not args.quiet:
            print(
                f"training a LoRA adapter (rank {lora.rank}, alpha {lora.alpha:g}, keys {' '.join(lora.target_keys)}) "
                f"for {config.iters} steps",
                file=sys.stderr,
            )
        result = train(model, args.data, args.adapter_path, lora=lora, config=config)
        if args.export_peft:
            model.adapter.save(args.export_peft, format="peft")
    if not args.quiet:
        last = result.train_losses[-1][1] if result.train_losses else float("nan")
        print(f"done: {result.steps} steps, final loss {last:.4f}, {result.tokens_per_sec:,.0f} trained tok/s, "
              f"peak memory {result.peak_memory / 2**20:.1f} MB; adapter in {result.adapter_path}", file=sys.stderr)
    return 0


def _configure_fuse(p: argparse.ArgumentParser) -> None:
    from pymlxc.cli import add_load_arguments

    add_load_arguments(p)
    p.set_defaults(backend="metal")
    p.add_argument("--adapter-path", required=True, help="adapter directory (mlx-lm or PEFT format)")
    p.add_argument("--save-path", required=True, help="directory for the fused model")
    p.add_argument("--dequantize", action="store_true",
                   help="save a quantized base dense (default: requantize with its own bits and group size)")


def _run_fuse(args: argparse.Namespace) -> int:
    from pymlxc.cli import load

    with load(args) as model:
        model.load_adapter(args.adapter_path)
        out = model.save_fused(args.save_path, args.model, dequantize=args.dequantize)
    if not args.quiet:
        print(f"fused model written to {out}", file=sys.stderr)
    return 0


def register_commands(register: Callable[[Any], None]) -> None:
    from pymlxc.cli import Command

    register(Command("lora", "fine-tune a LoRA adapter on JSON Lines data", _configure_lora, _run_lora))
    register(Command("fuse", "fold a LoRA adapter into a model's weights and save it", _configure_fuse, _run_fuse))

"""`pymlxc.train`: LoRA fine-tuning of a model on JSON Lines data, with validation, a progress line,
periodic adapter checkpoints, and resuming from the last one.

One step: a padded batch goes through the model (adapter weights as the inputs of
`value_and_grad`), the masked cross-entropy of the next tokens is the loss, AdamW updates the adapter.
Everything random (LoRA init, batch order, dropout) comes from `TrainConfig.seed`, so two runs with
the same seed give the same losses, and a resumed run continues the same sequence.

The adapter directory holds what mlx-lm writes (`adapters.safetensors`, `adapter_config.json`,
`0000100_adapters.safetensors` snapshots) plus `training_state.safetensors` (adapter weights and
AdamW moments) and `training_state.json` (step, configs, loss history) for resuming.
"""
from __future__ import annotations

import dataclasses
import json
import math
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from tqdm import tqdm

import pymlxc.core as mx
from pymlxc.core import Array
from pymlxc.files import read_json
from pymlxc.safetensors_check import checked_load

from .adapters import MLX_WEIGHTS
from .config import LoRAConfig, SupportsTraining, TrainableModel, TrainConfig
from .data import (
    Batch,
    Example,
    check_batch_size,
    check_token_ids,
    check_trained_tokens,
    count_truncated,
    iterate_batches,
    load_records,
    tokenize_all,
)
from .losses import masked_cross_entropy
from .optim import AdamW, cosine_schedule

STATE_FILE = "training_state.json"
STATE_ARRAYS = "training_state.safetensors"  # the adapter under its own names, and the optimizer's moments


@dataclass
class TrainReport:
    """One line of progress: passed to the `callback` of `train` and kept in `TrainResult`."""

    step: int
    train_loss: float | None = None
    val_loss: float | None = None
    learning_rate: float = 0.0
    tokens_per_sec: float = 0.0
    trained_tokens: int = 0
    peak_memory: int = 0


@dataclass
class TrainResult:
    adapter_path: Path
    steps: int
    train_losses: list[tuple[int, float]] = field(default_factory=list)  # (step, loss) per report
    val_losses: list[tuple[int, float]] = field(default_factory=list)
    step_losses: list[float] = field(default_factory=list)  # every step of this run
    trained_tokens: int = 0
    tokens_per_sec: float = 0.0  # over the training steps (validation and checkpoints not counted)
    seconds: float = 0.0  # wall time of the run
    peak_memory: int = 0


class Progress:
    """A tqdm bar of the steps with the latest loss, validation loss, speed and learning rate as its
    postfix; silent when the stream is not a terminal (the callback still gets every report)."""

    def __init__(self, total: int, stream: TextIO | None = None, enabled: bool = True) -> None:
        # disable=None is tqdm's own "only on a terminal" check.
        self._bar = tqdm(total=total, file=stream or sys.stderr, disable=None if enabled else True,
                         unit="step", dynamic_ncols=True, leave=True)

    def show(self, r: TrainReport) -> None:
        if self._bar.disable:
            return
        postfix: dict[str, str] = {}
        if r.train_loss is not None:
            postfix["loss"] = f"{r.train_loss:.4f}"
        if r.val_loss is not None:
            postfix["val"] = f"{r.val_loss:.4f}"
        postfix["tok/s"] = f"{r.tokens_per_sec:,.0f}"
        postfix["lr"] = f"{r.learning_rate:.2e}"
        self._bar.set_postfix(postfix, refresh=False)
        self._bar.update(max(0, r.step - self._bar.n))

    def close(self) -> None:
        self._bar.close()


def _schedule(config: TrainConfig) -> Any:
    if config.lr_schedule == "cosine":
        return cosine_schedule(config.learning_rate, config.iters, config.warmup_steps)
    if config.warmup_steps:
        peak, warm = config.learning_rate, config.warmup_steps
        return lambda step: peak * min(1.0, step / warm)
    return config.learning_rate


def make_optimizer(config: TrainConfig) -> AdamW:
    return AdamW(learning_rate=_schedule(config), betas=config.betas, eps=config.eps,
                 weight_decay=config.weight_decay, max_grad_norm=config.max_grad_norm)


def _dropout_seed(seed: int, step: int) -> int:
    return (seed * 1_000_003 + step) & 0x7FFFFFFF


class Trainer:
    """The pieces of `train`, usable one at a time (the benchmark and tests drive `step` directly)."""

    def __init__(self, model: Any, config: TrainConfig, adapter: Any) -> None:
        self.model = model
        self.config = config
        self.adapter = adapter
        self.optimizer = make_optimizer(config)
        self.params: dict[str, Array] = adapter.trainable_parameters()

        def loss_fn(params: dict[str, Array], inputs: Array, targets: Array, mask: Array) -> tuple[Array, Array]:
            adapter.update(params)
            return masked_cross_entropy(model.logits(inputs), targets, mask)

        self._loss_fn = loss_fn
        self._value_and_grad = mx.value_and_grad(loss_fn)

    def step(self, batch: Batch) -> float:
        """One optimizer step on `batch`; returns its loss. A non-finite loss or update raises
        FloatingPointError naming the step, and the adapter keeps the weights it had before it and
        the optimizer its step count and moments (a NaN gradient in them would spoil every later step)."""
        step = self.optimizer.step + 1
        self.adapter.reseed_dropout(_dropout_seed(self.config.seed, step))
        (loss, _), grads = self._value_and_grad(self.params, batch.inputs, batch.targets, batch.mask)
        before, optimizer_before = self.params, self.optimizer.snapshot()
        params = self.optimizer.update(self.params, grads)
        # One flag for every updated weight: an overflow in the update with a finite loss would
        # otherwise only show as NaN outputs later.
        finite = mx.all(mx.stack([mx.all(mx.isfinite(p)) for p in params.values()]))
        mx.eval([loss, finite, *params.values(), *self.optimizer.state_arrays()])
        value = float(loss.item())
        if not math.isfinite(value) or not bool(finite.item()):
            self.adapter.update(before)
            self.optimizer.restore(optimizer_before)
            what = f"the loss is {value}" if not math.isfinite(value) else "the update made non-finite weights"
            raise FloatingPointError(f"{what} at step {step}; lower the learning rate or set max_grad_norm")
        self.params = params
        self.adapter.update(self.params)
        return value

    def evaluate(self, examples: Sequence[Example], num_batches: int = -1) -> float:
        """Mean loss per trained token over `num_batches` batches (-1: all) of `examples`. Batches
        are grouped by length, so a limited number is a seeded sample of them: the same each
        evaluation (losses comparable across steps), not the shortest examples every time."""
        total, count = 0.0, 0
        for n, (_, batch) in enumerate(iterate_batches(examples, self.config.batch_size, self.config.max_seq_length,
                                                       seed=self.config.seed, loop=False, drop_last=False)):
            if 0 <= num_batches <= n:
                break
            loss, ntok = masked_cross_entropy(self.model.logits(batch.inputs), batch.targets, batch.mask)
            mx.eval(loss, ntok)
            total += float(loss.item()) * float(ntok.item())
            count += int(ntok.item())
        return total / count if count else float("nan")

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, path: Path, step: int, lora: LoRAConfig, history: dict[str, Any]) -> None:
        """Adapter (mlx-lm's format) + weights and optimizer state + step. The state file is replaced
        last; the arrays carry their step, so a crash between the two is refused at resume instead of
        resuming the new weights at the old step."""
        self.adapter.save(path)
        arrays = {f"params.{k}": v for k, v in self.params.items()}
        arrays.update({f"opt.{k}": v for k, v in self.optimizer.state_dict().items()})
        tmp_arrays = path / (STATE_ARRAYS + ".tmp.safetensors")
        # The step in the arrays' metadata pairs them with the state file: a run stopped between the
        # two replaces leaves new arrays beside the old step, which resuming must not take as one.
        mx.save_safetensors(tmp_arrays, arrays, {"step": str(step), "optimizer_step": str(self.optimizer.step)})
        tmp_arrays.replace(path / STATE_ARRAYS)
        state = {"step": step, "optimizer_step": self.optimizer.step, "lora": dataclasses.asdict(lora),
                 "train_config": dataclasses.asdict(self.config), "optimizer": self.optimizer.hyperparameters(),
                 **history}
        tmp = path / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(state, indent=2) + "\n", encoding="utf-8")
        tmp.replace(path / STATE_FILE)

    def load_checkpoint(self, path: Path, state: dict[str, Any]) -> None:
        """The adapter's and optimizer's arrays of the checkpoint at `path`, whose training state
        `state` is (`read_resume_state`, read once by the caller)."""
        file = path / STATE_ARRAYS
        # Header checked first; any failure is a ValueError naming the file, as for the rest of a damaged checkpoint.
        arrays, metadata = checked_load(file, ValueError, "training state file")
        for key in ("step", "optimizer_step"):  # absent from checkpoints written before they were recorded
            if key in metadata and metadata[key] != str(state[key]):
                raise ValueError(f"{file} holds the weights of {key} {metadata[key]}, and {path / STATE_FILE} says "
                                 f"{state[key]}: the checkpoint was not written to the end (a run stopped while "
                                 "saving?); resume from a complete checkpoint")
        params = {k[len("params."):]: v for k, v in arrays.items() if k.startswith("params.")}
        current = self.adapter.trainable_parameters()
        mismatch = sorted(set(current) ^ set(params))
        if mismatch:
            raise ValueError(f"{path}: the checkpoint's adapter does not match the model's: {', '.join(mismatch[:5])}")
        opt = {k[len("opt."):]: v for k, v in arrays.items() if k.startswith("opt.")}
        # Shapes are checked here: a wrong one would fail mid-step with MLX's text, or (a moment of
        # shape (1,)) broadcast silently into a wrong optimizer state.
        for name, value in params.items():
            _check_like(file, f"params.{name}", value, current[name])
        for name, value in opt.items():  # `<param>.m`, `.v`, `.master`; other names load_state_dict refuses
            if name.rpartition(".")[0] in current:
                _check_like(file, f"opt.{name}", value, current[name.rpartition(".")[0]])
        self.params = {k: params[k].astype(current[k].dtype) for k in current}
        try:
            self.optimizer.load_state_dict(opt, state["optimizer_step"])
        except ValueError as exc:
            raise ValueError(f"{file}: {exc}") from None
        unknown = sorted(set(self.optimizer.state) - set(current))
        if unknown:
            raise ValueError(f"{file}: optimizer state for {', '.join(unknown[:5])}, which the adapter does not have")
        self.adapter.update(self.params)
        mx.eval([*self.params.values(), *self.optimizer.state_arrays()])


def _check_like(file: Path, name: str, value: Array, like: Array) -> None:
    if tuple(value.shape) != tuple(like.shape) or not value.dtype.is_floating:
        raise ValueError(f"{file}: {name} is {value.dtype.name} {tuple(value.shape)}; the adapter's is "
                         f"a floating tensor of shape {tuple(like.shape)}")


def read_resume_state(file: Path) -> tuple[dict[str, Any], LoRAConfig]:
    """The training state of a checkpoint (`training_state.json`) and its LoRA config, checked: a
    damaged or hand-edited file is refused naming the file and field, instead of a KeyError or
    TypeError later, or a negative step or losses that are not pairs used as they are."""
    state = read_json(file, what="training state", error=ValueError)
    for key in ("step", "optimizer_step"):
        value = state.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{file}: {key!r} must be a step number >= 0, not {value!r}")
    for key in ("train_losses", "val_losses"):
        value = state.get(key, [])
        if not isinstance(value, list) or not all(
                isinstance(x, list) and len(x) == 2 and type(x[0]) is int
                and isinstance(x[1], (int, float)) and not isinstance(x[1], bool) for x in value):
            raise ValueError(f"{file}: {key!r} must be a list of [step, loss] pairs")
    lora = state.get("lora")
    keys = lora.get("target_keys") if isinstance(lora, dict) else None
    if not isinstance(lora, dict) or not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise ValueError(f"{file}: 'lora' must be a LoRA config with a list of target_keys")
    try:
        config = LoRAConfig(**{**lora, "target_keys": tuple(keys)})
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{file}: 'lora' is not a LoRA config: {exc}") from None
    return state, config


def _differences(asked: LoRAConfig, have: LoRAConfig, name: str) -> str:
    return ", ".join(f"{f.name} {getattr(asked, f.name)!r} ({name}: {getattr(have, f.name)!r})"
                     for f in dataclasses.fields(LoRAConfig) if getattr(asked, f.name) != getattr(have, f.name))


def _check_model(model: Any) -> None:
    missing = [name for name, proto in (("TrainableModel", TrainableModel), ("SupportsTraining", SupportsTraining))
               if not isinstance(model, proto)]
    if missing:
        raise TypeError(f"{type(model).__name__} cannot be trained here (it is not {' / '.join(missing)}); "
                        "load the model with the metal backend")


def train(model: Any, data: str | Path, adapter_path: str | Path = "adapters", *, lora: LoRAConfig | None = None,
          config: TrainConfig | None = None, callback: Callable[[TrainReport], None] | None = None,
          **options: Any) -> TrainResult:
    """Fine-tune a LoRA adapter of `model` (a loaded metal model, or a model path, then loaded and
    closed here) on `data` (a
    directory with train.jsonl [+ valid.jsonl], or one .jsonl file), writing checkpoints to
    `adapter_path`. `options` override fields of `config` (e.g. iters=100, batch_size=2).

    The model's current adapter is trained if it has one; otherwise `lora` (default LoRAConfig())
    is applied. With `resume`, training continues from the checkpoint in `adapter_path`.
    """
    config = dataclasses.replace(config or TrainConfig(), **options) if options else (config or TrainConfig())
    if isinstance(model, (str, Path)):
        from pymlxc.registry import load_model

        with load_model(str(model), backend="metal") as loaded:
            return train(loaded, data, adapter_path, lora=lora, config=config, callback=callback)
    _check_model(model)
    current = model.adapter
    if lora is not None and current is not None and lora != current.config:
        # The model's adapter is what trains; another config asked for would be ignored.
        raise ValueError(f"the model already has an adapter, and the LoRA config asked for differs from it: "
                         f"{_differences(lora, current.config, 'adapter')}; leave lora out to train that "
                         "adapter, or remove_adapter() first")
    with model.training_scope():
        return _train(model, data, adapter_path, lora, config, callback)


def _train(model: Any, data: str | Path, adapter_path: str | Path, lora: LoRAConfig | None, config: TrainConfig,
           callback: Callable[[TrainReport], None] | None) -> TrainResult:
    adapter_dir = Path(adapter_path)
    if adapter_dir.exists() and not adapter_dir.is_dir():  # else found at the first checkpoint, steps later
        raise NotADirectoryError(f"adapter path {adapter_dir} is not a directory: adapters are saved as a directory")
    resume_state, resume_lora = None, None
    if config.resume:
        if not (adapter_dir / STATE_FILE).is_file():
            raise FileNotFoundError(f"cannot resume: {adapter_dir / STATE_FILE} does not exist")
        resume_state, resume_lora = read_resume_state(adapter_dir / STATE_FILE)
        if lora is not None and lora != resume_lora and model.adapter is None:
            # The checkpoint's adapter is what resumes; another config asked for would be ignored.
            raise ValueError(f"cannot resume from {adapter_dir}: the LoRA config asked for differs from the "
                             f"checkpoint's: {_differences(lora, resume_lora, 'checkpoint')}")

    train_records, valid_records = load_records(data, config.valid_split, config.seed)
    encoder = model.training_encoder()
    train_set = tokenize_all(train_records, encoder, config.mask_prompt)
    valid_set = tokenize_all(valid_records, encoder, config.mask_prompt)
    check_trained_tokens(train_set, config.max_seq_length)
    check_trained_tokens(valid_set, config.max_seq_length)
    vocab_size = int(model.info().vocab_size)
    check_token_ids(train_set, vocab_size)
    check_token_ids(valid_set, vocab_size)
    what = train_records[0].source
    if valid_records and valid_records[0].source == what:  # held out by valid_split
        what += f" (after holding out {len(valid_records)} for validation, valid_split={config.valid_split})"
    check_batch_size(train_set, config.batch_size, what)

    adapter = model.adapter
    applied = adapter is None
    weights_before = {} if applied else dict(adapter.trainable_parameters())
    if applied:
        if resume_lora is not None:
            lora = resume_lora
        adapter = model.apply_lora(lora or LoRAConfig(), seed=config.seed)
    try:
        return _run(model, data, adapter, adapter_dir, resume_state, train_set, valid_set, config, callback)
    except BaseException:
        # A failed run leaves the model as it was before the call: the adapter made here is removed,
        # an adapter it already had gets its weights back (arrays are immutable: these are they).
        # A model closed under the run is going away: nothing to restore.
        if model.closed:
            raise
        if applied:
            model.remove_adapter()
        else:
            adapter.update(weights_before)
            mx.eval(list(weights_before.values()))
        raise


def _run(model: Any, data: str | Path, adapter: Any, adapter_dir: Path, resume_state: dict[str, Any] | None,
         train_set: list[Example], valid_set: list[Example], config: TrainConfig,
         callback: Callable[[TrainReport], None] | None) -> TrainResult:
    lora_config: LoRAConfig = adapter.config
    trainer = Trainer(model, config, adapter)
    start = 0
    history: dict[str, Any] = {"train_losses": [], "val_losses": []}
    if resume_state is not None:
        trainer.load_checkpoint(adapter_dir, resume_state)
        start = int(resume_state["step"])
        history = {"train_losses": resume_state.get("train_losses", []),
                   "val_losses": resume_state.get("val_losses", [])}
        if start >= config.iters:
            raise ValueError(f"cannot resume: the checkpoint is at step {start} and iters={config.iters}")

    progress = Progress(config.iters, enabled=config.progress)
    truncated = count_truncated(train_set, config.max_seq_length)
    if truncated and config.progress:
        sys.stderr.write(f"{truncated} training example(s) are longer than max_seq_length={config.max_seq_length} "
                         "and will be cut\n")
    result = TrainResult(adapter_dir, start, [tuple(x) for x in history["train_losses"]],
                         [tuple(x) for x in history["val_losses"]])

    def report(r: TrainReport) -> None:
        progress.show(r)
        if callback is not None:
            callback(r)

    mx.reset_peak_memory()
    model.set_grad_checkpoint(config.grad_checkpoint)
    batches = iterate_batches(train_set, config.batch_size, config.max_seq_length, seed=config.seed, skip=start)
    window_loss, window_tokens, window_steps, window_seconds = 0.0, 0, 0, 0.0
    run_start, train_seconds = time.perf_counter(), 0.0
    adapter.set_training(True)
    try:
        for step in range(start + 1, config.iters + 1):
            _, batch = next(batches)
            t0 = time.perf_counter()
            loss = trainer.step(batch)  # raises at the first non-finite loss
            step_seconds = time.perf_counter() - t0  # tokens/s counts training steps only
            window_seconds += step_seconds
            train_seconds += step_seconds
            result.step_losses.append(loss)
            window_loss += loss
            window_tokens += batch.ntokens
            window_steps += 1
            result.trained_tokens += batch.ntokens
            result.steps = step
            r: TrainReport | None = None
            if step % config.steps_per_report == 0 or step == config.iters:
                train_loss = window_loss / window_steps
                r = TrainReport(step, train_loss=train_loss,
                                learning_rate=trainer.optimizer.lr_at(step),
                                tokens_per_sec=window_tokens / max(window_seconds, 1e-9),
                                trained_tokens=result.trained_tokens, peak_memory=mx.get_peak_memory())
                result.train_losses.append((step, train_loss))
                window_loss, window_tokens, window_steps, window_seconds = 0.0, 0, 0, 0.0
            if valid_set and (step % config.steps_per_eval == 0 or step == config.iters):
                adapter.set_training(False)
                val = trainer.evaluate(valid_set, config.val_batches)
                adapter.set_training(True)
                result.val_losses.append((step, val))
                r = r or TrainReport(
                    step, learning_rate=trainer.optimizer.lr_at(step), peak_memory=mx.get_peak_memory()
                )
                r.val_loss = val
            if r is not None:
                report(r)
            if step % config.save_every == 0 or step == config.iters:
                history = {"train_losses": result.train_losses, "val_losses": result.val_losses}
                trainer.save_checkpoint(adapter_dir, step, lora_config, history)
                if step % config.save_every == 0:  # a snapshot, as mlx-lm keeps them
                    shutil.copyfile(adapter_dir / MLX_WEIGHTS, adapter_dir / f"{step:07d}_adapters.safetensors")
    finally:
        progress.close()
        adapter.set_training(False)
        model.set_grad_checkpoint(False)
    result.seconds = time.perf_counter() - run_start
    result.tokens_per_sec = result.trained_tokens / max(train_seconds, 1e-9)
    result.peak_memory = mx.get_peak_memory()
    return result

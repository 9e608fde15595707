"""Training configuration (frozen dataclasses) and the protocols a backend implements to be trainable.

`TrainableModel` mirrors go-inference: a `TextModel` that can `apply_lora`, `encode`, `decode` and
says its `num_layers`. `pymlxc.train` also needs a way to run the model on token arrays and to
render chat records: `SupportsTraining` (the metal backend's models have both).
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from pymlxc.core import Array
from pymlxc.model import TextModel

from .trees import Tree

LORA_DTYPES = ("float32", "bfloat16")


def _as_int(config: object, name: str) -> None:
    """Field `name` of a frozen config as a plain int. A bool or a float would be taken for a number
    here and fail deep in the run (range(2.5)); a numpy integer would pass every step and then fail
    the checkpoint's json.dumps."""
    value = getattr(config, name)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, not {value!r}")
    object.__setattr__(config, name, int(value))


def _as_float(config: object, name: str) -> None:
    """Field `name` of a frozen config as a plain float (a string or bool is refused by name)."""
    value = getattr(config, name)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, not {value!r}")
    object.__setattr__(config, name, float(value))


@dataclass(frozen=True)
class LoRAConfig:
    """Which linears get a low-rank update W x + (alpha / rank) * B A x, and how.

    `target_keys` name linear layers inside each transformer block, by their last name (`q_proj`)
    or by their path in the block (`self_attn.q_proj`). `num_layers` adapts the last N blocks; None
    adapts all. `dtype` is the adapter weights' dtype ("float32" or "bfloat16").
    """

    rank: int = 8
    alpha: float = 16.0
    target_keys: tuple[str, ...] = ("q_proj", "v_proj")
    num_layers: int | None = None
    dropout: float = 0.0
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if isinstance(self.target_keys, str):
            object.__setattr__(self, "target_keys", (self.target_keys,))
        object.__setattr__(self, "target_keys", tuple(self.target_keys))
        _as_int(self, "rank")
        _as_float(self, "alpha")
        _as_float(self, "dropout")
        if self.num_layers is not None:
            _as_int(self, "num_layers")
        if self.rank < 1:
            raise ValueError(f"rank must be a positive integer, not {self.rank}")
        if not math.isfinite(self.alpha) or self.alpha <= 0:
            raise ValueError(f"alpha must be a finite number > 0, not {self.alpha}")
        if not self.target_keys or not all(isinstance(k, str) and k for k in self.target_keys):
            raise ValueError(f"target_keys must be non-empty layer names, not {self.target_keys!r}")
        if self.num_layers is not None and self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1 or None (all blocks), not {self.num_layers}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), not {self.dropout}")
        if self.dtype not in LORA_DTYPES:
            raise ValueError(f"dtype must be one of {LORA_DTYPES}, not {self.dtype!r}")

    @property
    def scale(self) -> float:
        """The factor on B A x: alpha / rank (mlx-lm's `scale`)."""
        return float(self.alpha) / float(self.rank)


@dataclass(frozen=True)
class TrainConfig:
    """How `pymlxc.train` runs. Defaults follow mlx-lm's `lora` command where it has one, except
    `mask_prompt` (on: prompt tokens of completion and chat records do not count in the loss) and the
    optimizer (AdamW, lr 1e-5 with weight decay 0.01)."""

    iters: int = 1000
    batch_size: int = 4
    learning_rate: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    max_grad_norm: float | None = None
    lr_schedule: str = "constant"  # or "cosine" (with warmup_steps)
    warmup_steps: int = 0
    max_seq_length: int = 2048
    mask_prompt: bool = True
    grad_checkpoint: bool = False
    valid_split: float | None = None  # fraction of train.jsonl held out when valid.jsonl is absent
    steps_per_report: int = 10
    steps_per_eval: int = 200
    val_batches: int = 25  # batches per validation (-1: the whole set)
    save_every: int = 100
    seed: int = 0
    resume: bool = False
    progress: bool = True

    def __post_init__(self) -> None:
        for name in ("iters", "batch_size", "max_seq_length", "steps_per_report", "steps_per_eval", "save_every",
                     "warmup_steps", "val_batches", "seed"):
            _as_int(self, name)
        optional = tuple(name for name in ("max_grad_norm", "valid_split") if getattr(self, name) is not None)
        for name in ("learning_rate", "eps", "weight_decay", *optional):
            _as_float(self, name)
        positive = ("iters", "batch_size", "max_seq_length", "steps_per_report", "steps_per_eval", "save_every")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, not {getattr(self, name)}")
        if self.seed < 0:  # numpy's and MLX's generators take seeds >= 0 only
            raise ValueError(f"seed must be >= 0, not {self.seed}")
        # A NaN or infinite number here fails no comparison below and would turn the first step's
        # weights into NaN; a negative warmup would make the learning rate negative (the loss climbs).
        clip = ("max_grad_norm",) if self.max_grad_norm is not None else ()
        for name in ("learning_rate", "eps", "weight_decay", *clip):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, not {getattr(self, name)}")
        if self.learning_rate < 0:
            raise ValueError(f"learning_rate must be >= 0, not {self.learning_rate}")
        if self.eps <= 0 or self.weight_decay < 0:
            raise ValueError(f"eps must be > 0 and weight_decay >= 0, not {self.eps} and {self.weight_decay}")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise ValueError(f"max_grad_norm must be > 0 or None, not {self.max_grad_norm}")
        betas = tuple(self.betas)
        if len(betas) != 2 or not all(isinstance(b, numbers.Real) and not isinstance(b, bool) and math.isfinite(b)
                                      and 0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must be two numbers in [0, 1), not {self.betas}")
        object.__setattr__(self, "betas", tuple(float(b) for b in betas))
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, not {self.warmup_steps}")
        if self.lr_schedule not in ("constant", "cosine"):
            raise ValueError(f"lr_schedule must be 'constant' or 'cosine', not {self.lr_schedule!r}")
        if self.valid_split is not None and not 0.0 < self.valid_split < 1.0:
            raise ValueError(f"valid_split must be in (0, 1), not {self.valid_split}")
        if self.val_batches == 0 or self.val_batches < -1:
            raise ValueError(f"val_batches must be >= 1 or -1 (all), not {self.val_batches}")


@runtime_checkable
class LoRAAdapter(Protocol):
    """LoRA layers in a model (go-inference's Adapter, with what training needs)."""

    config: LoRAConfig

    def total_params(self) -> int: ...

    def save(self, path: str | Path) -> None: ...

    def trainable_parameters(self) -> Tree: ...

    def update(self, params: Tree) -> None: ...

    def set_training(self, training: bool) -> None: ...

    def reseed_dropout(self, seed: int) -> None: ...

    def tensors(self) -> dict[str, Array]: ...


@runtime_checkable
class TrainableModel(TextModel, Protocol):
    """A `TextModel` that LoRA can be applied to (go-inference's TrainableModel)."""

    def apply_lora(self, config: LoRAConfig | None = None) -> LoRAAdapter: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    @property
    def num_layers(self) -> int: ...


@dataclass(frozen=True)
class Encoder:
    """Turns dataset records into tokens: `encode` adds the tokenizer's own specials (BOS),
    `encode_plain` adds none (for rendered chat text, whose template writes them), `render_chat`
    is None when the model has no chat template; `render_chat_tools` renders with a chat record's
    tool definitions (the template's `tools`), None where the encoder cannot."""

    encode: Callable[[str], list[int]]
    encode_plain: Callable[[str], list[int]]
    eos_token_id: int | None
    render_chat: Callable[[Sequence[Any], bool], str] | None = None
    render_chat_tools: Callable[[Sequence[Any], bool, Sequence[Any]], str] | None = None
    model_type: str = field(default="")


@runtime_checkable
class SupportsTraining(Protocol):
    """What `pymlxc.train` needs beyond `TrainableModel`: logits for a [B, L] token array (through
    the current adapter weights), the encoder for records, gradient checkpointing of the blocks, the
    device scope to train in, the adapter currently applied, and its removal (a failed run takes
    off the adapter it applied)."""

    @property
    def closed(self) -> bool: ...

    def logits(self, inputs: Array) -> Array: ...

    def training_encoder(self) -> Encoder: ...

    def set_grad_checkpoint(self, enabled: bool) -> None: ...

    def training_scope(self) -> AbstractContextManager[None]: ...

    @property
    def adapter(self) -> LoRAAdapter | None: ...

    def remove_adapter(self) -> None: ...

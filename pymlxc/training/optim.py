"""AdamW with decoupled weight decay, and gradient clipping by global norm.

The optimizer works on trees of arrays (what `value_and_grad` returns) and is functional at its
core: `update(params, grads) -> new params`, with its state (step, moments) held in the object and
exportable as a flat dict for checkpoints. Moments are kept in float32, and parameters narrower than
float32 (bfloat16 adapters) get a float32 master copy: a bfloat16 weight cannot move by lr=1e-5.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pymlxc.core as mx
from pymlxc.core import Array

from .trees import Tree, tree_flatten, tree_leaves, tree_map


def global_norm(grads: Tree) -> Array:
    """sqrt of the sum of squares of every leaf (in float32)."""
    leaves = tree_leaves(grads)
    if not leaves:
        return mx.array(0.0)
    total = mx.sum(mx.stack([mx.sum(mx.square(g.astype(mx.float32))) for g in leaves]))
    return mx.sqrt(total)


def clip_grad_norm(grads: Tree, max_norm: float) -> tuple[Tree, Array]:
    """(grads scaled so that their global norm is at most `max_norm`, the norm before clipping)."""
    if max_norm <= 0:
        raise ValueError(f"max_norm must be > 0, not {max_norm}")
    norm = global_norm(grads)
    factor = mx.minimum(max_norm / (norm + 1e-6), 1.0)
    return tree_map(lambda g: (g * factor).astype(g.dtype), grads), norm


@dataclass
class AdamW:
    """AdamW (Loshchilov & Hutter): Adam moments with bias correction, and weight decay applied to the
    weights directly (p -= lr * weight_decay * p), not through the gradient.

    `learning_rate` may be a float or a callable step -> float (a schedule). `max_grad_norm` clips
    gradients by global norm before the update (None: no clipping).
    """

    learning_rate: Any = 1e-5
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    max_grad_norm: float | None = None
    bias_correction: bool = True

    def __post_init__(self) -> None:
        if not callable(self.learning_rate) and self.learning_rate < 0:
            raise ValueError(f"learning_rate must be >= 0, not {self.learning_rate}")
        b1, b2 = self.betas
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise ValueError(f"betas must be in [0, 1), not {self.betas}")
        if self.eps <= 0:
            raise ValueError(f"eps must be > 0, not {self.eps}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, not {self.weight_decay}")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise ValueError(f"max_grad_norm must be > 0 or None, not {self.max_grad_norm}")
        self.step = 0
        self.state: dict[str, dict[str, Array]] = {}  # path -> {"m", "v"[, "master"]}
        self.last_grad_norm: Array | None = None

    def lr_at(self, step: int) -> float:
        return float(self.learning_rate(step)) if callable(self.learning_rate) else float(self.learning_rate)

    def init(self, params: Tree) -> None:
        """Create zero moments (and master copies) for every leaf of `params` that has no state yet."""
        for path, p in tree_flatten(params):
            if path not in self.state:
                entry = {"m": mx.zeros(p.shape, mx.float32), "v": mx.zeros(p.shape, mx.float32)}
                if p.dtype not in (mx.float32, mx.float64):
                    entry["master"] = p.astype(mx.float32)
                self.state[path] = entry

    def update(self, params: Tree, grads: Tree) -> Tree:
        """One AdamW step: the new parameters (same tree and dtypes as `params`)."""
        if self.max_grad_norm is not None:
            grads, self.last_grad_norm = clip_grad_norm(grads, self.max_grad_norm)
        self.init(params)
        self.step += 1
        lr = self.lr_at(self.step)
        b1, b2 = self.betas
        c1 = 1.0 - b1 ** self.step if self.bias_correction else 1.0
        c2 = 1.0 - b2 ** self.step if self.bias_correction else 1.0
        paths = iter([path for path, _ in tree_flatten(params)])

        def one(p: Array, g: Array) -> Array:
            path = next(paths)
            st = self.state[path]
            wide = st.get("master", p)
            g = g.astype(wide.dtype)
            m = b1 * st["m"] + (1.0 - b1) * g
            v = b2 * st["v"] + (1.0 - b2) * mx.square(g)
            new = wide * (1.0 - lr * self.weight_decay) - lr * ((m / c1) / (mx.sqrt(v / c2) + self.eps))
            st["m"], st["v"] = m, v
            if "master" in st:
                st["master"] = new
            return new.astype(p.dtype)

        # tree_map keeps the structure (flat dicts with dotted names stay flat); it visits leaves
        # in tree_flatten's order, which pairs each leaf with its path.
        return tree_map(one, params, grads)

    def snapshot(self) -> tuple[int, dict[str, dict[str, Array]], Array | None]:
        """The step count, moments and last gradient norm, for `restore` (arrays are immutable:
        copying the dicts keeps them)."""
        return self.step, {path: dict(st) for path, st in self.state.items()}, self.last_grad_norm

    def restore(self, snapshot: tuple[int, dict[str, dict[str, Array]], Array | None]) -> None:
        """Put back what `snapshot` took: an update that was refused leaves no trace in the moments."""
        step, state, norm = snapshot
        self.step, self.state, self.last_grad_norm = step, {path: dict(st) for path, st in state.items()}, norm

    def state_arrays(self) -> list[Array]:
        """Every array the optimizer holds (to `mx.eval` them with the parameters each step)."""
        return [a for st in self.state.values() for a in st.values()]

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Array]:
        """Flat `name -> array` for safetensors: `<path>.m`, `<path>.v`, `<path>.master`."""
        return {f"{path}.{k}": a for path, st in self.state.items() for k, a in st.items()}

    def load_state_dict(self, arrays: dict[str, Array], step: int) -> None:
        state: dict[str, dict[str, Array]] = {}
        for name, a in arrays.items():
            path, _, kind = name.rpartition(".")
            if kind not in ("m", "v", "master") or not path:
                raise ValueError(f"unexpected optimizer state entry {name!r}")
            state.setdefault(path, {})[kind] = a
        for path, st in state.items():
            if "m" not in st or "v" not in st:
                raise ValueError(f"optimizer state for {path!r} lacks its moments")
        self.state = state
        self.step = int(step)

    def hyperparameters(self) -> dict[str, Any]:
        lr = self.learning_rate if not callable(self.learning_rate) else "schedule"
        return {"learning_rate": lr, "betas": list(self.betas), "eps": self.eps,
                "weight_decay": self.weight_decay, "max_grad_norm": self.max_grad_norm,
                "bias_correction": self.bias_correction}


def cosine_schedule(peak: float, total_steps: int, warmup: int = 0, end: float = 0.0) -> Callable[[int], float]:
    """A learning rate schedule of steps 1..`total_steps`: linear warmup to `peak`, then cosine decay
    from `peak` towards `end`. The first step after warmup takes `peak` and the last one still a rate
    above `end` (as mlx-lm's cosine_decay from its step 0): decaying to `end` at the last step left it
    nothing to learn with, and a one-step run trained nothing at all."""
    def lr(step: int) -> float:
        if warmup and step <= warmup:
            return peak * step / warmup
        t = min(1.0, (step - warmup - 1) / max(1, total_steps - warmup))
        return end + 0.5 * (peak - end) * (1.0 + math.cos(math.pi * t))

    return lr

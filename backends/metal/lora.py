"""LoRA on the metal backend's modules: low-rank layers around frozen dense or quantized linears
(QLoRA), attaching them to a model, gradient checkpointing of its blocks, and fusing.

A `LoRALinear` replaces a `Linear`/`QuantizedLinear` in place and keeps it as its child `linear`,
so parameter names are those mlx-lm writes: `model.layers.3.self_attn.q_proj.lora_a` (in, r) and
`...lora_b` (r, out); the base weights move to `...q_proj.linear.weight`. The output is
`linear(x) + scale * (x A) B`; B starts at zero, so a fresh adapter leaves the model unchanged.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pymlxc.core as mx
from pymlxc.core import Array

from . import nn as _nn
from .kernel_choice import mlx_kernels_only
from .nn import Embedding, Linear, Module, QuantizedEmbedding, QuantizedLinear

_DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16}


class DropoutKeys:
    """Explicit random keys for LoRA dropout, shared by the layers of one adapter: each draw splits
    the current key, so a run with the same seed draws the same masks in the same order."""

    def __init__(self, seed: int = 0) -> None:
        self.reseed(seed)

    def reseed(self, seed: int) -> None:
        self._key = mx.random.key(seed)

    def next(self) -> Array:
        self._key, sub = mx.random.split(self._key)
        return sub

    @property
    def state(self) -> Array:
        """The current key: with `state`'s setter, a draw can be replayed (gradient checkpointing)."""
        return self._key

    @state.setter
    def state(self, key: Array) -> None:
        self._key = key


class LoRALinear(Module):
    """y = linear(x) + scale * (dropout(x) @ lora_a) @ lora_b, the base `linear` frozen.

    The low-rank path runs in the adapter's dtype (bfloat16 adapters keep their activations in
    bfloat16); its result is cast back to the base output's dtype.
    """

    def __init__(self, linear: Linear | QuantizedLinear, rank: int, scale: float, *, dropout: float = 0.0,
                 dtype: mx.Dtype = mx.float32, key: Array | None = None,
                 dropout_keys: DropoutKeys | None = None) -> None:
        super().__init__()
        in_dims, out_dims = linear_dims(linear)
        self.linear = linear
        self.scale = float(scale)
        self.dropout = float(dropout)
        # Kaiming-uniform-like init of A as in the LoRA paper's reference code; B = 0.
        bound = 1.0 / math.sqrt(in_dims)
        self.lora_a = mx.random.uniform(-bound, bound, (in_dims, rank), mx.float32, key=key).astype(dtype)
        self.lora_b = mx.zeros((rank, out_dims), dtype)
        self._training = False
        self._dropout_keys = dropout_keys

    @property
    def rank(self) -> int:
        return self.lora_a.shape[1]

    def __call__(self, x: Array) -> Array:
        y = self.linear(x)
        h = x.astype(self.lora_a.dtype)
        if self._training and self.dropout > 0.0 and self._dropout_keys is not None:
            keep = mx.random.bernoulli(1.0 - self.dropout, list(h.shape), key=self._dropout_keys.next())
            h = mx.where(keep, h / (1.0 - self.dropout), mx.zeros_like(h))
        z = mx.matmul(mx.matmul(h, self.lora_a), self.lora_b)
        return y + (z * self.scale).astype(y.dtype)

    def delta(self) -> Array:
        """scale * (A B)^T in float32: the (out, in) change that fusing adds to the base weight."""
        a = self.lora_a.astype(mx.float32)
        b = self.lora_b.astype(mx.float32)
        return mx.transpose(mx.matmul(a, b)) * self.scale

    def fused(self, dequantize: bool = False) -> Linear | QuantizedLinear:
        """The base layer with the update folded into its weight. A quantized base is dequantized,
        updated and requantized with its group size and bits (or left dense with `dequantize`)."""
        base = self.linear
        bias = base.__dict__.get("bias")
        if isinstance(base, QuantizedLinear):
            dense = mx.dequantize(base.weight, base.scales, base.biases, base.group_size, base.bits)
            dtype = base.scales.dtype
        else:
            dense, dtype = base.weight, base.weight.dtype
        weight = (dense.astype(mx.float32) + self.delta()).astype(dtype)
        out_dims, in_dims = weight.shape
        linear = Linear(in_dims, out_dims, bias=bias is not None)
        linear.weight = weight
        if bias is not None:
            linear.bias = bias
        if isinstance(base, QuantizedLinear) and not dequantize:
            return QuantizedLinear.from_linear(linear, base.group_size, base.bits)
        return linear


def linear_dims(linear: Module) -> tuple[int, int]:
    """(input dims, output dims) of a Linear or QuantizedLinear."""
    if isinstance(linear, QuantizedLinear):
        return linear.input_dims, linear.output_dims
    if isinstance(linear, Linear):
        out_dims, in_dims = linear.weight.shape
        return in_dims, out_dims
    raise TypeError(f"LoRA wraps Linear and QuantizedLinear layers, not {type(linear).__name__}")


# ---------------------------------------------------------------------- finding blocks and linears

def blocks_of(model: Module) -> tuple[str, list[Module]]:
    """(flat name of the block list, the blocks) of a transformer: the list behind `model.layers`."""
    layers = getattr(model, "layers", None)
    if not isinstance(layers, (list, tuple)) or not layers:
        raise TypeError(f"{type(model).__name__} has no `layers` list of transformer blocks")
    first = layers[0]
    for name, module in model.named_modules():
        if module is first and name.endswith(".0"):
            return name[:-2], list(layers)
    raise TypeError(f"cannot find the blocks of {type(model).__name__} among its modules")


def block_linears(block: Module) -> list[str]:
    """Paths (relative to the block) of its dense and quantized linears; a LoRA-wrapped linear is
    listed under its own path (not as `.linear` inside the wrapper)."""
    out: list[str] = []

    def walk(module: Module, prefix: str) -> None:
        for name, child in module.children():
            path = f"{prefix}.{name}" if prefix else name
            if isinstance(child, (LoRALinear, Linear, QuantizedLinear)):
                out.append(path)
            else:
                walk(child, path)

    walk(block, "")
    return out


def _gguf_block_linears(block: Module) -> list[tuple[str, str]]:
    """(path in the block, GGUF type name) of its GGUF block-quantized linears (`gguf_layers.BlockLinear`)."""
    try:
        from .gguf_layers import BlockLinear  # noqa: PLC0415 - imports gguf, which only GGUF models need
    except ImportError:  # without the optional gguf package no model holds such layers
        return []
    return [(path, module.qtype.name) for path, module in block.named_modules() if isinstance(module, BlockLinear)]


def matches(path: str, keys: Iterable[str]) -> bool:
    """A target key names a linear by its path in the block or by its last part(s)."""
    return any(path == k or path.endswith("." + k) for k in keys)


def _node(root: Module, path: str) -> Any:
    node: Any = root
    for part in path.split(".") if path else []:
        node = _nn.child(node, part)
        if node is None:
            raise KeyError(path)
    return node


def get_module(root: Module, path: str) -> Module:
    node = _node(root, path)
    if not isinstance(node, Module):
        raise KeyError(path)
    return node


def set_module(root: Module, path: str, new: Module) -> None:
    """Replace the module at flat `path` (an attribute or a list item) by `new`."""
    parent_path, _, name = path.rpartition(".")
    parent = _node(root, parent_path)
    if isinstance(parent, list) and name.isdigit():
        parent[int(name)] = new
    elif isinstance(parent, Module) and isinstance(getattr(parent, name, None), Module):
        setattr(parent, name, new)
    else:
        raise KeyError(path)


# ---------------------------------------------------------------------- attaching

@dataclass(frozen=True)
class LoRASpec:
    """One LoRA layer to attach: the flat module path in the model, its rank and scale."""

    path: str
    rank: int
    scale: float


def select_modules(model: Module, target_keys: Sequence[str], num_layers: int | None) -> list[str]:
    """Flat paths of the linears that `target_keys` name in the last `num_layers` blocks (all if None)."""
    prefix, blocks = blocks_of(model)
    if num_layers is not None and num_layers > len(blocks):
        raise ValueError(f"num_layers={num_layers} but the model has {len(blocks)} blocks")
    first = 0 if num_layers is None else len(blocks) - num_layers
    chosen: list[str] = []
    for i in range(first, len(blocks)):
        chosen += [f"{prefix}.{i}.{p}" for p in block_linears(blocks[i]) if matches(p, target_keys)]
        # A GGUF file mixes types (Q8_0 loads as a QuantizedLinear, a K-quant as a BlockLinear):
        # skipping the layers LoRA cannot wrap would train an adapter on part of what was asked for.
        blocked = [(p, qtype) for p, qtype in _gguf_block_linears(blocks[i]) if matches(p, target_keys)]
        if blocked:
            path, qtype = blocked[0]
            more = f" (and {len(blocked) - 1} more in this block)" if len(blocked) > 1 else ""
            raise ValueError(f"{prefix}.{i}.{path}{more} holds GGUF {qtype} blocks, which LoRA cannot "
                             "wrap (it wraps dense and MLX-quantized linears): load the model from safetensors, "
                             "or leave that layer out of the target keys")
    if not chosen:
        available = block_linears(blocks[-1])
        raise ValueError(f"target keys {list(target_keys)} name no linear layer of the blocks; "
                         f"linears in a block: {', '.join(available)}")
    return chosen


def attach(model: Module, specs: Sequence[LoRASpec], *, dropout: float = 0.0, dtype: str = "float32",
           seed: int = 0, dropout_keys: DropoutKeys | None = None) -> list[str]:
    """Wrap each named linear in a LoRALinear (A from a key derived from `seed` and the layer's
    position, B zero), freeze everything else, and return the wrapped paths."""
    if dtype not in _DTYPES:
        raise ValueError(f"LoRA dtype must be one of {tuple(_DTYPES)}, not {dtype!r}")
    keys = mx.random.split(mx.random.key(seed), max(2, len(specs)))
    wrapped = []
    for i, spec in enumerate(specs):
        try:
            base = get_module(model, spec.path)
        except KeyError:
            raise ValueError(f"the model has no layer {spec.path!r}") from None
        if isinstance(base, LoRALinear):
            raise ValueError(f"{spec.path!r} already has a LoRA adapter; remove it first")
        if not isinstance(base, Linear | QuantizedLinear):
            raise TypeError(f"LoRA wraps Linear and QuantizedLinear layers, not {type(base).__name__} ({spec.path!r})")
        layer = LoRALinear(base, spec.rank, spec.scale, dropout=dropout, dtype=_DTYPES[dtype], key=keys[i],
                           dropout_keys=dropout_keys)
        set_module(model, spec.path, layer)
        wrapped.append(spec.path)
    model.freeze()
    for path in wrapped:
        get_module(model, path).unfreeze(["lora_a", "lora_b"], recurse=False)
    return wrapped


def lora_layers(model: Module) -> dict[str, LoRALinear]:
    return {path: m for path, m in model.named_modules() if isinstance(m, LoRALinear)}


def detach(model: Module) -> int:
    """Put the base linears back (the adapter is dropped); returns how many layers changed."""
    layers = lora_layers(model)
    for path, layer in layers.items():
        set_module(model, path, layer.linear)
    return len(layers)


def fuse(model: Module, dequantize: bool = False) -> int:
    """Fold every LoRA layer into its base weight (see `LoRALinear.fused`); returns the count."""
    layers = lora_layers(model)
    for path, layer in layers.items():
        set_module(model, path, layer.fused(dequantize=dequantize))
    return len(layers)


def dequantize_model(model: Module) -> int:
    """Replace every quantized linear and embedding by its dense equivalent (in the scales' dtype);
    returns how many changed."""
    changed = 0
    for path, module in list(model.named_modules()):
        if isinstance(module, QuantizedLinear):
            out_dims, in_dims = module.output_dims, module.input_dims
            linear = Linear(in_dims, out_dims, bias="bias" in vars(module))
            linear.weight = mx.dequantize(module.weight, module.scales, module.biases, module.group_size, module.bits)
            if "bias" in vars(module):
                linear.bias = vars(module)["bias"]
            dense: Module = linear
        elif isinstance(module, QuantizedEmbedding):
            n = module.weight.shape[0]
            dense = Embedding(n, module.scales.shape[1] * module.group_size)
            dense.weight = mx.dequantize(module.weight, module.scales, module.biases, module.group_size, module.bits)
        else:
            continue
        set_module(model, path, dense)
        changed += 1
    return changed


# ---------------------------------------------------------------------- gradient checkpointing

_checkpointed_classes: dict[type, type] = {}


def _checkpointed(cls: type) -> type:
    sub = _checkpointed_classes.get(cls)
    if sub is not None:
        return sub

    def __call__(self: Module, *args: Any, **kwargs: Any) -> Any:
        # Arrays among the arguments become inputs of the checkpointed function, everything else
        # (masks given as strings, caches, None) is closed over.
        array_pos = [i for i, a in enumerate(args) if isinstance(a, Array)]
        array_kw = [k for k, v in kwargs.items() if isinstance(v, Array)]
        params = self.trainable_parameters()
        # MLX runs `inner` again in the backward pass. LoRA dropout draws its masks from shared keys:
        # each run starts from the keys the forward pass had, so the gradients are taken through the
        # masks the loss was computed with; the keys then move on as after one forward pass.
        keys = _dropout_keys_in(self)
        start = [k.state for k in keys]
        after_forward: list[list[Array]] = []

        def inner(p: dict[str, Array], pos: list[Array], kw: dict[str, Array]) -> Any:
            outside = [k.state for k in keys]
            for k, s in zip(keys, start, strict=True):
                k.state = s
            try:
                self.update(p)
                full = list(args)
                for i, a in zip(array_pos, pos, strict=True):
                    full[i] = a
                with mlx_kernels_only():  # traced again in the backward pass, where gradients are taken
                    return cls.__call__(self, *full, **{**kwargs, **kw})
            finally:
                after_forward.append([k.state for k in keys])
                for k, s in zip(keys, outside, strict=True):
                    k.state = s

        try:
            out = mx.checkpoint(inner)(params, [args[i] for i in array_pos], {k: kwargs[k] for k in array_kw})
            for k, s in zip(keys, after_forward[0] if after_forward else start, strict=True):
                k.state = s
            return out
        finally:
            self.update(params)  # the block keeps the outer arrays, not the checkpoint's inner ones

    sub = type(cls.__name__, (cls,), {"__call__": __call__, "_checkpoint_base": cls, "__module__": cls.__module__,
                                      "__qualname__": cls.__qualname__})
    _checkpointed_classes[cls] = sub
    return sub


def _dropout_keys_in(block: Module) -> list[DropoutKeys]:
    """The dropout keys that the LoRA layers of `block` draw from (one object per adapter)."""
    found: dict[int, DropoutKeys] = {}
    for _, module in block.named_modules():
        keys = module._dropout_keys if isinstance(module, LoRALinear) else None
        if keys is not None:
            found[id(keys)] = keys
    return list(found.values())


def set_grad_checkpoint(model: Module, enabled: bool) -> None:
    """Recompute each block's activations in the backward pass (mx.checkpoint) instead of keeping
    them: less memory for about one more forward pass of compute."""
    _, blocks = blocks_of(model)
    for block in blocks:
        base = getattr(type(block), "_checkpoint_base", None)
        if enabled and base is None:
            block.__class__ = _checkpointed(type(block))
        elif not enabled and base is not None:
            block.__class__ = base


def adapter_tensors(model: Module) -> dict[str, Array]:
    """`name.lora_a` / `name.lora_b` of every LoRA layer, as mlx-lm saves them."""
    out: dict[str, Array] = {}
    for path, layer in lora_layers(model).items():
        out[f"{path}.lora_a"] = layer.lora_a
        out[f"{path}.lora_b"] = layer.lora_b
    return out


def load_tensors(model: Module, tensors: Mapping[str, Array]) -> None:
    """Set LoRA weights by name; names and shapes must match the attached layers exactly."""
    current = adapter_tensors(model)
    errors = []
    for name, value in tensors.items():
        if name not in current:
            errors.append(f"  {name}: not a LoRA parameter of the model")
        elif tuple(value.shape) != tuple(current[name].shape):
            errors.append(f"  {name}: shape {tuple(value.shape)} in the adapter, "
                          f"{tuple(current[name].shape)} in the model")
    missing = sorted(set(current) - set(tensors))
    errors += [f"  {name}: missing from the adapter" for name in missing[:10]]
    if errors:
        raise ValueError("the adapter does not fit the model:\n" + "\n".join(errors))
    model.update({k: v.astype(current[k].dtype) for k, v in tensors.items()})

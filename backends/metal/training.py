"""The metal backend's side of training: `MetalLoRAAdapter` and `TrainableMixin`, which makes
`MetalTextModel` a `pymlxc.training.TrainableModel` (apply_lora, load/save/fuse adapters) and gives
`pymlxc.train` what it needs (logits, the record encoder, gradient checkpointing).

The mixin uses the model's `_model` (the architecture, an `nn.Module` with `layers`), `_tokenizer`
and `_model_type`.
"""
from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pymlxc.core as mx
from pymlxc.core import Array
from pymlxc.files import read_json, write_replacing
from pymlxc.settings import Settings
from pymlxc.training.adapters import (
    AdapterError,
    AdapterWeights,
    check_shapes,
    read_adapter,
    write_mlx_adapter,
    write_peft_adapter,
)
from pymlxc.training.config import Encoder, LoRAConfig

from . import lora
from .kernel_choice import mlx_kernels_only
from .nn import Module, choose_kernels

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                    "tokenizer.model", "chat_template.jinja", "chat_template.json", "added_tokens.json")


# Multimodal configs whose checkpoints wrap the text model: there mlx-lm names parameters
# `language_model.<our name>` and transformers (so PEFT) `model.language_model.<our name minus model.>`.
# We load only the text model, under the plain names; files for other tools get their names.
_WRAPPED_TYPES = ("gemma3", "gemma4", "qwen3_5", "qwen3_5_moe")


def _family(model_type: str) -> str:
    return model_type[: -len("_text")] if model_type.endswith("_text") else model_type


def external_name(name: str, model_type: str, tool: str) -> str:
    """The name `tool` ("mlx" for mlx-lm, "hf" for transformers/PEFT) gives our parameter or module `name`."""
    if model_type not in _WRAPPED_TYPES:
        return name
    if tool == "mlx":
        return "language_model." + name
    return "model.language_model." + name[len("model."):] if name.startswith("model.") else name


class MetalLoRAAdapter:
    """LoRA layers attached to a metal model (go-inference's Adapter: `total_params`, `save`)."""

    def __init__(self, model: Module, config: LoRAConfig, modules: Sequence[str], *, model_type: str,
                 dropout_keys: lora.DropoutKeys, frozen_before: dict[str, tuple[type, set[str]]] | None = None) -> None:
        self._model = model
        self._frozen_before = frozen_before or {}
        self.config = config
        self.modules = list(modules)
        self.model_type = model_type
        self.dropout_keys = dropout_keys
        self._attached = True

    def _layers(self) -> dict[str, lora.LoRALinear]:
        if not self._attached:
            raise RuntimeError("this adapter was removed or fused into the model")
        layers = lora.lora_layers(self._model)
        return {m: layers[m] for m in self.modules}

    def total_params(self) -> int:
        return sum(layer.lora_a.size + layer.lora_b.size for layer in self._layers().values())

    def trainable_parameters(self) -> dict[str, Array]:
        """The LoRA weights by flat name (what the optimizer trains)."""
        self._layers()
        return self._model.trainable_parameters()

    def update(self, params: Mapping[str, Array]) -> None:
        self._layers()
        self._model.update(params)

    def set_training(self, training: bool) -> None:
        """Training mode turns LoRA dropout on."""
        for layer in self._layers().values():
            layer._training = training

    def reseed_dropout(self, seed: int) -> None:
        """Restart the dropout keys from `seed` (the trainer does it each step, for reproducible runs)."""
        self.dropout_keys.reseed(seed)

    def tensors(self) -> dict[str, Array]:
        """`<module>.lora_a` / `<module>.lora_b` by flat name, as mlx-lm saves them."""
        out: dict[str, Array] = {}
        for path, layer in self._layers().items():
            out[f"{path}.lora_a"], out[f"{path}.lora_b"] = layer.lora_a, layer.lora_b
        return out

    def scales(self) -> dict[str, float]:
        return {path: layer.scale for path, layer in self._layers().items()}

    def save(self, path: str | Path, format: str = "mlx") -> Path:  # noqa: A002
        """Write the adapter to the directory `path`: format "mlx" (mlx-lm's `adapters.safetensors`
        + `adapter_config.json`, loadable by `mlx_lm.load(..., adapter_path=)`) or "peft"."""
        if format not in ("mlx", "peft"):
            raise ValueError(f"adapter format must be 'mlx' or 'peft', not {format!r}")
        tool = "mlx" if format == "mlx" else "hf"

        def rename(name: str) -> str:
            return external_name(name, self.model_type, tool)

        tensors = self.tensors()
        mx.eval(list(tensors.values()))
        tensors = {f"{rename(n.rpartition('.')[0])}.{n.rpartition('.')[2]}": v for n, v in tensors.items()}
        scales = {rename(m): s for m, s in self.scales().items()}
        if format == "mlx":
            extra = {"model_type": self.model_type, "alpha": self.config.alpha, "lora_dtype": self.config.dtype}
            _, blocks = lora.blocks_of(self._model)
            return write_mlx_adapter(path, tensors, scales, num_blocks=len(blocks), dropout=self.config.dropout,
                                     extra=extra)
        return write_peft_adapter(path, tensors, scales, dropout=self.config.dropout)

    def _detached(self) -> None:
        self._attached = False
        # what was frozen before the adapter (quantized weights) is frozen again, nothing else
        for path, module in self._model.named_modules():
            kind, frozen = self._frozen_before.get(path, (None, set()))
            if kind is type(module):
                module._frozen = set(frozen)
            else:  # a module made by fusing: it keeps what its constructor froze
                module._frozen &= {"weight", "scales", "biases"} if "scales" in vars(module) else set()


def _frozen_state(model: Module) -> dict[str, tuple[type, set[str]]]:
    return {path: (type(module), set(module._frozen)) for path, module in model.named_modules()}


def _module_state(model: Module) -> list[tuple[Module, dict[str, Any]]]:
    """Every module of `model` with its attributes, for `_put_back`. Containers are copied: fusing
    replaces items of a list of blocks in place and freezing changes a `_frozen` set in place."""
    return [(module, {k: copy.copy(v) if isinstance(v, (list, dict, set)) else v for k, v in vars(module).items()})
            for _, module in model.named_modules()]


def _put_back(state: list[tuple[Module, dict[str, Any]]]) -> None:
    """Every module as `_module_state` found it: the same children, arrays, frozen names and kernel marks."""
    for module, attributes in state:
        vars(module).clear()
        vars(module).update(attributes)


class TrainableMixin:
    """Training methods of `MetalTextModel` (which provides `_model`, `_tokenizer`, `_model_type`)."""

    _model: Any
    _tokenizer: Any
    _model_type: str
    _device: Any = None  # mx.cpu when the model was loaded with gpu_layers=0
    _adapter: MetalLoRAAdapter | None = None
    # MetalTextModel's counted step: close() frees nothing while one runs, and refuses new ones.
    _step: Callable[[], AbstractContextManager[None]]
    settings: Settings  # the PYMLXC_* switches the model runs with

    # ------------------------------------------------------------------ TrainableModel
    def apply_lora(self, config: LoRAConfig | None = None, *, seed: int = 0) -> MetalLoRAAdapter:
        """Wrap the target linears of the last `config.num_layers` blocks in LoRA layers (B = 0, so the
        model is unchanged until trained) and freeze everything else. One adapter at a time."""
        with self._step():
            config = config or LoRAConfig()
            model = self._net()
            self._no_adapter_yet()
            paths = lora.select_modules(model, config.target_keys, config.num_layers)
            keys = lora.DropoutKeys(seed)
            specs = [lora.LoRASpec(p, config.rank, config.scale) for p in paths]
            frozen = _frozen_state(model)
            lora.attach(model, specs, dropout=config.dropout, dtype=config.dtype, seed=seed, dropout_keys=keys)
            self._adapter = MetalLoRAAdapter(model, config, paths, model_type=self._model_type, dropout_keys=keys,
                                             frozen_before=frozen)
            return self._adapter

    @property
    def adapter(self) -> MetalLoRAAdapter | None:
        return self._adapter

    def load_adapter(self, path: str | Path) -> MetalLoRAAdapter:
        """Attach the adapter in directory `path`: mlx-lm's format (`adapters.safetensors`) or PEFT's
        (`adapter_model.safetensors`). Errors name the tensors that do not fit."""
        with self._step():
            model = self._net()
            self._no_adapter_yet()
            weights = read_adapter(path)
            saved_type = weights.config.get("model_type")
            if isinstance(saved_type, str) and _family(saved_type) != _family(self._model_type):
                raise AdapterError(
                    f"{path}: the adapter was trained on a {saved_type!r} model, this is {self._model_type!r}")
            weights = _rename_modules(weights, model)
            dims = {p: lora.linear_dims(lora.get_module(model, p)) for p in _linear_paths(model)}
            check_shapes(weights, dims, f"this {self._model_type} model")
            first = weights.modules[0]
            dtype = "bfloat16" if weights.tensors[f"{first}.lora_a"].dtype == mx.bfloat16 else "float32"
            _, blocks = lora.blocks_of(model)
            config = LoRAConfig(
                rank=weights.rank(first), alpha=weights.scales[first] * weights.rank(first),
                target_keys=tuple(sorted({_in_block(m) for m in weights.modules})),
                num_layers=_num_layers(weights.modules, len(blocks)), dropout=min(weights.dropout, 0.99), dtype=dtype)
            keys = lora.DropoutKeys(0)
            specs = [lora.LoRASpec(m, weights.rank(m), weights.scales[m]) for m in weights.modules]
            frozen = _frozen_state(model)
            lora.attach(model, specs, dropout=config.dropout, dtype=dtype, dropout_keys=keys)
            adapter = MetalLoRAAdapter(model, config, weights.modules, model_type=self._model_type, dropout_keys=keys,
                                       frozen_before=frozen)
            try:
                lora.load_tensors(model, weights.tensors)
            except ValueError as exc:
                lora.detach(model)
                adapter._detached()
                raise AdapterError(f"{path}: {exc}") from None
            self._adapter = adapter
            return self._adapter

    def remove_adapter(self) -> None:
        """Put the base layers back (the adapter's weights are dropped)."""
        with self._step():
            if self._adapter is not None:
                lora.detach(self._net())
                self._adapter._detached()
                self._adapter = None

    def fuse_adapter(self, dequantize: bool = False) -> int:
        """Fold the adapter into the base weights (W += scale * (A B)^T). Quantized bases are
        dequantized, updated and requantized with their own group size and bits, unless
        `dequantize`, which leaves them dense. Returns how many layers were fused."""
        with self._step():
            if self._adapter is None:
                raise RuntimeError("no adapter to fuse")
            model = self._net()
            n = lora.fuse(model, dequantize=dequantize)
            mx.eval(list(model.parameters().values()))
            # The fused layers are new modules: choose their kernels again, by the model's settings.
            choose_kernels(model, self.settings, getattr(model, "compute_dtype", None))
            self._adapter._detached()
            self._adapter = None
            return n

    def save_fused(self, path: str | Path, source: str | Path, *, dequantize: bool = False) -> Path:
        """Fuse the adapter (if one is attached) and write a model directory at `path`: the weights
        under their checkpoint names, config.json and the tokenizer files copied from `source` (the
        directory the base model was loaded from). A quantized base stays quantized (fused layers are
        requantized with their own bits and group size) unless `dequantize`: then every layer is saved
        dense and the quantization config is dropped. Where the save fails, the model is left as it
        was, adapter included."""
        with self._step():
            net = self._net()
            # A destination that cannot take the files is refused before the model changes; a write
            # that fails later (a full disk, a FIFO where a file goes) puts the model back, its old
            # modules and arrays held until the files are written.
            prepare_model_dir(path, source)
            before, adapter = _module_state(net), self._adapter
            try:
                if adapter is not None:
                    self.fuse_adapter(dequantize=dequantize)
                if dequantize:
                    lora.dequantize_model(net)
                return save_model_dir(net, path, source, dequantized=dequantize,
                                      rename=lambda name: external_name(name, self._model_type, "mlx"))
            except BaseException:
                _put_back(before)
                if adapter is not None:
                    adapter._attached = True
                    self._adapter = adapter
                raise

    # ------------------------------------------------------------------ what pymlxc.train uses
    def logits(self, inputs: Array) -> Array:
        """Logits [B, L, V] of a [B, L] token array, without a cache (causal attention), through
        MLX's kernels only: their gradients are defined."""
        with self._step(), mlx_kernels_only():
            net = self._net()
            if not callable(net):
                raise TypeError(f"{type(net).__name__} is a module, not a language model: it cannot be called")
            logits: Array = net(inputs)
            return logits

    def training_encoder(self) -> Encoder:
        from .chat_template import builtin_template, render_chat

        tok = self._tokenizer
        eos = next(iter(sorted(tok.eos_token_ids)), None) if tok.eos_token_ids else None
        if tok.eos_token is not None and tok.token_to_id(tok.eos_token) is not None:
            eos = tok.token_to_id(tok.eos_token)
        render = render_tools = None
        has_builtin = True
        try:
            builtin_template(tok.model_type)
        except ValueError:
            has_builtin = False
        if tok.chat_template is not None or has_builtin:
            def render(messages: Sequence[Any], add_generation_prompt: bool) -> str:
                return render_chat(messages, tok, add_generation_prompt=add_generation_prompt)

            def render_tools(messages: Sequence[Any], add_generation_prompt: bool, tools: Sequence[Any]) -> str:
                return render_chat(messages, tok, add_generation_prompt=add_generation_prompt, tools=list(tools))
        return Encoder(encode=lambda text: tok.encode(text),
                       encode_plain=lambda text: tok.encode(text, add_special_tokens=False),
                       eos_token_id=eos, render_chat=render, render_chat_tools=render_tools,
                       model_type=self._model_type)

    def set_grad_checkpoint(self, enabled: bool) -> None:
        with self._step():
            lora.set_grad_checkpoint(self._net(), enabled)

    @contextlib.contextmanager
    def training_scope(self) -> Iterator[None]:
        """Run as one counted step (close() waits for it; once closed, the next training call inside
        raises ModelClosedError) on the model's device (the CPU when it was loaded with gpu_layers=0)."""
        with self._step():
            if self._device is None:
                yield
            else:
                with mx.stream_scope(self._device):
                    yield

    # ------------------------------------------------------------------ helpers
    def _net(self) -> Module:
        model: Module | None = self._model
        if model is None:
            from pymlxc.model import ModelClosedError

            raise ModelClosedError("the model is closed")
        return model

    def _no_adapter_yet(self) -> None:
        if self._adapter is not None:
            raise RuntimeError("the model already has an adapter; remove_adapter() or fuse_adapter() first")


def _linear_paths(model: Module) -> list[str]:
    prefix, blocks = lora.blocks_of(model)
    return [f"{prefix}.{i}.{p}" for i, b in enumerate(blocks) for p in lora.block_linears(b)]


def _in_block(module: str) -> str:
    parts = module.split(".")
    for i in range(len(parts) - 1):
        if parts[i] == "layers" and parts[i + 1].isdigit():
            return ".".join(parts[i + 2:])
    return module


def _num_layers(modules: Sequence[str], num_blocks: int) -> int | None:
    indices = []
    for m in modules:
        parts = m.split(".")
        indices += [int(parts[i + 1]) for i in range(len(parts) - 1) if parts[i] == "layers" and parts[i + 1].isdigit()]
    if not indices or min(indices) == 0:
        return None
    return num_blocks - min(indices)


def _rename_modules(weights: AdapterWeights, model: Module) -> AdapterWeights:
    """Map module names of another framework to the model's own where they differ only by the
    wrapper prefix (`model.language_model.layers` vs `language_model.model.layers`, a missing or
    extra `model.`); names that exist as they are stay."""
    known = set(_linear_paths(model))
    prefix, _ = lora.blocks_of(model)
    mapping: dict[str, str] = {}
    for m in weights.modules:
        if m in known:
            continue
        _, sep, rest = m.partition("layers.")
        candidate = f"{prefix}.{rest}" if sep else m
        if candidate in known:
            mapping[m] = candidate
    if not mapping:
        return weights
    tensors = {}
    for name, value in weights.tensors.items():
        module, _, leaf = name.rpartition(".")
        tensors[f"{mapping.get(module, module)}.{leaf}"] = value
    scales = {mapping.get(m, m): s for m, s in weights.scales.items()}
    return AdapterWeights(weights.format, weights.path, tensors, scales, weights.dropout, weights.config)


def prepare_model_dir(path: str | Path, source: str | Path) -> Path:
    """The directory `path` (made if missing) for a model written from `source`, after checking that
    `source` has a config.json to copy, that `path` is not `source` and can take files."""
    path, source = Path(path), Path(source)
    if not (source / "config.json").is_file():
        raise FileNotFoundError(f"{source} has no config.json to copy")
    if path.resolve() == source.resolve():
        raise ValueError("save the fused model to a new directory, not over its source")
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"{path} is not a directory: the fused model is written as a directory of files")
    path.mkdir(parents=True, exist_ok=True)
    if not os.access(path, os.W_OK | os.X_OK):
        raise PermissionError(f"cannot write in {path}: the fused model's directory must be writable")
    return path


def save_model_dir(model: Module, path: str | Path, source: str | Path, *, dequantized: bool = False,
                   rename: Any = None) -> Path:
    """Write `model`'s parameters as `model.safetensors` (named by `rename`, if given) with config.json
    and tokenizer files from `source`."""
    path, source = prepare_model_dir(path, source), Path(source)
    weights = model.parameters()
    mx.eval(list(weights.values()))
    if rename is not None:
        weights = {rename(k): v for k, v in weights.items()}
    # Bounded, regular files only, errors naming the file: `source` is any directory the caller names.
    config = read_json(source / "config.json", what="config file")
    write_replacing(path / "model.safetensors", lambda tmp: mx.save_safetensors(tmp, weights, {"format": "mlx"}),
                    what="fused weights file", suffix=".safetensors")
    if dequantized:
        for key in ("quantization", "quantization_config"):
            config.pop(key, None)
            if isinstance(config.get("text_config"), dict):
                config["text_config"].pop(key, None)
    text = json.dumps(config, indent=2) + "\n"
    write_replacing(path / "config.json", lambda tmp: Path(tmp).write_text(text, encoding="utf-8"), what="config file")
    for name in _TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, path / name)
    return path

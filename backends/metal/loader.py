"""Load a Hugging Face / mlx-lm model directory or a GGUF file into a native model: the single entry
that chooses the format (`formats/` reads a checkpoint into a config and tensors under HF names),
builds the model, swaps in quantized layers and chooses the kernels.

`load_weights_and_config(path)` reads `config.json`, picks the architecture, builds the model with
placeholder parameters, swaps in quantized layers where the checkpoint is quantized (mlx-lm's
layout: packed `weight`, `scales`, `biases`; config `quantization` with per-module overrides),
matches checkpoint names to parameters (with or without `language_model.` / `model.` prefixes),
checks every tensor's presence and shape, and evaluates the weights so that loading is paid for at
load. Dtypes are kept as stored (bfloat16 stays bfloat16) unless a `dtype` is asked for, and the
model's `compute_dtype` records the dtype its activations take: what kernels are chosen by (read it
there, not from a weight: a GGUF embedding may be uint8 blocks). `LoadedModel.free()` releases every
weight at once.
"""
from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pymlxc.core as mx
from pymlxc.core import Array, MLXError
from pymlxc.files import check_regular_file
from pymlxc.settings import Settings
from pymlxc.settings import current as current_settings

from . import nn
from .config_check import check_against_tensors
from .formats.errors import ConfigError, WeightsFileError
from .formats.safetensors import (
    SUPPORTED_BITS,
    SUPPORTED_GROUP_SIZES,
    canonical_name,
    quantization_of,
    read_config,
    read_weights,
    weight_files,
)
from .kernels.check import on_cuda
from .models import UnsupportedModelError, get_model_module, infer_model_type
from .models.switch_layers import QuantizedSwitchLinear
from .tokenizer import load_gguf_tokenizer

Progress = Callable[[int, int], None]

_EVAL_CHUNK_BYTES = 256 << 20  # weights evaluated per batch: enough to keep the reader busy
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}  # LoadConfig.dtype, "auto" aside


@dataclass
class LoadedModel:
    """A model with its weights in memory, and what the loader learnt about it."""

    model: Any
    config: dict[str, Any]
    model_type: str
    path: Path
    quantization: dict[str, Any] | None  # the default {"group_size", "bits"}, None when dense
    num_tensors: int
    nbytes: int
    quantized_modules: int = 0
    context_len: int = 131072
    distributed: str | None = None  # the mode the model was split by while loading (distributed/), else None
    cuda_matvec: bool = False  # 4-bit products of few rows through pymlxc's CUDA kernel (kernel_choice.py)
    _freed: bool = field(default=False, repr=False)

    @property
    def quant_bits(self) -> int:
        return int(self.quantization["bits"]) if self.quantization else 0

    @property
    def quant_group(self) -> int:
        return int(self.quantization["group_size"]) if self.quantization else 0

    def free(self) -> None:
        """Release every weight Array now (idempotent). The model cannot run afterwards."""
        if not self._freed:
            self._freed = True
            self.model.free()

    close = free

    def __enter__(self) -> LoadedModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.free()


def _resolve_names(weights: dict[str, Array], module_paths: set[str]) -> dict[str, Array]:
    """Checkpoint names -> parameter names; a name without the `model.` prefix gets it when that
    makes it a module of the model."""
    out: dict[str, Array] = {}
    for name, value in weights.items():
        c = canonical_name(name)
        module = c.rpartition(".")[0]
        if module not in module_paths and f"model.{module}" in module_paths:
            c = "model." + c
        out[c] = value
    return out


def _quant_params(path: str, module: nn.Module, weights: Mapping[str, Array], defaults: Mapping[str, Any],
                  overrides: Mapping[str, Any]) -> dict[str, int] | bool:
    """How the layer at `path` is quantized in the checkpoint: a config override, else read from
    the shapes of its packed weight and scales (as mlx-lm does for unnamed layers), else dense."""
    if path in overrides:
        choice = overrides[path]
        if choice is False or choice is None:
            return False
        if isinstance(choice, Mapping):
            return {"group_size": int(choice.get("group_size", defaults.get("group_size", 64))),
                    "bits": int(choice.get("bits", defaults.get("bits", 4)))}
        return {"group_size": int(defaults.get("group_size", 64)), "bits": int(defaults.get("bits", 4))}
    scales = weights.get(f"{path}.scales")
    packed = weights.get(f"{path}.weight")
    if scales is None or packed is None:
        return False
    # Every layer quantize offers (Linear, Embedding, SwitchLinear) holds its weight as a parameter.
    weight: Array = vars(module)["weight"]
    in_dims = weight.shape[-1]  # (out, in), or (experts, out, in) for a SwitchLinear
    bits = packed.shape[-1] * 32 // in_dims
    group_size = in_dims // scales.shape[-1] if scales.shape[-1] else 0
    # Exactly those: a floor that fits would read a wrong-width matrix as another bit width.
    if (bits not in SUPPORTED_BITS or group_size not in SUPPORTED_GROUP_SIZES or packed.shape[-1] * 32 != bits * in_dims
            or scales.shape[-1] * group_size != in_dims):
        raise nn.WeightsError(f"tensor {path}.weight: cannot read its quantization (packed shape {packed.shape}, "
                              f"scales shape {scales.shape}, {in_dims} inputs)")
    return {"group_size": group_size, "bits": bits}


_EXPERT = re.compile(r"^(.*\.experts\.)(\d+)(\..*)$")


def _check_experts(weights: Mapping[str, Array], origin: Mapping[str, Path]) -> None:
    """The experts of a layer stored one by one (`...mlp.experts.E.up_proj.weight`) have one shape:
    `sanitize` stacks them, which fails with an MLX error naming no tensor otherwise. Each is
    compared with the lowest-numbered expert of its layer."""
    groups: dict[tuple[str, str], dict[int, str]] = {}
    for name in weights:
        if (m := _EXPERT.match(name)) is not None:
            groups.setdefault((m.group(1), m.group(3)), {})[int(m.group(2))] = name
    for experts in groups.values():
        first, *rest = (experts[i] for i in sorted(experts))
        want = tuple(weights[first].shape)
        for name in rest:
            got = tuple(weights[name].shape)
            if got != want:
                raise WeightsFileError(f"tensor {name!r} in {origin.get(name)} has shape {got}, but {first!r} of the "
                                       f"same layer has {want}: all experts must have one shape")


def _weight_of(tensor: str) -> str:
    """The weight a quantized layer's scales or biases go with (the name its file records)."""
    for part in (".scales", ".biases"):
        if tensor.endswith(part):
            return tensor[: -len(part)] + ".weight"
    return tensor


def _check_dtypes(params: Mapping[str, Array], weights: Mapping[str, Array], origin: Mapping[str, Path]) -> None:
    """Each tensor has the kind of dtype its parameter computes with: floating point for weights,
    norms and scales, the packed integer type for quantized weights. (A float tensor declared I32
    would otherwise load and compute garbage.)"""
    for name, value in weights.items():
        want = params.get(name)
        if want is None:
            continue  # unexpected tensors are named by load_weights
        got_dt, want_dt = value.dtype, want.dtype
        if (got_dt.is_floating if want_dt.is_floating else got_dt == want_dt):
            continue
        src = origin.get(name)
        need = "a floating-point dtype" if want_dt.is_floating else want_dt.name
        raise WeightsFileError(f"tensor {name!r}" + (f" in {src}" if src else "")
                               + f" is stored as {got_dt.name}; the model needs {need}")


def _evaluate(params: dict[str, Array], origin: Mapping[str, Path], progress: Progress | None) -> int:
    """Read every weight now, in batches; returns the bytes read. Errors name file and tensor."""
    items = list(params.items())
    sizes = [a.nbytes for _, a in items]
    total = sum(sizes)
    done = 0
    if progress is not None:
        progress(0, total)
    batch: list[tuple[str, Array]] = []
    batch_bytes = 0

    def flush() -> None:
        nonlocal done, batch_bytes
        try:
            mx.eval([a for _, a in batch])
        except MLXError:
            for name, a in batch:  # find the tensor that failed
                try:
                    mx.eval(a)
                except MLXError as exc:
                    src = origin.get(name)
                    raise WeightsFileError(f"cannot read tensor {name!r}" + (f" from {src}" if src else "")
                                           + f": {exc}") from exc
            raise
        done += batch_bytes
        batch.clear()
        batch_bytes = 0
        if progress is not None:
            progress(done, total)

    for (name, a), size in zip(items, sizes, strict=True):
        batch.append((name, a))
        batch_bytes += size
        if batch_bytes >= _EVAL_CHUNK_BYTES:
            flush()
    if batch:
        flush()
    return total


# ---------------------------------------------------------------------- entry point

def load_weights_and_config(path: str | os.PathLike[str], context_len: int = 131072, device: Any = None, *,
                            progress: Progress | None = None, settings: Settings | None = None,
                            distributed: str | None = None, dtype: str = "auto") -> LoadedModel:
    """Load the model directory (or GGUF file) at `path`. `progress(done_bytes, total_bytes)` is called while the
    weights are read. `device` (a `pymlxc.core.Device`/`Stream`) runs the loading there.
    `context_len` is kept for the caller's `model.make_cache(context_len)`. `settings` (else the
    process's) choose the kernels (`cuda_matvec`). `distributed` ("tensor" or "pipeline"): a
    safetensors model is split over the launched ranks as it loads, each rank reading only its
    part (`LoadedModel.distributed` says so; a GGUF file loads whole, for `shard_loaded`). `dtype`
    (LoadConfig.dtype): "auto", or the dtype to compute in (`requested_dtype`)."""
    settings = settings if settings is not None else current_settings()
    if device is not None:
        with mx.stream_scope(device):
            return _load(Path(path), context_len, progress, settings, distributed, dtype)
    return _load(Path(path), context_len, progress, settings, distributed, dtype)


def requested_dtype(dtype: str) -> Any:
    """LoadConfig.dtype as an MLX dtype; None for "auto" (the checkpoint's own)."""
    if dtype == "auto":
        return None
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise ValueError(f"dtype must be one of 'auto', {', '.join(map(repr, DTYPES))}, not {dtype!r}")
    return DTYPES[dtype]


def gguf_file_of(path: str | os.PathLike[str]) -> Path | None:
    """The GGUF file that `path` names (a `.gguf` file, or a directory with one and no safetensors
    checkpoint), else None. Cheap unless GGUF files are there (see `gguf.find_gguf`)."""
    p = Path(path)
    if p.suffix.lower() != ".gguf" and not (p.is_dir() and any(p.glob("*.gguf"))):
        return None
    if p.suffix.lower() == ".gguf" and not p.is_dir():
        # A FIFO, a device or nothing at all named *.gguf: said so as a GGUF file, not "no model directory".
        check_regular_file(p, what="GGUF file")
    from .formats.gguf import find_gguf  # noqa: PLC0415 - gguf.py needs the optional `gguf` package

    return find_gguf(p)


def load_gguf_weights(path: str | os.PathLike[str], *, context_len: int = 131072, progress: Progress | None = None,
                      reader: Any = None, settings: Settings | None = None, dtype: str = "auto") -> LoadedModel:
    """The LoadedModel of the GGUF file at `path` (see gguf.py); `reader`: its GGUFReader, where read already;
    `dtype`: "auto" (gguf_tensors.compute_dtype decides) or the dtype to compute in."""
    # formats/gguf.py and gguf_layers.py need the optional `gguf` package: imported for GGUF files only.
    from .formats.gguf import GGUFError, read_gguf_checkpoint  # noqa: PLC0415
    from .gguf_layers import use_block_layers, use_planes  # noqa: PLC0415

    check_regular_file(Path(path), what="GGUF file")
    ckpt = read_gguf_checkpoint(path, reader, dtype=requested_dtype(dtype))
    blocks, compute = ckpt.blocks, ckpt.dtype
    layers = (lambda model: use_block_layers(model, blocks, compute)) if blocks else None
    try:
        loaded = build_model(ckpt.config, ckpt.arrays, dict.fromkeys(ckpt.arrays, ckpt.file), source=ckpt.file,
                             root=ckpt.file, context_len=context_len, progress=progress, layers=layers,
                             settings=settings, compute_dtype=ckpt.dtype)
    except nn.WeightsError as exc:  # a tensor that does not fit the model: say which file, and its name there
        gguf_name = ckpt.names.get(_weight_of(exc.tensor)) if exc.tensor else None
        raise GGUFError(f"{ckpt.file}: {exc}" + (f" (GGUF tensor {gguf_name!r})" if gguf_name else "")) from None
    del ckpt  # its arrays: a tensor rearranged below is then freed as soon as its copy is made
    if blocks:
        chosen = settings if settings is not None else current_settings()
        try:
            use_planes(loaded.model, loaded.model.compute_dtype, chosen.switch_on("cuda_q6k_planes", on_cuda()))
        except BaseException:
            loaded.free()
            raise
    return loaded


def load_gguf_model(path: str | os.PathLike[str], *, context_len: int = 131072, progress: Progress | None = None,
                    settings: Settings | None = None, dtype: str = "auto") -> tuple[Any, LoadedModel]:
    """(tokenizer, LoadedModel) of the GGUF file at `path`, reading its metadata once. The tokenizer
    comes first, so that a file without one fails before the weights are read."""
    # formats/gguf.py needs the optional `gguf` package: imported for GGUF files only.
    from .formats.gguf import naming, read_gguf  # noqa: PLC0415
    from .formats.gguf_config import architecture, model_type_of  # noqa: PLC0415

    file = Path(path)
    check_regular_file(file, what="GGUF file")  # no FIFO or device handed to the reader
    reader = read_gguf(file)
    with naming(file):
        tokenizer = load_gguf_tokenizer(file, reader, model_type_of(architecture(reader)))
    return tokenizer, load_gguf_weights(file, context_len=context_len, progress=progress, reader=reader,
                                        settings=settings, dtype=dtype)


def _load(root: Path, context_len: int, progress: Progress | None, settings: Settings,
          distributed: str | None, dtype: str) -> LoadedModel:
    cast = requested_dtype(dtype)  # checked before anything is read
    gguf_file = gguf_file_of(root)
    if gguf_file is not None:
        return load_gguf_weights(gguf_file, context_len=context_len, progress=progress, settings=settings,
                                 dtype=dtype)
    config = read_config(root)
    quantization_of(config, root / "config.json")  # another format (GPTQ, AWQ) refused before any tensor is read
    raw, origin = read_weights(root)  # lazy: nothing is read before evaluation
    return build_model(config, raw, origin, source=root / "config.json", root=root, context_len=context_len,
                       progress=progress, settings=settings, distributed=distributed, dtype=cast)


def build_model(config: dict[str, Any], raw: dict[str, Array], origin: Mapping[str, Path], *, source: Path,
                root: Path, context_len: int, progress: Progress | None,
                layers: Callable[[nn.Module], int] | None = None, settings: Settings | None = None,
                distributed: str | None = None, dtype: Any = None, compute_dtype: Any = None) -> LoadedModel:
    """The model of `config` with the checkpoint tensors `raw` (HF names) in it; `source` names the
    file that errors about the config refer to, `origin` the file of each tensor; `layers(model)`
    swaps in a format's own layer types before the weights go in (returns how many); `settings`
    (else the process's) choose the kernels. `distributed`: split the model by that mode before
    the weights go in, reading each split tensor's part only from its safetensors file (`raw`
    must then be MLX's lazy safetensors arrays, as `origin` names them). `dtype`: cast every
    floating tensor to it as it loads (quantization scales and biases too, but not to float32:
    `quantized_matmul` takes half-precision ones with float32 x, exact and half the bytes).
    `model.compute_dtype` is set to `compute_dtype` (a format that chose it, GGUF), else `dtype`,
    else the embedding's output dtype (its scales' for a quantized one)."""
    file = source
    model_type = config.get("model_type") or infer_model_type(config, (canonical_name(k) for k in raw))
    if model_type is not None and not isinstance(model_type, str):
        raise ConfigError(f"{file}: model_type must be a string, got {model_type!r}")
    module = get_model_module(model_type, (canonical_name(k) for k in raw))
    try:
        args = module.ModelArgs.from_dict(config)
        # Before a model of the config's size is allocated: does the checkpoint have that size?
        check_against_tensors(args, {canonical_name(k): v.shape for k, v in raw.items()})
    except ConfigError as exc:
        raise ConfigError(f"{file}: {exc}") from exc
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        raise ConfigError(f"{file}: cannot read the {model_type} config: {exc}") from exc
    try:
        model = module.Model(args)
    except (TypeError, ValueError, ZeroDivisionError, OverflowError, MLXError) as exc:
        # Fields each in range can still multiply past MLX's 32-bit shapes (heads * head_dim).
        raise ConfigError(f"{file}: cannot build a {model_type} model from this config: {exc}") from exc

    module_paths = {p for p, _ in model.named_modules()}
    sources = None
    if distributed is not None:  # where each tensor sanitize passes through can be read in part
        from .distributed import Source  # noqa: PLC0415 - the distributed runtime only when asked

        sources = {id(v): Source(v, origin[k], k) for k, v in raw.items()}
    _check_experts(raw, origin)
    try:
        weights = model.sanitize(_resolve_names(raw, module_paths))
    except MLXError as exc:  # a rearrangement (stack, split) the tensors do not fit
        raise WeightsFileError(f"{root}: cannot arrange the checkpoint's tensors for {model_type}: {exc}") from exc
    del raw
    origin = {canonical_name(k): v for k, v in origin.items()}

    # An output head the checkpoint does not store is the embedding matrix (tied), unless the config
    # says the head is its own: then the checkpoint lacks it (transformers would leave it random).
    if getattr(model, "lm_head", None) is not None and "lm_head.weight" not in weights:
        if getattr(args, "tie_word_embeddings", None) is False:
            raise nn.WeightsError(f"missing tensor in checkpoint: lm_head.weight ({file} sets tie_word_embeddings "
                                  "to false: the output head is not the embedding)", "lm_head.weight")
        model.tie_embeddings()

    quant = quantization_of(config, file)
    quantized = layers(model) if layers is not None else 0
    if quant is not None or any(k.endswith(".scales") for k in weights):
        defaults: dict[str, Any] = {k: quant[k] for k in ("group_size", "bits") if quant and k in quant}
        overrides = {canonical_name(k): v for k, v in (quant or {}).items()
                     if k not in ("group_size", "bits", "mode") and (isinstance(v, Mapping) or v is False)}
        overrides = {("model." + k if k not in module_paths and f"model.{k}" in module_paths else k): v
                     for k, v in overrides.items()}
        # Bound now: `weights` is rebound and deleted below, and quantize calls the predicate only here.
        predicate = functools.partial(_quant_params, weights=weights, defaults=defaults, overrides=overrides)
        quantized += nn.quantize(model, predicate, group_size=int(defaults.get("group_size", 64)),
                                bits=int(defaults.get("bits", 4)))
        if quant is None and quantized:
            first = next(m for _, m in model.named_modules()
                         if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding, QuantizedSwitchLinear)))
            quant = {"group_size": first.group_size, "bits": first.bits}
        if quant is not None and not quantized:
            raise ConfigError(f"{file}: quantization: {quant.get('bits')}-bit weights declared, but the checkpoint's "
                              "tensors are not quantized (no *.scales)")

    _check_dtypes(model.parameters(), weights, origin)
    group = None
    if distributed is not None:
        from .distributed import narrow_weights, shard_before_load  # noqa: PLC0415 - see above

        group, dropped, layouts = shard_before_load(model, distributed)
        weights = narrow_weights(model.parameters(), weights, sources or {}, group.rank(), group.size(), dropped,
                                 layouts)
        del sources
    if dtype is not None:  # lazy casts: each is read in its dtype by _evaluate's batches
        weights = {k: _cast(k, v, dtype) for k, v in weights.items()}
    model.load_weights(weights, strict=True)
    del weights
    params, constants = model.parameters_and_constants()
    nbytes = _evaluate(params, origin, progress)
    # Constants derived from weights at load (e.g. Gemma's 1 + w) are evaluated now as well.
    mx.eval(constants)
    if group is not None:
        from .distributed import finish_after_load  # noqa: PLC0415 - see above

        finish_after_load(model, str(distributed), group)
    model.compute_dtype = compute_dtype or dtype or _embedding_dtype(model)
    check_kernels = getattr(model, "check_kernels", None)
    if callable(check_kernels):  # a model's own kernels are checked here, on the loading thread
        check_kernels(model.compute_dtype)
    # The quantized layers' kernels, and the dense matvec kernel of a 16-bit model's block linears.
    cuda_matvec = nn.choose_kernels(model, settings if settings is not None else current_settings(),
                                    model.compute_dtype)
    return LoadedModel(model=model, config=config, model_type=str(model_type), path=root,
                       quantization={"group_size": int(quant.get("group_size", 64)), "bits": int(quant.get("bits", 4))}
                       if quant else None,
                       num_tensors=len(params), nbytes=nbytes, quantized_modules=quantized, context_len=context_len,
                       distributed=distributed, cuda_matvec=cuda_matvec)


def _cast(name: str, value: Array, dtype: Any) -> Array:
    if not value.dtype.is_floating or value.dtype == dtype:
        return value
    if dtype == mx.float32 and name.endswith((".scales", ".biases")):
        return value
    return value.astype(dtype)


def _embedding_dtype(model: Any) -> Any:
    """The dtype the token embedding outputs: its scales' when quantized, else its table's."""
    embed = model.model.embed_tokens
    return vars(embed).get("scales", embed.weight).dtype


__all__ = ["LoadedModel", "WeightsFileError", "ConfigError", "UnsupportedModelError", "load_weights_and_config",
           "build_model", "gguf_file_of", "load_gguf_weights", "load_gguf_model",
           "read_config", "weight_files", "canonical_name"]

"""A Hugging Face / mlx-lm model directory as a checkpoint: config.json (with its mlx-lm
`quantization` entry checked), the safetensors shards (from the index, with its file names kept
inside the directory) read lazily into tensors under their checkpoint names, and the canonical
HF name of a multimodal checkpoint's text tensors. Errors name the file."""
from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pymlxc.core as mx
from pymlxc.core import Array, MLXError
from pymlxc.files import check_directory, read_json
from pymlxc.safetensors_check import DTYPE_SIZES, HEADER_LIMIT, MAX_DIM, brief, check_loaded, read_header
from pymlxc.safetensors_check import check_header as _check_header

from .errors import ConfigError, WeightsFileError

SUPPORTED_BITS = (2, 3, 4, 5, 6, 8)
SUPPORTED_GROUP_SIZES = (32, 64, 128)  # those MLX's affine quantization takes
ADAPTER_FILES = ("adapters.safetensors", "adapter_model.safetensors")  # LoRA adapters, not the model's weights
# What a checkpoint of another quantization format (GPTQ, AWQ, bitsandbytes, fp8, ...) is told.
_FOREIGN_QUANT_HINT = ("only MLX-quantized checkpoints (mlx-lm's 'quantization' entry: affine 'bits' and "
                       "'group_size') and unquantized float16/bfloat16/float32 ones load; convert this one with "
                       "mlx_lm.convert from its unquantized original")


# ---------------------------------------------------------------------- config

def read_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """config.json of a model directory as a dict; errors name the file and what is wrong."""
    root = check_directory(path, what="model directory")
    file = root / "config.json"
    if not file.exists():
        raise FileNotFoundError(f"config.json not found in {root} (expected {file})")
    return read_json(file, what="config file", error=ConfigError)


def _check_quant_entry(entry: Mapping[str, Any], field: str, file: Path) -> None:
    """bits and group_size of a `quantization` entry, when given, are values MLX can unpack (null
    is no value: the loader would take it as one), and its mode is affine."""
    for key, allowed in (("bits", SUPPORTED_BITS), ("group_size", SUPPORTED_GROUP_SIZES)):
        value = entry.get(key)
        if key in entry and (value is None or isinstance(value, bool) or value not in allowed):
            raise ConfigError(f"{file}: {field}.{key}: expected one of {', '.join(map(str, allowed))}, got {value!r}")
    mode = entry.get("mode", "affine")  # a layer of another mode would be unpacked as affine: garbage
    if mode != "affine":
        raise ConfigError(f"{file}: {field}.mode: quantization mode {mode!r} is not supported (only 'affine')")


def quantization_of(config: Mapping[str, Any], file: Path) -> dict[str, Any] | None:
    """mlx-lm's `quantization` entry (or the same under `quantization_config`); other methods
    (GPTQ, AWQ, bitsandbytes, fp8, ...) are not supported here."""
    q = config.get("quantization")
    if q is None:
        q = config.get("quantization_config")
        # mlx-lm copies its own entry here without a quant_method; one with a quant_method (GPTQ and AWQ
        # have 'bits' too) is another format, whose tensors would only fail later as unexpected names.
        if isinstance(q, Mapping) and "quant_method" in q:
            raise ConfigError(f"{file}: quantization_config.quant_method: {brief.repr(q['quant_method'])} "
                              f"checkpoints are not supported: {_FOREIGN_QUANT_HINT}")
        if q is None and isinstance(config.get("text_config"), Mapping):
            q = config["text_config"].get("quantization")
    if q is None:
        return None
    if not isinstance(q, Mapping):
        raise ConfigError(f"{file}: 'quantization' must be an object, got {type(q).__name__}")
    _check_quant_entry(q, "quantization", file)
    for key, entry in q.items():  # per-module overrides: {"model.layers.0.mlp.up_proj": {"bits": 8, ...}}
        if isinstance(entry, Mapping):
            _check_quant_entry(entry, f"quantization.{key}", file)
    return dict(q)


# ---------------------------------------------------------------------- weights

def read_index(root: Path) -> dict[str, Path] | None:
    """`model.safetensors.index.json`'s weight_map (tensor name -> shard file inside `root`), or
    None when the directory has no index."""
    index = root / "model.safetensors.index.json"
    if not index.exists():
        return None
    weight_map = read_json(index, what="safetensors index", error=WeightsFileError).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise WeightsFileError(f"{index}: not a safetensors index (no 'weight_map' of tensor -> file name)")
    shards = {n: root / _shard_name(n, index) for n in set(weight_map.values())}
    return {k: shards[v] for k, v in weight_map.items()}


def weight_files(root: Path, index: dict[str, Path] | None = None) -> list[Path]:
    """The checkpoint's safetensors shards: those that `model.safetensors.index.json` lists (`index`,
    where read already), else `model*.safetensors`, else every `*.safetensors` but LoRA adapter
    files. (Repositories such as Mistral's also hold the same weights in another layout,
    `consolidated.safetensors`.)"""
    if index is None:
        index = read_index(root)
    if index is not None:
        files = sorted(set(index.values()))
        for f in files:
            if not f.exists():
                raise WeightsFileError(f"weights file {f} listed in {root / 'model.safetensors.index.json'} is "
                                       "missing")
        return files
    files = sorted(root.glob("model*.safetensors"))
    if not files:
        files = sorted(p for p in root.glob("*.safetensors") if p.name not in ADAPTER_FILES)
    if not files:
        raise FileNotFoundError(f"no *.safetensors weight files in {root}")
    return files


def _shard_name(name: str, index: Path) -> str:
    """A file name of the index's weight_map, refused unless it names a file inside the model
    directory: no absolute path, no `..` (links the directory itself holds are followed, as the
    Hugging Face cache needs)."""
    parts = name.replace("\\", "/").split("/")
    if not name or name.startswith(("/", "\\")) or ".." in parts or "" in parts or (len(name) > 1 and name[1] == ":"):
        raise WeightsFileError(f"{index}: weight_map names {name!r}, which is not a file inside the model "
                               "directory (absolute paths and '..' are refused)")
    return name


def _read_header(f: Path) -> tuple[Any, int]:
    """The parsed JSON header of the weights file `f` and the size of its data section
    (`pymlxc.safetensors_check.read_header`); a FIFO or device there raises `UnsafeFileError`."""
    return read_header(f, what="weights file", error=WeightsFileError)


def check_header(f: Path, header: Any, data_size: int) -> None:
    """Refuse, with a `WeightsFileError`, a header MLX would read wrong or not at all
    (`pymlxc.safetensors_check.check_header`)."""
    _check_header(f, header, data_size, what="weights file", error=WeightsFileError)


def read_shards(files: list[Path]) -> tuple[dict[str, Array], dict[str, Path]]:
    """The tensors of `files` (lazy) and the file of each. Each file's header is checked first
    (`check_header`): MLX's reader takes shapes it cannot hold. A name in two files is refused:
    which copy would load depends on the order the files are read in."""
    weights: dict[str, Array] = {}
    origin: dict[str, Path] = {}
    for f in files:
        header, data_size = _read_header(f)
        check_header(f, header, data_size)
        try:
            arrays, _ = mx.load_safetensors(f)
        except MLXError as exc:
            raise WeightsFileError(f"cannot read weights file {f}: {exc}") from exc
        for k in arrays:
            if k in origin:
                raise WeightsFileError(f"tensor {k!r} is in two weights files: {origin[k]} and {f}")
        check_loaded(f, header, arrays, error=WeightsFileError)  # replaced since its header was checked?
        weights.update(arrays)
        origin.update(dict.fromkeys(arrays, f))
    return weights, origin


def read_weights(root: Path) -> tuple[dict[str, Array], dict[str, Path]]:
    """The tensors of the model directory `root` (lazy) and the file of each (see `weight_files`).
    A tensor the index lists that no shard holds is refused: the download is incomplete or the
    index stale, and the tensor would be missing (or, for `lm_head.weight`, silently tied)."""
    index = read_index(root)
    weights, origin = read_shards(weight_files(root, index))
    absent = sorted(k for k in index or () if k not in origin)
    if index is not None and absent:
        shown = ", ".join(f"{k!r} (in {index[k].name})" for k in absent[:5])
        raise WeightsFileError(f"{root / 'model.safetensors.index.json'}: weight_map lists "
                               f"{len(absent)} tensor{'s' if len(absent) > 1 else ''} that no weights file holds: "
                               + shown + (", ..." if len(absent) > 5 else ""))
    return weights, origin


def canonical_name(name: str) -> str:
    """Drop the multimodal wrappers: `language_model.model.x` and `model.language_model.x` -> `model.x`,
    `language_model.lm_head.x` -> `lm_head.x`."""
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model."):]
    if name.startswith("language_model."):
        return name[len("language_model."):]
    return name


__all__ = ["SUPPORTED_BITS", "SUPPORTED_GROUP_SIZES", "ADAPTER_FILES", "HEADER_LIMIT", "MAX_DIM", "DTYPE_SIZES",
           "read_config", "quantization_of", "read_index", "weight_files", "check_header", "read_shards",
           "read_weights", "canonical_name"]

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
from pymlxc.files import check_directory, check_regular_file, read_json

from .errors import ConfigError, WeightsFileError

SUPPORTED_BITS = (2, 3, 4, 5, 6, 8)
SUPPORTED_GROUP_SIZES = (32, 64, 128)  # those MLX's affine quantization takes
ADAPTER_FILES = ("adapters.safetensors", "adapter_model.safetensors")  # LoRA adapters, not the model's weights


# ---------------------------------------------------------------------- config

def read_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """config.json of a model directory as a dict; errors name the file and what is wrong."""
    root = check_directory(path, what="model directory")
    file = root / "config.json"
    if not file.exists():
        raise FileNotFoundError(f"config.json not found in {root} (expected {file})")
    return read_json(file, what="config file", error=ConfigError)


def _check_quant_entry(entry: Mapping[str, Any], field: str, file: Path) -> None:
    """bits and group_size of a `quantization` entry, when given, are values MLX can unpack."""
    for key, allowed in (("bits", SUPPORTED_BITS), ("group_size", SUPPORTED_GROUP_SIZES)):
        value = entry.get(key)
        if value is not None and (isinstance(value, bool) or value not in allowed):
            raise ConfigError(f"{file}: {field}.{key}: expected one of {', '.join(map(str, allowed))}, got {value!r}")


def quantization_of(config: Mapping[str, Any], file: Path) -> dict[str, Any] | None:
    """mlx-lm's `quantization` entry (or the same under `quantization_config`); other methods
    (GPTQ, AWQ, bitsandbytes, fp8, ...) are not supported here."""
    q = config.get("quantization")
    if q is None:
        q = config.get("quantization_config")
        if q is None and isinstance(config.get("text_config"), Mapping):
            q = config["text_config"].get("quantization")
        if q is not None and isinstance(q, Mapping) and ("quant_method" in q and "bits" not in q):
            raise ConfigError(f"{file}: quantization method {q.get('quant_method')!r} is not supported "
                              "(only MLX affine quantization: 'bits' and 'group_size')")
    if q is None:
        return None
    if not isinstance(q, Mapping):
        raise ConfigError(f"{file}: 'quantization' must be an object, got {type(q).__name__}")
    mode = q.get("mode", "affine")
    if mode != "affine":
        raise ConfigError(f"{file}: quantization mode {mode!r} is not supported (only 'affine')")
    _check_quant_entry(q, "quantization", file)
    for key, entry in q.items():  # per-module overrides: {"model.layers.0.mlp.up_proj": {"bits": 8, ...}}
        if isinstance(entry, Mapping):
            _check_quant_entry(entry, f"quantization.{key}", file)
    return dict(q)


# ---------------------------------------------------------------------- weights

def weight_files(root: Path) -> list[Path]:
    """The checkpoint's safetensors shards: those that `model.safetensors.index.json` lists, else
    `model*.safetensors`, else every `*.safetensors` but LoRA adapter files. (Repositories such as
    Mistral's also hold the same weights in another layout, `consolidated.safetensors`.)"""
    index = root / "model.safetensors.index.json"
    if index.exists():
        weight_map = read_json(index, what="safetensors index", error=WeightsFileError).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise WeightsFileError(f"{index}: not a safetensors index (no 'weight_map' of tensor -> file name)")
        files = [root / _shard_name(n, index) for n in sorted(set(weight_map.values()))]
        for f in files:
            if not f.exists():
                raise WeightsFileError(f"weights file {f} listed in {index} is missing")
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


def read_shards(files: list[Path]) -> tuple[dict[str, Array], dict[str, Path]]:
    weights: dict[str, Array] = {}
    origin: dict[str, Path] = {}
    for f in files:
        check_regular_file(f, what="weights file")  # MLX opens it by name: no FIFO, no device
        try:
            arrays, _ = mx.load_safetensors(f)
        except MLXError as exc:
            raise WeightsFileError(f"cannot read weights file {f}: {exc}") from exc
        for k, v in arrays.items():
            weights[k] = v
            origin[k] = f
    return weights, origin


def canonical_name(name: str) -> str:
    """Drop the multimodal wrappers: `language_model.model.x` and `model.language_model.x` -> `model.x`,
    `language_model.lm_head.x` -> `lm_head.x`."""
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model."):]
    if name.startswith("language_model."):
        return name[len("language_model."):]
    return name


__all__ = ["SUPPORTED_BITS", "SUPPORTED_GROUP_SIZES", "ADAPTER_FILES", "read_config", "quantization_of",
           "weight_files", "read_shards", "canonical_name"]

"""A Hugging Face / mlx-lm model directory as a checkpoint: config.json (with its mlx-lm
`quantization` entry checked), the safetensors shards (from the index, with its file names kept
inside the directory) read lazily into tensors under their checkpoint names, and the canonical
HF name of a multimodal checkpoint's text tensors. Errors name the file."""
from __future__ import annotations

import itertools
import json
import math
import os
import reprlib
import stat
import struct
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
HEADER_LIMIT = 100_000_000  # the safetensors format's own bound on the JSON header
MAX_DIM = 2**31 - 1  # MLX shapes are int32: its reader keeps only the low 32 bits of a larger dimension
# The dtypes MLX's safetensors reader takes, and their sizes in bytes (the F8 ones load as uint8).
DTYPE_SIZES: dict[str, int] = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E8M0": 1, "U16": 2, "I16": 2,
                               "F16": 2, "BF16": 2, "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "C64": 8}
# What a checkpoint of another quantization format (GPTQ, AWQ, bitsandbytes, fp8, ...) is told.
_FOREIGN_QUANT_HINT = ("only MLX-quantized checkpoints (mlx-lm's 'quantization' entry: affine 'bits' and "
                       "'group_size') and unquantized float16/bfloat16/float32 ones load; convert this one with "
                       "mlx_lm.convert from its unquantized original")

_repr = reprlib.Repr()
_repr.maxstring = 60
_repr.maxother = 60
_repr.maxlist = _repr.maxtuple = 8


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
            raise ConfigError(f"{file}: quantization_config.quant_method: {_repr.repr(q['quant_method'])} "
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
    """The parsed JSON header of the safetensors file `f` and the size of its data section; only
    the header's bytes are read (the data is left to MLX's lazy reader)."""
    check_regular_file(f, what="weights file")  # MLX opens it by name: no FIFO, no device
    # O_NONBLOCK: a FIFO swapped in after the check cannot block the open either.
    with os.fdopen(os.open(f, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)), "rb") as fh:
        st = os.fstat(fh.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise WeightsFileError(f"weights file {f} is no longer a regular file")
        prefix = fh.read(8)
        n = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else 0
        if not 2 <= n <= min(HEADER_LIMIT, st.st_size - 8):
            raise WeightsFileError(f"weights file {f}: not a safetensors file: header length {n} is not within "
                                   f"2..{HEADER_LIMIT} and the file's {st.st_size} bytes")
        raw = fh.read(n)
    if len(raw) < n:
        raise WeightsFileError(f"weights file {f} was cut short while its header was read")
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # ValueError: JSON, or an int of 4300+ digits
        raise WeightsFileError(f"weights file {f}: header is not valid JSON: {exc}") from None
    return header, st.st_size - 8 - n


def check_header(f: Path, header: Any, data_size: int) -> None:
    """Refuse a safetensors header MLX would read wrong or not at all: an unknown dtype, a shape
    that is not a list of non-negative int32 values (MLX truncates a larger one: [2**32 + 64]
    loads as (64,)), data_offsets that do not hold exactly the shape's bytes within the data
    section, tensors that share bytes, and `__metadata__` that is not an object of strings."""
    if not isinstance(header, dict):
        raise WeightsFileError(f"weights file {f}: header is not a JSON object but {type(header).__name__}")
    spans: list[tuple[int, int, str]] = []
    for name, entry in header.items():
        if name == "__metadata__":  # optional: null as the safetensors format reads it (MLX writes it)
            strings = isinstance(entry, dict) and all(isinstance(v, str) for v in entry.values())
            if entry is not None and not strings:
                raise WeightsFileError(f"weights file {f}: __metadata__: expected an object of strings, got "
                                       f"{_repr.repr(entry)}")
            continue
        where = f"tensor {name!r} in {f} has"
        if not isinstance(entry, dict):
            raise WeightsFileError(f"{where} a header entry {_repr.repr(entry)}, not an object with dtype, shape "
                                   "and data_offsets")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
            raise WeightsFileError(f"{where} dtype {_repr.repr(dtype)}, which MLX cannot read (it reads "
                                   f"{', '.join(DTYPE_SIZES)})")
        # type() is int: JSON true is a bool, which is an int to isinstance
        if not isinstance(shape, list) or not all(type(d) is int for d in shape):
            raise WeightsFileError(f"{where} shape {_repr.repr(shape)}, not a list of integers")
        if any(d < 0 for d in shape):  # MLX's reader takes [-2, -2] for 4 values
            raise WeightsFileError(f"{where} a negative dimension: shape {_repr.repr(tuple(shape))}")
        if any(d > MAX_DIM for d in shape):
            raise WeightsFileError(f"{where} a dimension over {MAX_DIM}, the most an MLX shape holds: shape "
                                   f"{_repr.repr(tuple(shape))}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
            raise WeightsFileError(f"{where} data_offsets {_repr.repr(offsets)}, not [begin, end] integers")
        begin, end = offsets
        if not 0 <= begin <= end <= data_size:
            raise WeightsFileError(f"{where} data_offsets [{begin}, {end}] outside the file's data section of "
                                   f"{data_size} bytes")
        need = math.prod(shape) * DTYPE_SIZES[dtype]  # exact: MLX's 64-bit product of [2**30] * 4 wraps to 0
        if end - begin != need:
            raise WeightsFileError(f"{where} data_offsets [{begin}, {end}], {end - begin} bytes, but shape "
                                   f"{_repr.repr(tuple(shape))} of {dtype} takes {need}")
        if need:
            spans.append((begin, end, name))
    spans.sort()
    for (b0, e0, n0), (b1, e1, n1) in itertools.pairwise(spans):
        if b1 < e0:  # sorted: the first overlap, if any, is between neighbours
            raise WeightsFileError(f"tensor {n1!r} in {f} has data_offsets [{b1}, {e1}], which overlap those of "
                                   f"tensor {n0!r}, [{b0}, {e0}]")


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
        for k, v in arrays.items():
            if k in origin:
                raise WeightsFileError(f"tensor {k!r} is in two weights files: {origin[k]} and {f}")
            if k not in header or list(v.shape) != header[k]["shape"]:  # replaced since its header was checked
                raise WeightsFileError(f"tensor {k!r} in {f}: MLX read shape {tuple(v.shape)}, not the checked "
                                       "header's (did the file change?)")
            weights[k] = v
            origin[k] = f
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

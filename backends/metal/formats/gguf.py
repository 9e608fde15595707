"""GGUF models for the native backend: check the file, read its config, map its tensors to HF names.

A GGUF file (llama.cpp's format) holds what a Hugging Face directory spreads over several files:
the architecture's hyperparameters (`<arch>.*` keys), the tokenizer (`tokenizer.*` keys, see
`gguf_tokenizer.py`) and the tensors, under llama.cpp's names (`blk.0.attn_q.weight`). This module
turns it into what `loader.py` builds models from: an HF-style config dict and a weight dict under
HF names, so every architecture file works unchanged.

Reading is done in two passes, both in Python: `read_gguf` checks the whole structure with the
`gguf` package's reader, with bounds checks of its own (a string or array longer than the file, a
tensor count the file cannot hold, tensor data past the end) and the tensor types against those
pymlxc loads; then `gguf_tensors.read_tensors` reads each tensor from the reader's read-only memory
map and converts it (`gguf_quants.py`: which types are repacked into MLX's affine layout, bit-exact
or with float16-rounded scales, and which are kept as llama.cpp's blocks). MLX's own GGUF reader is
not used: it widens K-quants to float16 and maps the file for writing. `docs/gguf.md` has the table.

Llama 3's RoPE scaling, stored as a `rope_freqs` tensor of per-pair factors, becomes config values.
"""
from __future__ import annotations

import contextlib
import itertools
import math
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import pymlxc.core as mx

try:
    from gguf import GGMLQuantizationType as QType
    from gguf import GGUFReader, GGUFValueType
    from gguf.constants import GGML_QUANT_SIZES
except ImportError as exc:  # an optional dependency: pip install 'pymlxc[gguf]'
    raise ImportError("GGUF models need the `gguf` package: pip install 'pymlxc[gguf]' (or pip install gguf)") from exc

from .gguf_config import (
    ARCHITECTURES,
    GGUFError,
    architecture,
    gguf_config,
    llama3_rope_scaling,
    metadata,
    model_type_of,
)
from .gguf_quants import AFFINE_BITS, GROUP
from .gguf_tensors import TensorError, compute_dtype, hf_name, read_tensors

GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)
MAX_DIMS = 4  # llama.cpp's GGML_MAX_DIMS
MAX_ARRAY_LEN = 1 << 24  # metadata arrays: real vocabularies have a few hundred thousand entries
MAX_STRING_LEN = 1 << 28  # an embedded tokenizer.json is tens of MiB at most
_MAX_DIM = (1 << 31) - 1  # MLX shapes are int32

# Tensor types pymlxc loads (gguf_quants.py says how each is kept); any other is refused by name.
DENSE_TYPES = (QType.F32, QType.F16, QType.BF16)
QUANT_BITS = {**AFFINE_BITS, QType.Q2_K: 2, QType.Q3_K: 3, QType.Q6_K: 6}
SUPPORTED_TYPES = DENSE_TYPES + tuple(QUANT_BITS)
QUANT_GROUP = GROUP  # the group of every repacked type
# What to do with a file of another type (IQ*, TQ*, MXFP4, ...): every standard recipe loads.
_RECIPES = ("re-quantize it with llama-quantize to Q4_K_M (or any of Q2_K, Q3_K_S/M/L, Q4_0, Q4_1, Q4_K_S/M, "
            "Q5_0, Q5_1, Q5_K_S/M, Q6_K, Q8_0), or load the original safetensors")



class _Corrupt(ValueError):
    """Raised inside the reader; `read_gguf` adds the file name."""


# ---------------------------------------------------------------------- finding the file

def find_gguf(path: str | os.PathLike[str]) -> Path | None:
    """The GGUF file a model path means: the path itself when it is a `.gguf` file, the single
    `.gguf` file of a directory that has no safetensors checkpoint, else None. A directory with
    several model files is an error that lists them (`mmproj*` vision projectors are not models)."""
    p = Path(path)
    if p.is_file():
        return p if p.suffix.lower() == ".gguf" else None
    if not p.is_dir():
        return None
    if (p / "config.json").is_file() and any(p.glob("*.safetensors")):
        return None
    found = sorted(f for f in p.iterdir()
                   if f.suffix.lower() == ".gguf" and f.is_file() and not f.name.lower().startswith("mmproj"))
    if len(found) > 1:
        raise GGUFError(f"{p} holds {len(found)} GGUF files; pass the one to load: "
                        + ", ".join(f.name for f in found))
    return found[0] if found else None


# ---------------------------------------------------------------------- checked reading

class _CheckedReader(GGUFReader):
    """The `gguf` package's reader with every read bounds-checked against the file, and arrays read
    in one piece. Numeric arrays become one part each: read them with `contents()` (a slice), not by
    element index. String arrays keep one part per string, without the length parts."""

    def _plain(self) -> np.ndarray:
        # Slicing a plain view is several times cheaper than slicing the np.memmap subclass.
        plain = self.__dict__.get("_plain_data")
        if plain is None:
            plain = self.__dict__["_plain_data"] = self.data.view(np.ndarray)
        return plain

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
        plain = self._plain()
        dt = np.dtype(dtype)
        offset, count = int(offset), int(count)
        end = offset + dt.itemsize * count
        if count < 0 or end > plain.shape[0]:
            raise _Corrupt(f"truncated or corrupt: {dt.itemsize * count} bytes at offset {offset} go past the end "
                           f"of the file ({plain.shape[0]} bytes)")
        arr = plain[offset:end].view(dt)
        order = self.byte_order if override_order is None else override_order
        ordered: np.ndarray = arr.view(arr.dtype.newbyteorder(order))
        return ordered

    def _get_str(self, offset: int) -> tuple[np.ndarray, np.ndarray]:
        slen = self._get(offset, np.uint64)
        n = int(slen[0])
        room = self._plain().shape[0] - offset - 8
        if n > min(room, MAX_STRING_LEN):
            limit = f"only {max(room, 0)} remain in the file" if n > room else f"the limit is {MAX_STRING_LEN}"
            raise _Corrupt(f"a string at offset {offset} claims {n} bytes, but {limit}")
        return slen, self._get(offset + 8, np.uint8, n)

    def _get_field_parts(self, orig_offs: int,
                         raw_type: int) -> tuple[int, list[np.ndarray], list[int], list[GGUFValueType]]:
        if raw_type != GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        itype, n, start = int(raw_itype[0]), int(alen[0]), orig_offs + 12
        if n > MAX_ARRAY_LEN:
            raise _Corrupt(f"an array at offset {orig_offs} claims {n} elements (the limit is {MAX_ARRAY_LEN})")
        scalar = self.gguf_scalar_to_np.get(itype)  # type: ignore[call-overload]
        if scalar is not None:
            values = self._get(start, scalar, n)
            return 12 + int(values.nbytes), [raw_itype, alen, values], [2], [GGUFValueType.ARRAY, GGUFValueType(itype)]
        if itype == GGUFValueType.STRING:
            parts = [raw_itype, alen]
            off = start
            plain = self._plain()
            size = plain.shape[0]
            unpack = struct.Struct("<Q").unpack_from  # big-endian files are refused before reading
            for _ in range(n):
                if off + 8 > size:
                    raise _Corrupt(f"truncated or corrupt: a string array at offset {orig_offs} runs past the end "
                                   "of the file")
                (length,) = unpack(plain, off)  # type: ignore[arg-type]  # an ndarray is a buffer; numpy's stubs omit it
                off += 8
                if length > size - off:
                    raise _Corrupt(f"a string at offset {off - 8} claims {length} bytes, but only {size - off} remain "
                                   "in the file")
                parts.append(plain[off:off + length])
                off += length
            return off - orig_offs, parts, list(range(2, 2 + n)), [GGUFValueType.ARRAY, GGUFValueType.STRING]
        if itype == GGUFValueType.ARRAY:
            raise _Corrupt(f"nested arrays (at offset {orig_offs}) are not supported")
        raise _Corrupt(f"unknown value type {itype} in an array at offset {orig_offs}")


def _check_header(path: Path) -> None:
    """The fixed 24-byte header: magic, version, and counts the file size can hold (each tensor info
    takes at least 24 bytes, each key/value 13), before any loop runs over them."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(24)
    if len(head) < 4 or head[:4] != GGUF_MAGIC:
        raise GGUFError(f"{path}: not a GGUF file (magic {head[:4]!r}, expected {GGUF_MAGIC!r})")
    if len(head) < 24:
        raise GGUFError(f"{path}: truncated GGUF file ({size} bytes, the header alone takes 24)")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", head, 4)
    if version & 0xFFFF == 0 and version:
        raise GGUFError(f"{path}: big-endian GGUF files are not supported")
    if version not in GGUF_VERSIONS:
        raise GGUFError(f"{path}: GGUF version {version} is not supported (supported: {GGUF_VERSIONS})")
    room = size - 24
    if n_tensors > room // 24 or n_kv > room // 13 or n_tensors * 24 + n_kv * 13 > room:
        raise GGUFError(f"{path}: corrupt GGUF header: {n_tensors} tensors and {n_kv} metadata entries "
                        f"cannot fit in a {size}-byte file")


def _type_name(raw: int) -> str:
    try:
        return QType(raw).name
    except ValueError:
        return f"unknown type {raw}"


def _check_tensors(path: Path, reader: GGUFReader, size: int, *, types: bool) -> None:
    """Shapes and data ranges within bounds, each aligned and none overlapping another (llama.cpp
    refuses such files too; two tensors reading the same bytes would load silently wrong); with
    `types`, only tensor types that MLX loads."""
    unsupported: list[str] = []
    ranges: list[tuple[int, int, str]] = []
    alignment = int(getattr(reader, "alignment", 32))
    for t in reader.tensors:
        if not t.name or not t.name.isprintable():
            raise GGUFError(f"{path}: a tensor has an invalid name {t.name!r}")
        dims = [int(d) for d in t.shape]
        if not 1 <= len(dims) <= MAX_DIMS or any(d < 0 or d > _MAX_DIM for d in dims):
            raise GGUFError(f"{path}: tensor {t.name!r} has an invalid shape {dims}")
        block, type_size = GGML_QUANT_SIZES.get(t.tensor_type, (1, 1))
        if dims[0] % block:
            raise GGUFError(f"{path}: tensor {t.name!r} ({t.tensor_type.name}) has {dims[0]} columns, "
                            f"not a multiple of its block size {block}")
        nbytes = math.prod(dims) // block * type_size
        # The offset as the file stores it, in Python ints: the reader adds it to the data section's
        # start in uint64, which wraps, so an offset near 2^64 would point back into the metadata.
        relative = int(t.field.parts[-1][0])
        start = int(reader.data_offset) + relative
        if start + nbytes > size or start != int(t.data_offset):
            raise GGUFError(f"{path}: truncated or corrupt: tensor {t.name!r} needs bytes {start} to "
                            f"{start + nbytes}, the file has {size}")
        if relative % alignment:
            raise GGUFError(f"{path}: corrupt: tensor {t.name!r} starts at offset {relative} of the data, not a "
                            f"multiple of the file's alignment {alignment}")
        ranges.append((start, start + nbytes, t.name))
        if types and t.tensor_type not in SUPPORTED_TYPES:
            unsupported.append(f"{t.name} ({t.tensor_type.name})")
    ranges.sort()
    for (_, end, first), (start, _, second) in itertools.pairwise(ranges):
        if start < end:
            raise GGUFError(f"{path}: corrupt: the data of tensors {first!r} and {second!r} overlap")
    if unsupported:
        raise GGUFError(
            f"{path}: {len(unsupported)} tensor{'s have types' if len(unsupported) > 1 else ' has a type'} pymlxc "
            f"cannot load: {', '.join(unsupported[:8])}{' ...' if len(unsupported) > 8 else ''}; supported: "
            f"{', '.join(t.name for t in SUPPORTED_TYPES)}; {_RECIPES}")


def read_gguf(path: str | os.PathLike[str], *, check_types: bool = True) -> GGUFReader:
    """A validated reader of the GGUF file at `path` (metadata and tensor infos; tensor data stays
    memory-mapped). Raises GGUFError naming the file for anything malformed or, with `check_types`,
    for tensor types MLX cannot load."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"GGUF file not found: {p}")
    _check_header(p)
    try:
        with np.errstate(over="ignore"):  # a tensor offset that wraps in uint64: `_check_tensors` refuses it
            reader = _CheckedReader(p)
    except _Corrupt as exc:
        raise GGUFError(f"{p}: {exc}") from None
    except (ValueError, KeyError, IndexError, OverflowError, TypeError, UnicodeDecodeError) as exc:
        # The reader's own complaints: an unknown value or tensor type, duplicate names, bad alignment.
        raise GGUFError(f"{p}: malformed GGUF file: {exc}") from exc
    if reader.byte_order != "I":
        raise GGUFError(f"{p}: GGUF files of the other byte order are not supported")
    _check_tensors(p, reader, p.stat().st_size, types=check_types)
    split = metadata(reader, "split.count")
    if split is not None and (isinstance(split, bool) or not isinstance(split, int)):
        raise GGUFError(f"{p}: split.count must be an integer, got {split!r}")
    if isinstance(split, int) and split > 1:
        raise GGUFError(f"{p}: part of a {split}-file split GGUF; merge it first (llama-gguf-split --merge)")
    return reader


# ---------------------------------------------------------------------- loading

@contextlib.contextmanager
def naming(path: Path) -> Iterator[None]:
    """Prefix the file name to GGUFErrors raised inside that do not name it yet."""
    try:
        yield
    except GGUFError as exc:
        if str(exc).startswith(str(path)):
            raise
        raise GGUFError(f"{path}: {exc}") from exc.__cause__
    except TensorError as exc:
        raise GGUFError(f"{path}: {exc}") from None


def _model_config(reader: GGUFReader) -> dict[str, Any]:
    config = gguf_config(reader)
    bits = {QUANT_BITS[t.tensor_type] for t in reader.tensors if t.tensor_type in QUANT_BITS}
    if bits:  # the report's default; each layer's own bits come from its tensors
        dominant, _ = quantization_of(reader)
        config["quantization"] = {"group_size": QUANT_GROUP, "bits": dominant or max(bits), "mode": "affine"}
    return config


@dataclass
class GGUFCheckpoint:
    """What `loader.build_model` needs from a GGUF file: the HF-style config, the tensors under HF
    names, `blocks`: the layers kept as llama.cpp's blocks (module path -> type, for
    `gguf_layers.use_block_layers`; empty where there are none), the dtype the model computes in, and
    each HF tensor name's name in the file."""

    file: Path
    config: dict[str, Any]
    arrays: dict[str, Any]
    blocks: dict[str, Any]
    dtype: Any
    names: dict[str, str] = field(default_factory=dict)


def half_precision_is_fast() -> bool:
    """Whether the default device computes float16 at speed (a GPU; MLX's CPU does it element by
    element): where it does not, quantized files compute in float32 by default."""
    return mx.default_device().type == "gpu"


def read_gguf_checkpoint(path: str | os.PathLike[str], reader: GGUFReader | None = None, *,
                         dtype: Any = None) -> GGUFCheckpoint:
    """The config and tensors of the GGUF file at `path`: layers of repacked types quantized
    (`QuantizedLinear`, group 32), Q2_K/Q3_K/Q6_K layers as block layers, the others dense; float
    tensors in the compute dtype (`gguf_tensors.compute_dtype`: `dtype` where given, an MLX dtype)."""
    file = Path(path)
    reader = reader if reader is not None else read_gguf(file)
    with naming(file):
        config = _model_config(reader)
        arch = architecture(reader)
        compute = compute_dtype(reader, arch, dtype, fast_half=half_precision_is_fast())
        weights = read_tensors(reader, arch, config, compute, explicit=dtype is not None)
    if weights.quantization:  # each repacked layer's own bits, as mlx-lm records a mixed recipe
        config["quantization"].update(weights.quantization)
    return GGUFCheckpoint(file, config, weights.arrays, dict(weights.block_layers), compute, weights.names)


# ---------------------------------------------------------------------- description

def quantization_of(reader: GGUFReader) -> tuple[int, int]:
    """(bits, group size) of the dominant quantized type, by number of weights; (0, 0) when the
    weights are mostly float. K-quants report their nominal bits and block size."""
    counts: dict[QType, int] = {}
    for t in reader.tensors:
        if len(t.shape) >= 2:
            counts[t.tensor_type] = counts.get(t.tensor_type, 0) + int(t.n_elements)
    if not counts:
        return 0, 0
    dominant = max(counts, key=lambda k: counts[k])
    if dominant not in GGML_QUANT_SIZES or GGML_QUANT_SIZES[dominant][0] == 1:  # F32, F16, BF16, F64, I8...
        return 0, 0
    return _nominal_bits(dominant), GGML_QUANT_SIZES[dominant][0]


def _nominal_bits(t: QType) -> int:
    if t in QUANT_BITS:
        return QUANT_BITS[t]
    digits = [c for c in t.name.split("_")[0] if c.isdigit()]
    return int(digits[0]) if digits else 0


def describe_gguf(path: str | os.PathLike[str]) -> tuple[str | None, int, int]:
    """(model_type, quant_bits, quant_group) for `discover`. Structure is checked, tensor types are
    not (an unsupported type is reported, not refused). A directory means its single GGUF file."""
    p = Path(path)
    file = find_gguf(p) if p.is_dir() else p
    if file is None:
        raise GGUFError(f"no GGUF model in {p}")
    reader = read_gguf(file, check_types=False)
    with naming(file):
        arch = architecture(reader)
    bits, group = quantization_of(reader)
    return (model_type_of(arch) if arch in ARCHITECTURES else arch), bits, group


__all__ = ["GGUFError", "ARCHITECTURES", "SUPPORTED_TYPES", "find_gguf", "read_gguf", "metadata", "gguf_config",
           "GGUFCheckpoint", "read_gguf_checkpoint", "naming", "hf_name", "llama3_rope_scaling",
           "quantization_of", "describe_gguf"]

"""Safetensors files from a user's disk, checked before MLX's reader opens them.

MLX's reader takes headers it cannot hold: it keeps the low 32 bits of a dimension ([2**32 + 64]
loads as (64,)), reads a bool as a size, computes byte counts in 64 bits (which wrap), lets tensors
share bytes. So the header is read here (a bounded read of a regular file, opened without
blocking) and checked (`check_header`) first; after MLX has read the file, the shapes it made are
compared with the checked header's (`check_loaded`), which catches a file replaced in between.

Each reader passes its own error class and a name for the file (`what`): a model's weights
raise the backend's `WeightsFileError`, an adapter `AdapterError`, and so on. `checked_load` is
the whole sequence for a reader of one file.
"""
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

from .files import UnsafeFileError, check_regular_file

HEADER_LIMIT = 100_000_000  # the safetensors format's own bound on the JSON header
MAX_DIM = 2**31 - 1  # MLX shapes are int32: its reader keeps only the low 32 bits of a larger dimension
# The dtypes MLX's safetensors reader takes, and their sizes in bytes (the F8 ones load as uint8).
DTYPE_SIZES: dict[str, int] = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E8M0": 1, "U16": 2, "I16": 2,
                               "F16": 2, "BF16": 2, "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "C64": 8}

_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)

# Values from a hostile header are shown cut short: a shape of a million entries is no message.
brief = reprlib.Repr()
brief.maxstring = 60
brief.maxother = 60
brief.maxlist = brief.maxtuple = 8


class _DuplicateKey(ValueError):
    pass


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object of `pairs`, refused when a key repeats: which entry a reader keeps is its own
    choice, so the checked one need not be the one MLX reads."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def read_header(f: Path, *, what: str, error: type[Exception]) -> tuple[Any, int]:
    """The parsed JSON header of the safetensors file `f` and the size of its data section; only
    the header's bytes are read (the data is left to MLX's lazy reader). Anything there but a
    regular file raises `FileNotFoundError` or `pymlxc.files.UnsafeFileError` (`OSError`s), a
    header that is no safetensors header `error`; each message names `what` and `f`."""
    check_regular_file(f, what=what)  # MLX opens it by name: no FIFO, no device
    # O_NONBLOCK: a FIFO swapped in after the check cannot block the open either.
    with os.fdopen(os.open(f, _OPEN_FLAGS), "rb") as fh:
        st = os.fstat(fh.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise error(f"{what} {f} is no longer a regular file")
        prefix = fh.read(8)
        n = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else 0
        if not 2 <= n <= min(HEADER_LIMIT, st.st_size - 8):
            raise error(f"{what} {f}: not a safetensors file: header length {n} is not within "
                        f"2..{HEADER_LIMIT} and the file's {st.st_size} bytes")
        raw = fh.read(n)
    if len(raw) < n:
        raise error(f"{what} {f} was cut short while its header was read")
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys)
    except _DuplicateKey as exc:
        raise error(f"{what} {f}: header names {brief.repr(exc.args[0])} twice") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # ValueError: JSON, or an int of 4300+ digits
        raise error(f"{what} {f}: header is not valid JSON: {exc}") from None
    return header, st.st_size - 8 - n


def check_header(f: Path, header: Any, data_size: int, *, what: str, error: type[Exception]) -> None:
    """Refuse (`error`) a safetensors header MLX would read wrong or not at all: an unknown dtype, a
    shape that is not a list of non-negative int32 values, data_offsets that do not hold exactly
    the shape's bytes within the data section (`data_size` bytes), tensors that share bytes, and
    `__metadata__` that is not an object of strings."""
    if not isinstance(header, dict):
        raise error(f"{what} {f}: header is not a JSON object but {type(header).__name__}")
    spans: list[tuple[int, int, str]] = []
    for name, entry in header.items():
        if name == "__metadata__":  # optional: null as the safetensors format reads it (MLX writes it)
            strings = isinstance(entry, dict) and all(isinstance(v, str) for v in entry.values())
            if entry is not None and not strings:
                raise error(f"{what} {f}: __metadata__: expected an object of strings, got {brief.repr(entry)}")
            continue
        where = f"tensor {name!r} in {f} has"
        if not isinstance(entry, dict):
            raise error(f"{where} a header entry {brief.repr(entry)}, not an object with dtype, shape and "
                        "data_offsets")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
            raise error(f"{where} dtype {brief.repr(dtype)}, which MLX cannot read (it reads "
                        f"{', '.join(DTYPE_SIZES)})")
        # type() is int: JSON true is a bool, which is an int to isinstance
        if not isinstance(shape, list) or not all(type(d) is int for d in shape):
            raise error(f"{where} shape {brief.repr(shape)}, not a list of integers")
        if any(d < 0 for d in shape):  # MLX's reader takes [-2, -2] for 4 values
            raise error(f"{where} a negative dimension: shape {brief.repr(tuple(shape))}")
        if any(d > MAX_DIM for d in shape):
            raise error(f"{where} a dimension over {MAX_DIM}, the most an MLX shape holds: shape "
                        f"{brief.repr(tuple(shape))}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
            raise error(f"{where} data_offsets {brief.repr(offsets)}, not [begin, end] integers")
        begin, end = offsets
        if not 0 <= begin <= end <= data_size:
            raise error(f"{where} data_offsets [{begin}, {end}] outside the file's data section of "
                        f"{data_size} bytes")
        need = math.prod(shape) * DTYPE_SIZES[dtype]  # exact: MLX's 64-bit product of [2**30] * 4 wraps to 0
        if end - begin != need:
            raise error(f"{where} data_offsets [{begin}, {end}], {end - begin} bytes, but shape "
                        f"{brief.repr(tuple(shape))} of {dtype} takes {need}")
        if need:
            spans.append((begin, end, name))
    spans.sort()
    for (b0, e0, n0), (b1, e1, n1) in itertools.pairwise(spans):
        if b1 < e0:  # sorted: the first overlap, if any, is between neighbours
            raise error(f"tensor {n1!r} in {f} has data_offsets [{b1}, {e1}], which overlap those of "
                        f"tensor {n0!r}, [{b0}, {e0}]")


def check_loaded(f: Path, header: Mapping[str, Any], arrays: Mapping[str, Array], *, error: type[Exception]) -> None:
    """The tensors MLX read from `f` are those of its checked `header`, each of its shape: the file
    may have been replaced between the check and MLX's read."""
    for k, v in arrays.items():
        if k == "__metadata__" or k not in header or list(v.shape) != header[k]["shape"]:
            raise error(f"tensor {k!r} in {f}: MLX read shape {tuple(v.shape)}, not the checked header's "
                        "(did the file change?)")
    missing = [k for k in header if k != "__metadata__" and k not in arrays]
    if missing:
        raise error(f"tensor {missing[0]!r} in {f}: in the checked header but not read by MLX (did the file "
                    "change?)")


def checked_load(path: str | os.PathLike[str], error: type[Exception],
                 what: str) -> tuple[dict[str, Array], dict[str, str]]:
    """(tensors, metadata) of the safetensors file at `path` (tensors lazy, as
    `pymlxc.core.load_safetensors` gives them), its header checked first (`check_header`) and
    MLX's result after (`check_loaded`). Every failure raises `error` naming the file (`what`
    and `path`) and, where one is at fault, the tensor: a FIFO, device or directory there, no
    file at all, a bad header, MLX's own refusal."""
    f = Path(path)
    try:
        header, data_size = read_header(f, what=what, error=error)
    except (FileNotFoundError, UnsafeFileError) as exc:  # their messages name `what` and the file
        raise error(str(exc)) from exc
    except OSError as exc:  # e.g. permission denied
        raise error(f"cannot read {what} {f}: {exc.strerror or exc}") from exc
    check_header(f, header, data_size, what=what, error=error)
    try:
        arrays, metadata = mx.load_safetensors(f)
    except (MLXError, OSError) as exc:  # OSError: the path changed into a FIFO or vanished since
        raise error(f"cannot read {what} {f}: {exc}") from exc
    check_loaded(f, header, arrays, error=error)
    return arrays, metadata


__all__ = ["HEADER_LIMIT", "MAX_DIM", "DTYPE_SIZES", "brief", "read_header", "check_header", "check_loaded",
           "checked_load"]

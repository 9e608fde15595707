"""Safetensors files written byte by byte, for the tests of the readers of a user's files: headers
MLX's reader would take wrong (a dimension past int32 kept as its low 32 bits, a negative one,
tensors sharing bytes) or fail on obscurely (a header length past the file's end)."""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from hypothesis import strategies as st

F32 = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}
DATA = bytes(64)


def write_safetensors(file: Path, header: Any, data: bytes = DATA, *, length: int | None = None,
                      raw: bytes | None = None) -> Path:
    """A safetensors file of `header` (any JSON value; or its bytes as `raw`) and `data`; `length`
    overrides the header length the file declares."""
    text = json.dumps(header).encode() if raw is None else raw
    file.write_bytes(struct.pack("<Q", len(text) if length is None else length) + text + data)
    return file


# (id, header, raw header bytes or None, declared length or None, the tensor named or None, what the
# message says after "tensor '<name>' in <file> has" or after "<what> <file>: ").
CASES: list[tuple[str, Any, bytes | None, int | None, str | None, str]] = [
    # MLX kept the low 32 bits: [2**32 + 4] of 4 floats loaded as (4,)
    ("dim-past-int32", {"t": {"dtype": "F32", "shape": [2**32 + 4], "data_offsets": [0, 16]}}, None, None, "t",
     "a dimension over 2147483647, the most an MLX shape holds: shape (4294967300,)"),
    ("negative-dim", {"t": {"dtype": "F32", "shape": [-2, -2], "data_offsets": [0, 16]}}, None, None, "t",
     "a negative dimension: shape (-2, -2)"),
    ("bool-dim", {"t": {**F32, "shape": [True, 4]}}, None, None, "t", "shape [True, 4], not a list of integers"),
    ("overlap", {"a": F32, "b": {**F32, "data_offsets": [8, 24]}}, None, None, "b",
     "data_offsets [8, 24], which overlap those of tensor 'a', [0, 16]"),
    ("past-data", {"t": {**F32, "data_offsets": [56, 72]}}, None, None, "t",
     "data_offsets [56, 72] outside the file's data section of 64 bytes"),
    # 2**30 * 2**30 * 2**30 * 16 * 4 bytes wraps to 0 in MLX's 64 bits
    ("wrapping-size", {"t": {"dtype": "F32", "shape": [2**30, 2**30, 2**30, 16], "data_offsets": [0, 0]}}, None,
     None, "t", "data_offsets [0, 0], 0 bytes, but shape (1073741824, 1073741824, 1073741824, 16) of F32 takes "),
    ("unknown-dtype", {"t": {"dtype": "F4", "shape": [4], "data_offsets": [0, 2]}}, None, None, "t",
     "dtype 'F4', which MLX cannot read"),
    ("header-past-end", {"t": F32}, None, 1000, None,
     "not a safetensors file: header length 1000 is not within 2..100000000 and the file's 137 bytes"),
    ("not-json", None, b"{'t': 1}", None, None, "header is not valid JSON"),
    ("duplicate-name", None, b'{"t": ' + json.dumps(F32).encode() + b', "t": '
     + json.dumps({**F32, "data_offsets": [16, 32]}).encode() + b"}", None, None, "header names 't' twice"),
]
CASE_IDS = [c[0] for c in CASES]


def write_case(file: Path, case: str, what: str) -> str:
    """Write the file of the case named `case` at `file`; return how a reader's message must begin
    that names the file `what`: "<what> <file>: <detail>", or "tensor '<name>' in <file> has <detail>"
    where one tensor is at fault."""
    _, header, raw, length, tensor, detail = CASES[CASE_IDS.index(case)]
    write_safetensors(file, header, length=length, raw=raw)
    return f"tensor {tensor!r} in {file} has {detail}" if tensor else f"{what} {file}: {detail}"


# Dimensions that MLX's reader, keeping the low 32 bits, took as 0..4.
WRAPPING_DIMS = st.builds(lambda d, k: d + k * 2**32, st.integers(0, 4), st.integers(-1, 2))
# Dimensions MLX cannot hold among ones it can: MLX reads each as int32 and multiplies in 64 bits.
DIMS = st.one_of(st.integers(0, 4), st.integers(-3, 2**33), st.sampled_from([2**31 - 1, 2**31, 2**32 + 4, 2**63]),
                 st.booleans(), WRAPPING_DIMS)


def bytes_as_mlx_counts(shape: list[Any], itemsize: int = 4) -> int:
    """The bytes MLX's reader expects for `shape`: each dimension cut to int32, the product to 64
    bits; data_offsets of this size got a header past it, whatever the shape said."""
    count = 1
    for d in shape:
        count = count * ((int(d) + 2**31) % 2**32 - 2**31) % 2**64
    return count * itemsize % 2**64


def widen_first_dim(file: Path, name: str) -> tuple[int, ...]:
    """Rewrite the header of the safetensors file `file` so that tensor `name`'s first dimension is
    2**32 larger, its bytes unchanged: MLX's reader, keeping the low 32 bits, used to load it as
    before. Returns the shape the header now declares."""
    data = file.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    header[name]["shape"][0] += 2**32
    write_safetensors(file, header, data[8 + n:])
    return tuple(header[name]["shape"])

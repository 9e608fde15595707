"""Read one rank's part of a checkpoint: each sharded tensor only in the rows or columns this rank
keeps, so that loading a model split over N ranks costs each about 1/N of the sharded weights.

The model is split before its weights go in (`shard_before_load`), so every parameter already has
its per-rank shape; `narrow_weights` then gives each parameter the part of its checkpoint tensor
that matches: the one axis whose length differs is cut in `size` equal parts and rank r takes the
r-th (of each section where the split named the axis's sections, `tensor.Layouts`). A tensor
that the model's `sanitize` passed through unchanged is read from its safetensors file at the
part's byte ranges only (`read_part`); one that sanitize computed (experts stacked from per-expert
tensors, say) is cut from MLX's lazy result, which reads that tensor whole once.

safetensors' own numpy reader (`safe_open(...).get_slice`) refuses bfloat16, the dtype of most
checkpoints, so the part is read through `numpy.memmap` at the offsets the file's header gives:
only the pages holding the part are read.
"""
from __future__ import annotations

import json
import struct
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

import pymlxc.core as mx
from pymlxc.core import Array

from .errors import ShardingError
from .tensor import Layouts, part, section_parts

# safetensors dtype -> (numpy dtype of the same width, MLX dtype to view it as)
_DTYPES: dict[str, tuple[type, mx.Dtype]] = {
    "BOOL": (np.bool_, mx.bool_), "U8": (np.uint8, mx.uint8), "I8": (np.int8, mx.int8),
    "U16": (np.uint16, mx.uint16), "I16": (np.int16, mx.int16), "F16": (np.float16, mx.float16),
    "BF16": (np.uint16, mx.bfloat16), "U32": (np.uint32, mx.uint32), "I32": (np.int32, mx.int32),
    "F32": (np.float32, mx.float32), "U64": (np.uint64, mx.uint64), "I64": (np.int64, mx.int64),
}
_MAX_HEADER = 100 << 20  # the format's own bound on the JSON header


class Source:
    """Where a checkpoint tensor lives: file and name. The loader records one for each tensor it
    hands to the model's sanitize (`Sources`), holding the Array so that its identity stays its own."""

    __slots__ = ("array", "file", "name")

    def __init__(self, array: Array, file: Path, name: str) -> None:
        self.array, self.file, self.name = array, file, name


Sources = dict[int, Source]  # id(Array) -> where it was read from


_headers: dict[Path, tuple[int, dict[str, Any]]] = {}


def _header(file: Path) -> tuple[int, dict[str, Any]]:
    """(offset of the data, the header's tensor entries) of a safetensors file, read once."""
    cached = _headers.get(file)
    if cached is None:
        with open(file, "rb") as fh:
            raw = fh.read(8)
            if len(raw) != 8:
                raise ShardingError(f"{file}: not a safetensors file (shorter than its 8-byte header length)")
            (n,) = struct.unpack("<Q", raw)
            if n > _MAX_HEADER:
                raise ShardingError(f"{file}: safetensors header length {n} is past the format's bound")
            try:
                entries = json.loads(fh.read(n))
            except ValueError as exc:
                raise ShardingError(f"{file}: the safetensors header is not JSON: {exc}") from exc
        entries.pop("__metadata__", None)
        cached = _headers[file] = (8 + n, entries)
    return cached


def read_part(source: Source, axis: int, rank: int, size: int, sections: tuple[int, ...] | None = None) -> Array:
    """The rank-th of `size` equal parts along `axis` of the tensor at `source` (of each of
    `sections`, joined), read alone."""
    start, entries = _header(source.file)
    entry = entries.get(source.name)
    if not isinstance(entry, dict):
        raise ShardingError(f"{source.file}: no tensor {source.name!r} in the header")
    dtype = _DTYPES.get(str(entry.get("dtype")))
    if dtype is None:
        raise ShardingError(f"{source.file}: tensor {source.name!r} has dtype {entry.get('dtype')!r}, which "
                            f"cannot be read in parts (known: {', '.join(_DTYPES)})")
    shape = tuple(int(d) for d in entry["shape"])
    begin, end = (int(o) for o in entry["data_offsets"])
    np_type, mx_type = dtype
    if end - begin != int(np.prod(shape, dtype=np.int64)) * np.dtype(np_type).itemsize:
        raise ShardingError(f"{source.file}: tensor {source.name!r}: its byte range does not hold shape {shape}")
    axis %= len(shape)
    data = np.memmap(source.file, dtype=np_type, mode="r", offset=start + begin, shape=shape)
    try:
        pieces = []
        for lo, hi in section_parts(shape[axis], rank, size, sections):
            index = [slice(None)] * len(shape)
            index[axis] = slice(lo, hi)
            pieces.append(data[tuple(index)])
        part = np.ascontiguousarray(pieces[0]) if len(pieces) == 1 else np.concatenate(pieces, axis=axis)
    finally:
        del data, pieces  # unmapped now: the pages of other ranks' parts are not kept
    out = mx.array(part)
    return out if mx_type == out.dtype else mx.view(out, mx_type)


def split_axis(name: str, full: tuple[int, ...], mine: tuple[int, ...], size: int) -> int:
    """The axis along which a parameter of shape `mine` is this rank's 1/size of a checkpoint
    tensor of shape `full`; an error names the tensor when the shapes are not so related."""
    if len(full) != len(mine):
        raise ShardingError(f"tensor {name!r}: shape {full} in the checkpoint is not {size} parts of this rank's "
                            f"{mine} along one axis")
    diff = [i for i, (a, b) in enumerate(zip(full, mine, strict=True)) if a != b]
    if len(diff) != 1 or full[diff[0]] != mine[diff[0]] * size:
        raise ShardingError(f"tensor {name!r}: shape {full} in the checkpoint is not {size} parts of this rank's "
                            f"{mine} along one axis")
    return diff[0]


def narrow_weights(params: Mapping[str, Array], weights: dict[str, Array], sources: Sources,
                   rank: int, size: int, dropped: Callable[[str], bool],
                   layouts: Layouts | None = None) -> dict[str, Array]:
    """`weights` (parameter names -> checkpoint tensors, full) cut to this rank's parameters:
    tensors of parameters split by the model are read in part; those of blocks other ranks run
    (`dropped(name)`) are left out unread; every other one passes as it is (strict loading then
    names any tensor still missing or unexpected). `layouts`: the sections of split axes."""
    try:
        return _narrow(params, weights, sources, rank, size, dropped, layouts or {})
    finally:
        _headers.clear()  # read again by the next load: the files may have changed


def _narrow(params: Mapping[str, Array], weights: dict[str, Array], sources: Sources, rank: int, size: int,
            dropped: Callable[[str], bool], layouts: Layouts) -> dict[str, Array]:
    out: dict[str, Array] = {}
    for name, value in weights.items():
        want = params.get(name)
        if want is None:
            if not dropped(name):
                out[name] = value
            continue
        full, mine = tuple(value.shape), tuple(want.shape)
        if full == mine:
            out[name] = value
            continue
        axis = split_axis(name, full, mine, size)
        sections = layouts.get(name)
        source = sources.get(id(value))
        if source is not None and source.array is value:
            out[name] = read_part(source, axis, rank, size, sections)
        else:  # computed by sanitize: cut from the lazy result
            out[name] = part(value, axis, rank, size, sections)
    return out


__all__ = ["Source", "Sources", "narrow_weights", "read_part", "split_axis"]

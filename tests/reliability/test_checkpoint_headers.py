"""A safetensors header that MLX's reader would take wrong (a dimension past int32 truncated, a
bool as a dimension, offsets that overlap) or fail on with a message naming no field is refused
before MLX reads the file, with a WeightsFileError naming the file, the tensor and the field."""
from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pymlxc.core as mx
from pymlxc.backends.metal.formats.safetensors import HEADER_LIMIT, read_shards
from pymlxc.backends.metal.loader import WeightsFileError, load_weights_and_config
from pymlxc.safetensors_check import checked_load
from pymlxc.testing import write_tiny_model

from .hostile_safetensors import DIMS, F32, bytes_as_mlx_counts, write_safetensors


def _refused(file: Path) -> str:
    with pytest.raises(WeightsFileError) as info:
        read_shards([file])
    return str(info.value)


@pytest.fixture(scope="module")
def llama_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("src") / "llama", "llama")


@pytest.mark.parametrize("dim", [2**32 + 64, 2**63, 2**31])
def test_a_dimension_past_int32_is_refused(llama_source: Path, tmp_path: Path, dim: int) -> None:
    """MLX keeps a dimension's low 32 bits: model.norm.weight declared [2**32 + 64] (its 64 floats
    kept) used to load as (64,), a model that its header says is not this one."""
    path = Path(shutil.copytree(llama_source, tmp_path / "m"))
    file = path / "model.safetensors"
    data = file.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    assert header["model.norm.weight"]["shape"] == [64]
    header["model.norm.weight"]["shape"] = [dim]
    write_safetensors(file, header, data[8 + n:])
    with pytest.raises(WeightsFileError) as info:
        load_weights_and_config(path)
    assert str(info.value) == (f"tensor 'model.norm.weight' in {file} has a dimension over 2147483647, the most an "
                               f"MLX shape holds: shape ({dim},)")


def test_a_huge_dimension_of_no_bytes_is_refused(tmp_path: Path) -> None:
    """[2**63] of 0 bytes used to load as shape (0,)."""
    header = {"t": {"dtype": "F32", "shape": [2**63], "data_offsets": [0, 0]}}
    file = write_safetensors(tmp_path / "w.safetensors", header)
    assert "tensor 't' in" in _refused(file) and "shape (9223372036854775808,)" in _refused(file)


@pytest.mark.parametrize(("entry", "message"), [
    ({"dtype": "F4", "shape": [4], "data_offsets": [0, 2]}, "has dtype 'F4', which MLX cannot read (it reads BOOL"),
    ({"dtype": ["F32"], "shape": [4], "data_offsets": [0, 16]}, "has dtype ['F32'], which MLX cannot read"),
    ({"shape": [4], "data_offsets": [0, 16]}, "has dtype None, which MLX cannot read"),
    ({**F32, "shape": [True, 4]}, "has shape [True, 4], not a list of integers"),  # MLX read (1, 4)
    ({**F32, "shape": [4.0]}, "has shape [4.0], not a list of integers"),  # MLX read (4,)
    ({**F32, "shape": "4"}, "has shape '4', not a list of integers"),
    ({**F32, "shape": [-2, -2]}, "has a negative dimension: shape (-2, -2)"),
    # [2**30, 2**30, 2**30, 16] * 4 bytes wraps to 0 in 64 bits: MLX loaded it from 0 bytes
    ({"dtype": "F32", "shape": [2**30, 2**30, 2**30, 16], "data_offsets": [0, 0]},
     "has data_offsets [0, 0], 0 bytes, but shape (1073741824, 1073741824, 1073741824, 16) of F32 takes "
     "79228162514264337593543950336"),
    ({**F32, "data_offsets": [0, 12]}, "has data_offsets [0, 12], 12 bytes, but shape (2, 2) of F32 takes 16"),
    ({**F32, "data_offsets": [0, 16, 32]}, "has data_offsets [0, 16, 32], not [begin, end] integers"),
    ({**F32, "data_offsets": [False, 16]}, "has data_offsets [False, 16], not [begin, end] integers"),
    ({**F32, "data_offsets": [-16, 0]}, "has data_offsets [-16, 0] outside the file's data section of 64 bytes"),
    ({**F32, "data_offsets": [56, 72]}, "has data_offsets [56, 72] outside the file's data section of 64 bytes"),
    ([1, 2], "has a header entry [1, 2], not an object with dtype, shape and data_offsets"),
])
def test_a_bad_tensor_entry_names_the_tensor_and_field(tmp_path: Path, entry: Any, message: str) -> None:
    file = write_safetensors(tmp_path / "w.safetensors", {"ok": F32, "bad": entry})
    got = _refused(file)
    assert got.startswith(f"tensor 'bad' in {file} {message}"), got


def test_overlapping_tensors_are_refused(tmp_path: Path) -> None:
    """Two tensors sharing bytes used to load, each reading the other's data."""
    file = write_safetensors(tmp_path / "w.safetensors", {"a": F32, "b": {**F32, "data_offsets": [8, 24]},
                                               "empty": {"dtype": "F32", "shape": [0], "data_offsets": [4, 4]}})
    assert _refused(file) == (f"tensor 'b' in {file} has data_offsets [8, 24], which overlap those of tensor 'a', "
                              "[0, 16]")


@pytest.mark.parametrize("metadata", [{"format": 1}, ["pt"], "pt", {"a": None}])
def test_metadata_must_map_strings_to_strings(tmp_path: Path, metadata: Any) -> None:
    file = write_safetensors(tmp_path / "w.safetensors", {"__metadata__": metadata, "t": F32})
    assert _refused(file).startswith(f"weights file {file}: __metadata__: expected an object of strings, got")


@pytest.mark.parametrize(("content", "message"), [
    (struct.pack("<Q", 2**63) + b"{}", "header length 9223372036854775808 is not within"),
    (struct.pack("<Q", HEADER_LIMIT + 1) + b"{}", f"header length {HEADER_LIMIT + 1} is not within"),
    (struct.pack("<Q", 100) + b"{}", "header length 100 is not within 2..100000000 and the file's 10 bytes"),
    (b"\x02\x00\x00", "header length 0 is not within"),
    (struct.pack("<Q", 4) + b"[{}]", "header is not a JSON object but list"),
    (struct.pack("<Q", 4) + b"{\xff\xfe}", "header is not valid JSON"),
    (struct.pack("<Q", 2) + b"{ ", "header is not valid JSON"),
])
def test_a_bad_header_is_refused(tmp_path: Path, content: bytes, message: str) -> None:
    (tmp_path / "w.safetensors").write_bytes(content)
    assert message in _refused(tmp_path / "w.safetensors")


def test_a_valid_file_loads_as_its_header_says(tmp_path: Path) -> None:
    """What passes: scalars, empty tensors, gaps, the F8 types MLX reads as bytes, metadata."""
    header = {"__metadata__": {"format": "mlx"}, "s": {"dtype": "BF16", "shape": [], "data_offsets": [0, 2]},
              "e": {"dtype": "I64", "shape": [3, 0], "data_offsets": [2, 2]},
              "f8": {"dtype": "F8_E4M3", "shape": [2, 3], "data_offsets": [10, 16]},
              "t": {**F32, "data_offsets": [16, 32]}}
    weights, _ = read_shards([write_safetensors(tmp_path / "w.safetensors", header)])
    assert {k: v.shape for k, v in weights.items()} == {"s": (), "e": (3, 0), "f8": (2, 3), "t": (2, 2)}
    mx.eval(*weights.values())


_DTYPES = {"F32": 4, "F16": 2, "BF16": 2, "U8": 1, "I64": 8, "BOOL": 1, "F64": 8, "Q4": 1}


class _Refused(ValueError):
    """The error class `checked_load`'s test reader passes."""


def _read_shards(file: Path) -> dict[str, Any]:
    try:
        return read_shards([file])[0]
    except WeightsFileError as exc:
        raise _Refused(str(exc)) from exc


def _checked_load(file: Path) -> dict[str, Any]:
    return checked_load(file, _Refused, "test file")[0]


@pytest.mark.parametrize("read", [_read_shards, _checked_load], ids=["model-shards", "checked_load"])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(entries=st.lists(st.tuples(st.sampled_from(sorted(_DTYPES)), st.lists(DIMS, max_size=3), st.integers(-2, 70),
                                  st.one_of(st.none(), st.integers(-2, 70))), min_size=1, max_size=4),
       spare=st.integers(0, 16))
def test_whatever_loads_is_what_the_header_says(tmp_path: Path, read: Callable[[Path], dict[str, Any]],
                                                entries: list[tuple[str, list[Any], int, int | None]],
                                                spare: int) -> None:
    """Any header (its offsets often sized as MLX counts, so that MLX takes it), through the model
    shards' reader and the one of adapters, checkpoints and prompt caches: refused by the reader's
    error naming the file, or every tensor has its header's shape, holds exactly its data_offsets'
    bytes, and evaluates."""
    header = {f"t{i}": {"dtype": d, "shape": s,
                        "data_offsets": [b, b + (bytes_as_mlx_counts(s, _DTYPES[d]) if size is None else size)]}
              for i, (d, s, b, size) in enumerate(entries)}
    file = write_safetensors(tmp_path / "h.safetensors", header, bytes(64 + spare))
    try:
        weights = read(file)
    except _Refused as exc:
        assert str(file) in str(exc)
        return
    assert set(weights) == set(header)
    for name, v in weights.items():
        begin, end = header[name]["data_offsets"]
        shape = header[name]["shape"]
        assert v.shape == tuple(shape) and v.nbytes == end - begin, (name, header[name])
        assert all(type(d) is int for d in shape), (name, header[name])  # MLX took true as 1
    mx.eval(*weights.values())


def test_null_metadata_loads(tmp_path: Path) -> None:
    """`__metadata__: null`, as MLX's own writer leaves it, is no metadata."""
    header = {"__metadata__": None, "t": {**F32, "data_offsets": [0, 16]}}
    weights, _ = read_shards([write_safetensors(tmp_path / "w.safetensors", header)])
    assert weights["t"].shape == (2, 2)

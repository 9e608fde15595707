"""Hostile GGUF metadata and layouts that used to load silently wrong: keys of the wrong type read as
a default or as true, token types and scores no tokenizer has, tensors whose data overlap or are
misaligned, settings files beside the GGUF file read without a bound. Each is now a GGUFError (or,
where llama.cpp only warns, a warning) naming the file and the key or tensor. The byte-level fuzzing
of headers and truncations is in test_gguf.py."""
from __future__ import annotations

import os
import struct
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as VT

import pymlxc
from pymlxc.backends.metal.formats import gguf_tokenizer
from pymlxc.backends.metal.formats.gguf import GGUFError, read_gguf
from pymlxc.backends.metal.loader import load_gguf_model
from pymlxc.files import UnsafeFileError
from pymlxc.testing import write_tiny_model

from .gguf_export import export_gguf

DELETE = object()
Tensors = list[tuple[str, np.ndarray, list[int], Q]]


@pytest.fixture(autouse=True)
def _quiet() -> None:
    warnings.simplefilter("ignore", DeprecationWarning)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hostile")
    (root / "gguf").mkdir()
    return export_gguf(write_tiny_model(root / "llama", "llama", seed=5), root / "gguf" / "llama.gguf", Q.F32)


def _put(writer: gguf.GGUFWriter, key: str, value: Any) -> None:
    if isinstance(value, tuple):
        writer.add_key_value(key, value[0], value[1])
    elif isinstance(value, list):
        writer.add_array(key, value)
    elif isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_int32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    else:
        writer.add_string(key, value)


def rewrite(src: Path, out: Path, changes: dict[str, Any] | None = None,
            tensors: Callable[[Tensors], Tensors] | None = None) -> Path:
    """A copy of the GGUF file `src` with metadata `changes` (a value, (value, type) or DELETE) and
    its tensor list passed through `tensors`."""
    changes = dict(changes or {})
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(str(out), reader.fields["general.architecture"].contents())
    if "general.architecture" in changes:  # the writer sets it as a string: replace the value itself
        value, vtype = changes.pop("general.architecture")
        writer.kv_data[0]["general.architecture"] = gguf.GGUFValue(value, vtype)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if name in changes:
            value = changes.pop(name)
            if value is not DELETE:
                _put(writer, name, value)
        elif field.types[0] == VT.ARRAY:
            writer.add_array(name, field.contents())
        else:
            writer.add_key_value(name, field.contents(), field.types[0])
    for name, value in changes.items():
        _put(writer, name, value)
    listed: Tensors = [(t.name, np.asarray(t.data), [int(d) for d in reversed(t.shape)], t.tensor_type)
                       for t in reader.tensors]
    for name, data, shape, qtype in (tensors(listed) if tensors is not None else listed):
        writer.add_tensor(name, data, raw_shape=shape, raw_dtype=qtype)
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file,
                 writer.close):
        step()
    return out


def _n_tokens(path: Path) -> int:
    return len(gguf.GGUFReader(path).fields["tokenizer.ggml.tokens"].data)


# ---------------------------------------------------------------------- metadata of the wrong type

WRONG_TYPES = [
    # a list where one number is read: was ignored (the default used)
    ("llama.attention.layer_norm_rms_epsilon", [1e-5, 1e-5], "layer_norm_rms_epsilon must be a finite number"),
    ("llama.rope.freq_base", [10000.0], "rope.freq_base must be a finite number"),
    ("llama.rope.scaling.type", ["linear"], "rope.scaling.type must be a string"),
    ("llama.rope.scaling.type", 3, "rope.scaling.type must be a string"),
    # was never read: a vocabulary size the embedding does not have
    ("llama.vocab_size", 17, "llama.vocab_size is 17, but the token embedding token_embd.weight has 512 rows"),
    ("llama.vocab_size", "512", "llama.vocab_size is '512'"),
    # a split file's count as text: was loaded as a whole model
    ("split.count", "2", "split.count must be an integer"),
    # special token ids of the wrong type: were ignored (llama.cpp's defaults used)
    ("tokenizer.ggml.eos_token_id", "2", "tokenizer.ggml.eos_token_id must be a token id"),
    ("tokenizer.ggml.bos_token_id", 1.0, "tokenizer.ggml.bos_token_id must be a token id"),
    ("tokenizer.ggml.padding_token_id", [0], "tokenizer.ggml.padding_token_id must be a token id"),
    # flags as text or numbers: "false" was read as true
    ("tokenizer.ggml.add_bos_token", "false", "tokenizer.ggml.add_bos_token must be a boolean"),
    ("tokenizer.ggml.add_eos_token", 1, "tokenizer.ggml.add_eos_token must be a boolean"),
    # a template that is not text: was dropped
    ("tokenizer.chat_template", 5, "tokenizer.chat_template must be a string"),
    # was "the metadata key general.architecture is missing"
    ("general.architecture", (7, VT.UINT32), "general.architecture must be a string, got 7"),
]


@pytest.mark.parametrize("key,value,match", WRONG_TYPES, ids=[f"{k}={v!r}" for k, v, _ in WRONG_TYPES])
def test_metadata_of_the_wrong_type_is_refused_by_name(key: str, value: Any, match: str, llama: Path,
                                                       tmp_path: Path) -> None:
    path = rewrite(llama, tmp_path / "m.gguf", {key: value})
    with pytest.raises(GGUFError, match=match) as info:
        load_gguf_model(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("value", [99, -3, 7])
def test_token_types_out_of_range_are_refused(value: int, llama: Path, tmp_path: Path) -> None:
    """llama.cpp's token types are 0 to 6; another was read as a normal token."""
    n = _n_tokens(llama)
    path = rewrite(llama, tmp_path / "m.gguf", {"tokenizer.ggml.token_type": [1] * (n - 1) + [value]})
    with pytest.raises(GGUFError, match=rf"tokenizer\.ggml\.token_type of token {n - 1} \(.*\) is {value}, not a "
                                        r"token type \(0 to 6\)"):
        load_gguf_model(path)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_sentencepiece_scores_must_be_finite(bad: float, llama: Path, tmp_path: Path) -> None:
    """The merges are ranked by score: a NaN ordered them arbitrarily, silently."""
    n = _n_tokens(llama)
    scores = [float(-i) for i in range(n)]
    scores[7] = bad
    path = rewrite(llama, tmp_path / "m.gguf", {"tokenizer.ggml.model": "llama", "tokenizer.ggml.scores": scores,
                                                "tokenizer.ggml.merges": DELETE})
    with pytest.raises(GGUFError, match=r"tokenizer\.ggml\.scores of token 7 \(.*\) is (nan|inf), not a finite"):
        load_gguf_model(path)


def test_a_special_token_id_past_the_vocabulary_is_ignored_with_a_warning(llama: Path, tmp_path: Path) -> None:
    """As llama.cpp does ("bad special token", its default then used), but said."""
    path = rewrite(llama, tmp_path / "m.gguf", {"tokenizer.ggml.eot_token_id": 100000})
    with pytest.warns(UserWarning, match=r"tokenizer\.ggml\.eot_token_id is 100000, which names no token of the 512"):
        tokenizer, loaded = load_gguf_model(path)
    loaded.free()
    assert 100000 not in tokenizer.eos_token_ids


# ---------------------------------------------------------------------- tensors and layout

def _renamed(old: str, new: str) -> Callable[[Tensors], Tensors]:
    return lambda ts: [(n.replace(old, new), d, s, q) for n, d, s, q in ts]


def test_blocks_numbered_wrong_are_listed(llama: Path, tmp_path: Path) -> None:
    """Was: "block_count is 2 but the file has tensors for 2 blocks"."""
    path = rewrite(llama, tmp_path / "m.gguf", tensors=_renamed("blk.1.", "blk.5."))
    with pytest.raises(GGUFError, match=r"block_count is 2 but the file has tensors for 2 blocks \(numbered 0, 5; "
                                        r"expected 0 to 1\)"):
        pymlxc.load_model(str(path), backend="metal")


def test_a_token_embedding_of_three_dimensions_is_not_called_missing(llama: Path, tmp_path: Path) -> None:
    def three_d(ts: Tensors) -> Tensors:
        return [(n, d.reshape(2, -1, d.shape[-1]), [2, d.shape[0] // 2, d.shape[-1]], q)
                if n == "token_embd.weight" else (n, d, s, q) for n, d, s, q in ts]

    path = rewrite(llama, tmp_path / "m.gguf", tensors=three_d)
    with pytest.raises(GGUFError, match=r"token_embd\.weight has shape \(2, 256, 64\), not \[vocab, hidden\]"):
        pymlxc.load_model(str(path), backend="metal")


def _offset_position(reader: gguf.GGUFReader, index: int) -> int:
    t = reader.tensors[index]  # its info: name, n_dims, dims, type, then the offset
    return t.field.offset + 8 + len(t.name.encode()) + 4 + 8 * len(t.shape) + 4


@pytest.mark.parametrize("shift,match", [(None, "overlap"), (4, "not a multiple of the file's alignment 32"),
                                         (1, "not a multiple of the file's alignment 32")])
def test_overlapping_or_misaligned_tensor_data_is_refused(shift: int | None, match: str, llama: Path,
                                                          tmp_path: Path) -> None:
    """Two tensors reading the same bytes (or bytes shifted off their place) loaded silently;
    llama.cpp refuses both."""
    reader = gguf.GGUFReader(llama)
    data = bytearray(llama.read_bytes())
    first = struct.unpack_from("<Q", data, _offset_position(reader, 0))[0]
    second = struct.unpack_from("<Q", data, _offset_position(reader, 1))[0]
    struct.pack_into("<Q", data, _offset_position(reader, 1), first if shift is None else second + shift)
    path = tmp_path / "m.gguf"
    path.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match=match) as info:
        read_gguf(path)
    assert repr(reader.tensors[1].name) in str(info.value)


# ---------------------------------------------------------------------- files beside the GGUF file

def _beside(llama: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    os.link(llama, folder / "m.gguf")
    return folder / "m.gguf"


def test_a_huge_generation_config_beside_is_refused_unread(llama: Path, tmp_path: Path) -> None:
    """Was read whole (any size) before being parsed."""
    path = _beside(llama, tmp_path)
    with open(path.parent / "generation_config.json", "wb") as f:
        f.truncate(64 * 2**20 + 1)  # sparse: one byte over pymlxc.files.JSON_LIMIT
    with pytest.raises(UnsafeFileError, match=r"generation_config\.json is 67108865 bytes, more than"):
        load_gguf_model(path)


def test_a_tokenizer_json_beside_is_size_checked_before_it_is_read(llama: Path, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """`tokenizers` read it by name whatever its size."""
    path = _beside(llama, tmp_path)
    (path.parent / "tokenizer.json").write_text("{}" + " " * 2000)
    monkeypatch.setattr(gguf_tokenizer, "TOKENIZER_LIMIT", 1000)
    with pytest.raises(UnsafeFileError, match=r"tokenizer\.json is 2002 bytes, more than the 1000"):
        load_gguf_model(path)


def test_a_fifo_named_tokenizer_json_beside_is_refused_not_ignored(llama: Path, tmp_path: Path) -> None:
    path = _beside(llama, tmp_path)
    os.mkfifo(path.parent / "tokenizer.json")
    with pytest.raises(UnsafeFileError, match=r"tokenizer\.json is a FIFO"):
        load_gguf_model(path)


def test_one_part_of_a_split_file_is_refused(llama: Path, tmp_path: Path) -> None:
    """llama-gguf-split's first part (split.* keys as UINT16, the tensors of part 1 only) given alone."""
    part = rewrite(llama, tmp_path / "m-00001-of-00002.gguf",
                   {"split.no": (0, VT.UINT16), "split.count": (2, VT.UINT16), "split.tensors.count": (5, VT.INT32)},
                   tensors=lambda ts: ts[:5])
    with pytest.raises(GGUFError, match=r"m-00001-of-00002\.gguf: part of a 2-file split GGUF; merge it first"):
        pymlxc.load_model(str(part), backend="metal")


def test_a_missing_gguf_file_is_called_a_gguf_file(tmp_path: Path) -> None:
    """A path ending in .gguf where nothing is: "GGUF file not found", not "model directory not found"."""
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        pymlxc.load_model(str(tmp_path / "missing.gguf"), backend="metal")

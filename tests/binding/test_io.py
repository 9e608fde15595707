"""Files: safetensors round trips with metadata, .npy, and GGUF files written by the `gguf` package."""
from __future__ import annotations

import importlib
from pathlib import Path

import numpy as np
import pytest

import pymlxc.core as mx

from .strategies import bf16_round, to_np


def test_safetensors_round_trip_with_metadata(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    arrays = {
        "f32": mx.array(rng.standard_normal((3, 4)).astype(np.float32)),
        "f16": mx.array(rng.standard_normal((5,)).astype(np.float16)),
        "bf16": mx.astype(mx.array(bf16_round(rng.standard_normal((2, 2)).astype(np.float32))), mx.bfloat16),
        "i8": mx.array(np.arange(-4, 4, dtype=np.int8)),
        "u32": mx.array(np.arange(6, dtype=np.uint32).reshape(2, 3)),
        "bool": mx.array([True, False]),
        "scalar": mx.array(2.5),
        "view": mx.array(np.arange(12, dtype=np.float32).reshape(3, 4)).T[::2],  # strided: saved row-major
    }
    meta = {"format": "mlx", "note": "ünïcode ok", "n": "3"}
    path = tmp_path / "w.safetensors"
    mx.save_safetensors(path, arrays, meta)
    loaded, got_meta = mx.load_safetensors(path)
    assert got_meta == meta
    assert sorted(loaded) == sorted(arrays)
    for k, a in arrays.items():
        assert loaded[k].dtype is a.dtype and loaded[k].shape == a.shape, k
        np.testing.assert_array_equal(to_np(loaded[k]), to_np(a), err_msg=k)
    assert sorted(mx.load(path)) == sorted(arrays)
    assert mx.load(path, return_metadata=True)[1] == meta
    # and the file is what the safetensors package reads
    safetensors = importlib.import_module("safetensors")
    with safetensors.safe_open(str(path), framework="numpy") as f:
        assert f.metadata() == meta
        np.testing.assert_array_equal(f.get_tensor("u32"), to_np(arrays["u32"]))


def test_safetensors_written_elsewhere_loads(tmp_path: Path) -> None:
    safetensors_numpy = importlib.import_module("safetensors.numpy")
    path = tmp_path / "np.safetensors"
    x = np.arange(10, dtype=np.float32).reshape(2, 5)
    safetensors_numpy.save_file({"x": x, "y": x.astype(np.int64)}, str(path), metadata={"a": "b"})
    loaded, meta = mx.load_safetensors(path)
    assert meta == {"a": "b"}
    np.testing.assert_array_equal(to_np(loaded["x"]), x)
    assert loaded["y"].dtype is mx.int64


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        mx.load_safetensors(tmp_path / "missing.safetensors")
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a safetensors file")
    with pytest.raises(mx.MLXError, match=r"bad\.safetensors"):
        mx.load_safetensors(bad)
    with pytest.raises(ValueError, match="extension"):
        mx.load(tmp_path / "x.bin")
    assert (mx.ones((2,)) + 1).tolist() == [2.0, 2.0]


def test_npy(tmp_path: Path) -> None:
    x = np.arange(6, dtype=np.int16).reshape(3, 2)
    np.save(tmp_path / "x.npy", x)
    a = mx.load(tmp_path / "x.npy")
    assert a.dtype is mx.int16
    np.testing.assert_array_equal(to_np(a), x)


def test_gguf_written_by_the_gguf_package(tmp_path: Path) -> None:
    gguf = importlib.import_module("gguf")
    path = tmp_path / "tiny.gguf"
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    q = np.random.default_rng(0).standard_normal((2, 64)).astype(np.float32)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_string("general.name", "tiny")
    w.add_uint32("llama.block_count", 2)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_array("tokenizer.ggml.tokens", ["a", "b", "c"])
    w.add_array("tokenizer.ggml.scores", [0.5, 1.5, 2.5])
    w.add_tensor("t.weight", x)
    w.add_tensor("h.weight", x.astype(np.float16))
    w.add_tensor("q.weight", gguf.quants.quantize(q, gguf.GGMLQuantizationType.Q8_0),
                 raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    with mx.load_gguf(path) as f:
        assert sorted(f.keys()) == ["h.weight", "q.biases", "q.scales", "q.weight", "t.weight"]
        np.testing.assert_array_equal(to_np(f.tensor("t.weight")), x)
        assert f.tensor("h.weight").dtype is mx.float16
        np.testing.assert_array_equal(to_np(f.tensor("h.weight")), x.astype(np.float16))
        assert f.metadata("general.name") == "tiny"
        assert f.metadata("tokenizer.ggml.tokens") == ["a", "b", "c"]
        assert f.metadata("llama.block_count").item() == 2
        assert f.metadata("llama.rope.freq_base").item() == 10000.0
        assert f.metadata("tokenizer.ggml.scores").tolist() == [0.5, 1.5, 2.5]
        assert f.metadata("no.such.key") is None
        with pytest.raises(KeyError):
            f.tensor("no.such.tensor")
        # Q8_0 comes as MLX's affine 8-bit triple with groups of 32
        back = mx.dequantize(f.tensor("q.weight"), f.tensor("q.scales"), f.tensor("q.biases"), group_size=32, bits=8)
        np.testing.assert_allclose(to_np(back), q, atol=np.abs(q).max() / 100)
    with pytest.raises(mx.MLXError, match="after close"):
        f.keys()

"""`inspect_attention` on the metal backend: shapes, and layer 0's keys and queries against numpy
computed from the checkpoint by hand (embed -> RMSNorm -> projection -> RoPE)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

import pymlxc
from pymlxc.testing import write_tiny_model
from pymlxc.types import AttentionSnapshot

PROMPT = "Once upon a time there was a small town by the river, and in that town lived a baker"


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("inspect")
    return {
        "llama": write_tiny_model(root / "llama", "llama", seed=5),
        "gemma3": write_tiny_model(root / "gemma3", "gemma3_text", seed=5, extra_config={"sliding_window": 8}),
    }


def rope(x: np.ndarray, base: float) -> np.ndarray:
    """HF's rotate-half RoPE of x [L, heads, D] at positions 0..L-1."""
    L, _, d = x.shape
    inv_freq = 1.0 / base ** (np.arange(0, d, 2, dtype=np.float64) / d)
    angles = np.arange(L)[:, None] * inv_freq[None, :]
    cos = np.concatenate([np.cos(angles)] * 2, axis=-1)[:, None, :]
    sin = np.concatenate([np.sin(angles)] * 2, axis=-1)[:, None, :]
    half = d // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def by_hand(path: Path, ids: list[int], proj: str) -> np.ndarray:
    """Layer 0's `proj` ("k_proj" or "q_proj") output after RoPE, [heads, L, D], in float64."""
    config = json.loads((path / "config.json").read_text())
    w = {k: v.astype(np.float64) for k, v in load_file(str(path / "model.safetensors")).items()}
    x = w["model.embed_tokens.weight"][ids]
    x = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + config["rms_norm_eps"])
    x = x * w["model.layers.0.input_layernorm.weight"]
    y = x @ w[f"model.layers.0.self_attn.{proj}.weight"].T
    d = config["head_dim"]
    y = rope(y.reshape(len(ids), -1, d), config["rope_theta"])
    return y.transpose(1, 0, 2)


def test_keys_and_queries_of_layer_0_equal_numpy_by_hand(dirs) -> None:
    with pymlxc.load_model(str(dirs["llama"]), backend="metal") as m:
        ids = m.encode(PROMPT)
        snap = m.inspect_attention(PROMPT, include_queries=True)
        assert list(snap.token_ids) == ids
        for name, got in (("k_proj", snap.keys[0]), ("q_proj", snap.queries[0])):
            expected = by_hand(dirs["llama"], ids, name)
            assert len(got) == expected.shape[0]
            for head, arr in enumerate(got):
                assert arr.dtype == np.float32 and arr.shape == (len(ids), expected.shape[2])
                np.testing.assert_allclose(arr, expected[head], atol=1e-4, rtol=1e-4)
        # Token ids in, the same snapshot out; keys alone when queries are not asked for.
        again = m.inspect_attention(ids)
        assert again.queries is None
        assert all(np.array_equal(a, b) for a, b in zip(again.keys[1], snap.keys[1], strict=True))


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_shapes(dirs, arch: str) -> None:
    config = json.loads((dirs[arch] / "config.json").read_text())
    with pymlxc.load_model(str(dirs[arch]), backend="metal") as m:
        snap = m.inspect_attention(PROMPT, include_queries=True)
        n = len(m.encode(PROMPT))
        assert isinstance(snap, AttentionSnapshot)
        assert n > 8  # longer than gemma3's sliding window: its sliding layers still give every key
        assert (snap.architecture, snap.num_layers, snap.num_kv_heads, snap.num_query_heads, snap.seq_len,
                snap.head_dim) == (m.model_type, config["num_hidden_layers"], config["num_key_value_heads"],
                                   config["num_attention_heads"], n, config["head_dim"])
        assert [len(layer) for layer in snap.keys] == [snap.num_kv_heads] * snap.num_layers
        assert [len(layer) for layer in snap.queries] == [snap.num_query_heads] * snap.num_layers
        assert {a.shape for layer in snap.keys + snap.queries for a in layer} == {(n, snap.head_dim)}
        assert all(np.isfinite(a).all() for layer in snap.keys for a in layer)
        keys_only = m.inspect_attention(PROMPT)
        assert keys_only.queries is None and keys_only.num_query_heads == snap.num_query_heads
        with pytest.raises(ValueError):
            m.inspect_attention([])
        with pytest.raises(ValueError, match="vocabulary"):
            m.inspect_attention([10**6])

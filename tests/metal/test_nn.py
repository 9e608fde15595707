"""The module system: flat parameter names, freezing, loading with named errors, quantized layers
against their dense counterparts, and ModelArgs parsing."""
from __future__ import annotations

import numpy as np
import pytest

import pymlxc.core as mx
from pymlxc.backends.metal import nn
from pymlxc.backends.metal.models import gemma3, llama
from pymlxc.backends.metal.models.base import ConfigError


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 4, bias=True)
        self.norm = nn.RMSNorm(4)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.layers = [Block(), Block()]
        self._constant = mx.ones((3,))  # private: not a parameter


def test_parameters_children_and_modules() -> None:
    net = Net()
    assert sorted(net.parameters()) == sorted([
        "embed.weight", "layers.0.proj.weight", "layers.0.proj.bias", "layers.0.norm.weight",
        "layers.1.proj.weight", "layers.1.proj.bias", "layers.1.norm.weight"])
    assert [n for n, _ in net.children()] == ["embed", "layers.0", "layers.1"]
    assert [n for n, _ in net.named_modules()] == ["", "embed", "layers.0", "layers.0.proj", "layers.0.norm",
                                                  "layers.1", "layers.1.proj", "layers.1.norm"]


def test_freeze_by_local_and_flat_name() -> None:
    net = Net()
    net.freeze()
    assert net.trainable_parameters() == {}
    net.unfreeze("bias")
    assert sorted(net.trainable_parameters()) == ["layers.0.proj.bias", "layers.1.proj.bias"]
    net.unfreeze(["layers.1.norm.weight"])
    assert "layers.1.norm.weight" in net.trainable_parameters()
    net.layers[0].freeze(recurse=True)
    assert "layers.0.proj.bias" not in net.trainable_parameters()


def test_load_weights_errors_name_tensors() -> None:
    net = Net()
    good = {k: mx.zeros(v.shape) for k, v in net.parameters().items()}
    net.load_weights(good)
    missing = dict(good)
    del missing["layers.1.norm.weight"]
    with pytest.raises(nn.WeightsError, match=r"missing tensor in checkpoint: layers\.1\.norm\.weight"):
        net.load_weights(missing)
    with pytest.raises(nn.WeightsError, match=r"unexpected tensor in checkpoint: layers\.2\.norm\.weight"):
        net.load_weights({**good, "layers.2.norm.weight": mx.zeros((4,))})
    with pytest.raises(nn.WeightsError, match=r"'embed\.weight' has shape \(10, 7\).*expects \(10, 8\)"):
        net.load_weights({**good, "embed.weight": mx.zeros((10, 7))})
    net.update({"layers.0.proj.bias": mx.ones((4,)), "nowhere.weight": mx.ones((1,))})  # not strict
    assert np.asarray(net.layers[0].proj.bias).tolist() == [1, 1, 1, 1]


def test_free_releases_everything() -> None:
    net = Net()
    arrays = list(net.arrays())
    assert len(arrays) >= 8  # parameters, the private constant and the transposed views
    net.free()
    assert all(a.is_freed for a in arrays)


def test_linear_and_quantized_linear() -> None:
    rng = np.random.default_rng(0)
    w, b, x = rng.normal(size=(16, 64)), rng.normal(size=16), rng.normal(size=(2, 3, 64))
    lin = nn.Linear(64, 16, bias=True)
    lin.update({"weight": mx.array(w, mx.float32), "bias": mx.array(b, mx.float32)})
    np.testing.assert_allclose(np.asarray(lin(mx.array(x, mx.float32))), x @ w.T + b, atol=1e-4)
    q = nn.QuantizedLinear.from_linear(lin, group_size=32, bits=8)
    assert (q.input_dims, q.output_dims) == (64, 16)
    assert set(q.trainable_parameters()) == {"bias"}
    dense = np.asarray(mx.dequantize(q.weight, q.scales, q.biases, 32, 8))
    np.testing.assert_allclose(np.asarray(q(mx.array(x, mx.float32))), x @ dense.T + b, atol=1e-3)
    np.testing.assert_allclose(dense, w, atol=0.05)


def test_embedding_and_quantized_embedding() -> None:
    rng = np.random.default_rng(1)
    table = rng.normal(size=(20, 32)).astype(np.float32)
    emb = nn.Embedding(20, 32)
    emb.weight = mx.array(table)
    ids = np.array([[3, 0, 19]], np.int32)
    np.testing.assert_array_equal(np.asarray(emb(mx.array(ids))), table[ids])
    h = rng.normal(size=(1, 2, 32)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(emb.as_linear(mx.array(h))), h @ table.T, atol=1e-4)
    q = nn.QuantizedEmbedding.from_embedding(emb, group_size=32, bits=8)
    dense = np.asarray(mx.dequantize(q.weight, q.scales, q.biases, 32, 8))
    np.testing.assert_allclose(np.asarray(q(mx.array(ids))), dense[ids], atol=1e-6)
    np.testing.assert_allclose(np.asarray(q.as_linear(mx.array(h))), h @ dense.T, atol=1e-3)


def test_quantize_swaps_by_predicate() -> None:
    net = Net()
    n = nn.quantize(net, lambda path, m: {"bits": 8} if path == "layers.1.proj" else path == "embed",
                    group_size=8, bits=4)
    assert n == 2
    assert isinstance(net.embed, nn.QuantizedEmbedding) and net.embed.bits == 4
    assert isinstance(net.layers[1].proj, nn.QuantizedLinear) and net.layers[1].proj.bits == 8
    assert isinstance(net.layers[0].proj, nn.Linear)
    assert net.parameters()["layers.1.proj.weight"].shape == (4, 8 * 8 // 32)


def test_offset_rms_norm_uses_one_plus_weight() -> None:
    norm = nn.OffsetRMSNorm(4, eps=1e-6)
    x = np.array([[1.0, 2.0, 3.0, 4.0]], np.float32)
    rms = np.sqrt((x**2).mean(-1, keepdims=True) + 1e-6)
    # Never set: zeros, a scale of one (formed in the call).
    np.testing.assert_allclose(np.asarray(norm(mx.array(x))), x / rms, atol=1e-5)
    norm.weight = mx.array([0.0, 1.0, -0.5, 2.0])
    np.testing.assert_allclose(np.asarray(norm(mx.array(x))), x / rms * np.array([1, 2, 0.5, 3]), atol=1e-5)


def test_model_args_from_dict() -> None:
    base = {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128, "num_attention_heads": 4,
            "vocab_size": 100, "some_unknown_key": 1}
    args = llama.ModelArgs.from_dict(base)
    assert (args.head_dim, args.num_key_value_heads) == (16, 4)
    nested = llama.ModelArgs.from_dict({**base, "rope_parameters": {"rope_theta": 5e5, "rope_type": "llama3",
                                                                      "factor": 8.0}})
    assert nested.rope_theta == 5e5 and nested.rope_scaling["rope_type"] == "llama3"
    with pytest.raises(ConfigError, match="vocab_size"):
        llama.ModelArgs.from_dict({k: v for k, v in base.items() if k != "vocab_size"})
    g = gemma3.ModelArgs.from_dict({"model_type": "gemma3", "vocab_size": 300,
                                    "text_config": {"hidden_size": 64, "num_hidden_layers": 6}})
    assert (g.vocab_size, g.num_attention_heads, g.head_dim) == (300, 8, 256)
    assert g.layer_windows() == [4096] * 5 + [None]


def test_a_given_dense_weight_replaces_the_dequantization(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside `dequantized_products()` a quantized linear multiplies by the dense copy of its weight
    given to it as `dense_weight` (the compiled prefill's trace) and dequantizes nothing; without
    one it dequantizes its own weight: the same product."""
    layer = nn.QuantizedLinear(64, 24, bias=False, group_size=32, bits=4)
    w = mx.array(np.random.default_rng(1).standard_normal((24, 64)).astype(np.float32))
    layer.weight, layer.scales, layer.biases = mx.quantize(w, 32, 4)
    x = mx.array(np.random.default_rng(2).standard_normal((5, 64)).astype(np.float32))
    with nn.dequantized_products():
        plain = layer(x)
        layer.__dict__["dense_weight"] = mx.dequantize(layer.weight, layer.scales, layer.biases, 32, 4)
        calls: list[int] = []
        monkeypatch.setattr(nn, "dequantized_product", lambda *a: calls.append(1))
        given = layer(x)
        assert calls == []
    assert np.array_equal(np.asarray(plain), np.asarray(given))
    want = mx.quantized_matmul(x, layer.weight, layer.scales, layer.biases, True, 32, 4)
    assert np.allclose(np.asarray(plain), np.asarray(want), atol=1e-4)

"""The invariants that the typed backend states as checks (where mypy --strict asked for narrowing):
each holds on real objects, and breaking one raises an error that names what is wrong."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pymlxc.core as mx
from pymlxc.backends.metal import lora
from pymlxc.backends.metal.cache import KVCache, RotatingKVCache
from pymlxc.backends.metal.config_check import ConfigError
from pymlxc.backends.metal.models import llama
from pymlxc.backends.metal.models.base import resolved

B, H, D = 1, 2, 4


def tiny_llama(**overrides: Any) -> llama.ModelArgs:
    fields: dict[str, Any] = {"hidden_size": 16, "num_hidden_layers": 2, "intermediate_size": 32,
                                 "num_attention_heads": 4, "vocab_size": 50}
    fields.update(overrides)
    return llama.ModelArgs(**fields)


@given(value=st.one_of(st.integers(), st.floats(allow_nan=False), st.text()))
def test_resolved_returns_a_set_field_unchanged(value: object) -> None:
    assert resolved(value, "head_dim") == value


def test_resolved_names_an_unset_field() -> None:
    with pytest.raises(ConfigError, match="num_key_value_heads is unset"):
        resolved(None, "num_key_value_heads")


@settings(max_examples=25, deadline=None)
@given(heads=st.sampled_from([1, 2, 4]), kv=st.sampled_from([1, 2, 4]), head_dim=st.sampled_from([None, 4, 8]))
def test_attention_takes_the_fields_post_init_resolves(heads: int, kv: int, head_dim: int | None) -> None:
    args = tiny_llama(num_attention_heads=heads, num_key_value_heads=kv if kv <= heads else None, head_dim=head_dim)
    attn = llama.Attention(args)
    assert attn.head_dim == (head_dim if head_dim is not None else 16 // heads)
    assert attn.n_kv_heads == (kv if kv <= heads else heads)
    assert attn.k_proj.weight.shape == (attn.n_kv_heads * attn.head_dim, 16)


@pytest.mark.parametrize("make", [KVCache, lambda: RotatingKVCache(8)], ids=["KVCache", "RotatingKVCache"])
def test_a_cache_without_buffers_says_so(make: Callable[[], KVCache | RotatingKVCache]) -> None:
    cache = make()
    assert cache.state == () and cache.nbytes == 0
    with pytest.raises(RuntimeError, match=r"Cache holds no keys and values"):
        cache.decode_buffers(8)
    k = mx.array(np.arange(B * H * 3 * D, dtype=np.float32).reshape(B, H, 3, D))
    cache.update_and_fetch(k, -k)
    keys, values = cache.decode_buffers(8)
    assert keys.shape == (B, H, 8, D) and values.shape == (B, H, 8, D)
    np.testing.assert_array_equal(np.asarray(keys)[:, :, :3], np.asarray(k))
    cache.release_buffers() if isinstance(cache, KVCache) else cache.free()
    with pytest.raises(RuntimeError, match=r"Cache holds no keys and values"):
        cache.decode_buffers(8)


def test_lora_refuses_a_layer_that_is_not_linear_and_names_it() -> None:
    model = llama.Model(tiny_llama())
    spec = lora.LoRASpec("model.layers.0.input_layernorm", rank=2, scale=1.0)
    with pytest.raises(TypeError, match=r"not RMSNorm \('model\.layers\.0\.input_layernorm'\)"):
        lora.attach(model, [spec])
    assert not lora.lora_layers(model)


def test_fused_gate_up_needs_a_dense_mlp() -> None:
    block = llama.TransformerBlock(tiny_llama())
    x = mx.array(np.random.default_rng(0).standard_normal((1, 1, 16)).astype(np.float32))
    mlp = block.mlp
    assert isinstance(mlp, llama.MLP)
    h, plain = block.finish(x, x)
    _, fused = block.finish(x, x, gate_up=lambda t: (mlp.gate_proj(t), mlp.up_proj(t)))
    np.testing.assert_allclose(np.asarray(fused), np.asarray(plain), rtol=1e-6)
    block.mlp = lambda t: t  # a block that takes x alone, as a MoE block does
    np.testing.assert_allclose(np.asarray(block.finish(x, x)[1]), np.asarray(block.post_attention_layernorm(h)))
    with pytest.raises(TypeError, match="fused gate/up projections need a dense MLP, not function"):
        block.finish(x, x, gate_up=lambda t: (t, t))

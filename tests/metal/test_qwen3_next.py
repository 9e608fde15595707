"""Qwen3-Next, Qwen 3.5 and Qwen 3.5 MoE (Gated DeltaNet + gated attention) against mlx-lm 0.32 on the
same tiny checkpoints, dense and 4-bit: prompt logits, 32 greedy tokens through the caches (with the
prompt prefilled whole or in chunks, with and without a context bound), several full-attention
intervals, expert counts, mlp_only_layers / decoder_sparse_step, tied and separate heads, both RoPE
spellings; then checkpoint handling (HF and mlx-lm layouts, vision and MTP tensors dropped, fused
experts, router bits, config errors).

Tolerances: mlx-lm prefills these layers token by token on the CPU, ours in chunks (the parallel
form): the same sums in another order, so logits agree to float32 rounding (1e-4 absolute on O(5)
logits; 1e-3 for 4-bit), and greedy tokens exactly.
"""
from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import pymlxc.core as mx
from pymlxc.backends.metal import nn
from pymlxc.backends.metal.cache import RotatingKVCache
from pymlxc.backends.metal.loader import LoadedModel, load_weights_and_config
from pymlxc.backends.metal.models import qwen3_5, qwen3_next
from pymlxc.backends.metal.models.base import ConfigError
from pymlxc.backends.metal.models.switch_layers import QuantizedSwitchLinear
from pymlxc.backends.metal.recurrent_cache import RecurrentCache
from pymlxc.testing import write_tiny_model

from .test_models_parity import prompt_ids, run_both

mlx = importlib.import_module("mlx.core")
mlx_utils = importlib.import_module("mlx_lm.utils")

ARCHS = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
CASES = [(a, b) for a in ARCHS for b in (None, 4)]
ATOL = {None: 1e-4, 4: 1e-3}
PROMPT_LEN, STEPS = 10, 32
# Shapes beyond the defaults (interval 2, 4 experts): attention every third layer, 8 experts top 3
# with the first layer dense (Qwen3-Next), attention only in the last of 4 layers.
SHAPES: list[tuple[str, dict[str, Any]]] = [
    ("qwen3_next", {"full_attention_interval": 3, "num_experts": 8, "num_experts_per_tok": 3, "mlp_only_layers": [0]}),
    ("qwen3_next", {"decoder_sparse_step": 2, "norm_topk_prob": False}),
    ("qwen3_5", {"full_attention_interval": 4}),
    ("qwen3_5_moe", {"full_attention_interval": 3, "num_experts": 6, "num_experts_per_tok": 1}),
]

_loaded: dict[Any, tuple[LoadedModel, Any, Path]] = {}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory):
    """(ours, mlx-lm's, directory) per case, written and loaded once per module."""
    root = tmp_path_factory.mktemp("qwen3_next")

    def get(arch: str, bits: int | None = None, **kw: Any) -> tuple[LoadedModel, Any, Path]:
        key = (arch, bits, json.dumps(kw, sort_keys=True))
        if key not in _loaded:
            path = write_tiny_model(root / f"{arch}-{bits}-{len(_loaded)}", arch, quantize_bits=bits, **kw)
            _loaded[key] = (load_weights_and_config(path), mlx_utils.load_model(path)[0], path)
        return _loaded[key]

    yield get
    for ours, _, _ in _loaded.values():
        ours.free()
    _loaded.clear()


# ---------------------------------------------------------------------- parity with mlx-lm

@pytest.mark.parametrize("arch,bits", CASES)
def test_prompt_logits_match_mlx_lm(models, arch: str, bits: int | None) -> None:
    ours, ref, _ = models(arch, bits)
    ids = prompt_ids(12, batch=2)
    a = np.asarray(ours.model(mx.array(ids)))
    assert a.shape == (2, 12, 512)
    np.testing.assert_allclose(a, np.array(ref(mlx.array(ids))), atol=ATOL[bits], rtol=0)


@pytest.mark.parametrize("arch,bits", CASES)
def test_greedy_decode_matches_mlx_lm(models, arch: str, bits: int | None) -> None:
    ours, ref, _ = models(arch, bits)
    la, lb, ta, tb = run_both(ours, ref, prompt_ids(PROMPT_LEN))
    assert ta == tb
    np.testing.assert_allclose(la, lb, atol=ATOL[bits], rtol=0)


@pytest.mark.parametrize("arch,bits", [("qwen3_next", 2), ("qwen3_5", 3), ("qwen3_5_moe", 6), ("qwen3_next", 8)])
def test_other_bit_widths_match_mlx_lm(models, arch: str, bits: int) -> None:
    ours, ref, _ = models(arch, bits)
    assert ours.quantization == {"group_size": 32, "bits": bits}
    la, lb, ta, tb = run_both(ours, ref, prompt_ids(8, seed=4), steps=8)
    assert ta == tb
    np.testing.assert_allclose(la, lb, atol=1e-3, rtol=0)


@pytest.mark.parametrize("arch,extra", SHAPES)
def test_other_shapes_match_mlx_lm(models, arch: str, extra: dict[str, Any]) -> None:
    """Other intervals and expert counts; a 70-token prompt in chunks of 33 (chunk boundaries of the
    parallel form inside and across calls)."""
    ours, ref, _ = models(arch, num_layers=4, extra_config=extra)
    layers = ours.model.layers
    assert [layer.is_linear for layer in layers] == [(i + 1) % extra.get("full_attention_interval", 2) != 0
                                                     for i in range(4)]
    if arch == "qwen3_next":
        moe = [isinstance(layer.mlp, qwen3_next.SparseMoeBlock) for layer in layers]
        assert moe == [ours.model.args.is_moe_layer(i) for i in range(4)] and not all(moe)
    la, lb, ta, tb = run_both(ours, ref, prompt_ids(70, seed=3), chunk=33)
    assert ta == tb
    np.testing.assert_allclose(la, lb, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch,bits", [("qwen3_next", None), ("qwen3_5_moe", 4)])
def test_context_bound_matches_mlx_lm(models, arch: str, bits: int | None) -> None:
    """context_len 24 < a 30-token prompt (chunks of 16) plus 32 tokens: the attention layers rotate
    (keeping 4 sinks), the linear layers' state holds everything."""
    ours, ref, _ = models(arch, bits)
    cache = ours.model.make_cache(24)
    assert [isinstance(c, RecurrentCache) for c in cache] == [layer.is_linear for layer in ours.model.layers]
    assert all(isinstance(c, RotatingKVCache) and c.max_size == 24 for c in cache if not isinstance(c, RecurrentCache))
    la, lb, ta, tb = run_both(ours, ref, prompt_ids(30, seed=2), context_len=24, chunk=16)
    assert ta == tb
    np.testing.assert_allclose(la, lb, atol=ATOL[bits], rtol=0)


def test_decode_through_caches_equals_full_forward(models) -> None:
    ours, _, _ = models("qwen3_5")
    prompt = prompt_ids(PROMPT_LEN)
    cache = ours.model.make_cache()
    steps = [np.asarray(ours.model(mx.array(prompt[:, :4]), cache))[0, -1]]
    steps.append(np.asarray(ours.model(mx.array(prompt[:, 4:]), cache))[0, -1])
    toks = prompt_ids(20, seed=9)[0]
    for t in toks:
        steps.append(np.asarray(ours.model(mx.array([[t]], mx.int32), cache))[0, -1])
    full = np.asarray(ours.model(mx.array(np.concatenate([prompt, toks[None]], axis=1))))[0]
    np.testing.assert_allclose(np.stack(steps[1:]), full[PROMPT_LEN - 1:], atol=1e-4, rtol=0)
    np.testing.assert_allclose(steps[0], full[3], atol=1e-4, rtol=0)


def test_tied_and_separate_heads(models) -> None:
    tied, ref_t, _ = models("qwen3_next", tie_word_embeddings=True)
    sep, ref_s, _ = models("qwen3_5", tie_word_embeddings=False)
    assert tied.model.lm_head is None and sep.model.lm_head is not None
    for ours, ref in ((tied, ref_t), (sep, ref_s)):
        ids = prompt_ids(6)
        np.testing.assert_allclose(np.asarray(ours.model(mx.array(ids))), np.array(ref(mlx.array(ids))), atol=1e-4)


def test_rope_parameters_in_both_spellings(tmp_path: Path) -> None:
    """Qwen3-Next with rope_theta and partial_rotary_factor flat or nested in rope_parameters
    (transformers 5) is the same model; the rotary dims follow the factor."""
    flat = write_tiny_model(tmp_path / "flat", "qwen3_next", extra_config={"rope_theta": 5000.0,
                                                                          "partial_rotary_factor": 0.5})
    nested = write_tiny_model(tmp_path / "nested", "qwen3_next", extra_config={
        "rope_theta": None, "partial_rotary_factor": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": 0.5}})
    a, b = load_weights_and_config(flat), load_weights_and_config(nested)
    attn = a.model.layers[1].self_attn
    assert attn.rope.dims == 8 and attn.rope.base == 5000.0
    ids = mx.array(prompt_ids(9))
    np.testing.assert_array_equal(np.asarray(a.model(ids)), np.asarray(b.model(ids)))
    ref = mlx_utils.load_model(flat)[0]
    np.testing.assert_allclose(np.asarray(a.model(ids)), np.array(ref(mlx.array(prompt_ids(9)))), atol=1e-4)


# ---------------------------------------------------------------------- checkpoints

def test_hf_layout_is_sanitized(models) -> None:
    """The tiny HF checkpoints hold offset norms, [C, 1, K] convs, per-expert or fused experts, an
    MTP tensor and (Qwen 3.5) a vision tensor: loaded as mlx-lm's layout, extras dropped."""
    for arch in ARCHS:
        ours, _, path = models(arch)
        params = ours.model.parameters()
        assert not any(k.startswith(("mtp.", "model.visual")) for k in params)
        conv = params["model.layers.0.linear_attn.conv1d.weight"]
        assert conv.shape == (192, 4, 1)  # 2 x 2 key heads of 32 + 4 value heads of 16
        assert abs(float(mx.mean(params["model.norm.weight"]).item()) - 1.0) < 0.05  # offset + 1
        if arch != "qwen3_5":
            assert params["model.layers.0.mlp.switch_mlp.gate_proj.weight"].shape == (4, 32, 64)
        config = json.loads((path / "config.json").read_text())
        assert ("text_config" in config) == (arch != "qwen3_next")


def test_quantized_routers_keep_their_bits(models) -> None:
    ours, _, path = models("qwen3_5_moe", 4)
    mlp = ours.model.layers[0].mlp
    assert isinstance(mlp.switch_mlp.gate_proj, QuantizedSwitchLinear) and mlp.switch_mlp.gate_proj.bits == 4
    assert isinstance(mlp.gate, nn.QuantizedLinear) and (mlp.gate.bits, mlp.gate.group_size) == (8, 64)
    assert isinstance(mlp.shared_expert_gate, nn.QuantizedLinear) and mlp.shared_expert_gate.bits == 8
    assert isinstance(ours.model.layers[0].linear_attn.in_proj_qkv, nn.QuantizedLinear)
    quant = json.loads((path / "config.json").read_text())["quantization"]
    assert quant["language_model.model.layers.0.mlp.gate"] == {"group_size": 64, "bits": 8}


def test_fused_gate_up_must_be_whole() -> None:
    w = {"model.layers.0.mlp.experts.gate_up_proj": mx.zeros((2, 8, 4))}
    with pytest.raises(nn.WeightsError, match=r"experts.down_proj"):
        qwen3_5.split_gate_up(dict(w), 1)
    w["model.layers.0.mlp.experts.gate_up_proj"] = mx.zeros((2, 7, 4))
    w["model.layers.0.mlp.experts.down_proj"] = mx.zeros((2, 4, 4))
    with pytest.raises(nn.WeightsError, match=r"gate_up_proj: expected \[experts, 2 \* size, hidden\]"):
        qwen3_5.split_gate_up(w, 1)


@pytest.mark.parametrize("field,value,match", [
    ("linear_num_value_heads", 3, "linear_num_value_heads: 3 is not a multiple of linear_num_key_heads 2"),
    ("full_attention_interval", 0, "full_attention_interval"),
    ("linear_conv_kernel_dim", 0, "linear_conv_kernel_dim"),
    ("partial_rotary_factor", 0.0, "partial_rotary_factor"),
    ("num_experts_per_tok", 9, "num_experts_per_tok must be in 1..4"),
])
def test_bad_config_names_the_field(tmp_path: Path, field: str, value: Any, match: str) -> None:
    path = write_tiny_model(tmp_path / "m", "qwen3_next")
    config = json.loads((path / "config.json").read_text())
    config[field] = value
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=match):
        load_weights_and_config(path)


def test_text_config_errors_name_the_nesting(tmp_path: Path) -> None:
    path = write_tiny_model(tmp_path / "m", "qwen3_5")
    config = json.loads((path / "config.json").read_text())
    config["text_config"]["linear_key_head_dim"] = "wide"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"text_config\.linear_key_head_dim"):
        load_weights_and_config(path)
    config["text_config"]["linear_key_head_dim"] = 32
    config["text_config"]["linear_num_value_heads"] = 3
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"text_config\.linear_num_value_heads: 3 is not a multiple"):
        load_weights_and_config(path)

"""The mixture-of-experts and Gemma 4 architectures against mlx-lm on the same tiny checkpoints
(the shared runner of test_models_parity): qwen3_moe, qwen2_moe (HF per-expert tensors, stacked on
load), gemma4_text (per-layer inputs, k/v shared by the tail layers, double-wide MLPs) and the
multimodal gemma4 (MoE block, K = V, vision tensors dropped), dense and 4-bit (mlx-lm's stacked
expert layout, routers at their own 8 bits through per-layer overrides).

Both sides run the same MLX kernels on the same weights: results are normally bit-identical, the
tolerances (see test_models_parity) only admit a different summation order.
"""
from __future__ import annotations

import dataclasses
import importlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import pymlxc.core as mx
from pymlxc.backends.metal import nn
from pymlxc.backends.metal.loader import load_weights_and_config
from pymlxc.backends.metal.models import gemma4, qwen3_moe
from pymlxc.backends.metal.models.base import ConfigError
from pymlxc.backends.metal.models.switch_layers import QuantizedSwitchLinear, SwitchGLU, SwitchLinear
from pymlxc.testing import write_tiny_model

from .test_models_parity import ATOL, PROMPT_LEN, STEPS, models, prompt_ids, run_both  # noqa: F401 (fixture)

mlx = importlib.import_module("mlx.core")
mlx_utils = importlib.import_module("mlx_lm.utils")

ARCHS = ("qwen3_moe", "qwen2_moe", "gemma4_text", "gemma4")
CASES = [(a, b) for a in ARCHS for b in (None, 4)]
# gemma4_text with every feature at once: per-layer inputs, shared k/v, the MoE block and K = V.
EVERYTHING = {"enable_moe_block": True, "attention_k_eq_v": True, "num_global_key_value_heads": 1}


@pytest.mark.parametrize("arch,bits", CASES)
def test_prompt_logits_match_mlx_lm(models, arch: str, bits: int | None) -> None:
    ours, ref = models(arch, bits)
    ids = prompt_ids(12, batch=2)
    a = np.asarray(ours.model(mx.array(ids)))
    assert a.shape == (2, 12, ours.model.args.vocab_size)
    np.testing.assert_allclose(a, np.array(ref(mlx.array(ids))), atol=ATOL[bits], rtol=0)


@pytest.mark.parametrize("arch,bits", [*CASES, ("gemma4_text", "all")])
def test_greedy_decode_matches_mlx_lm(models, arch: str, bits: Any) -> None:
    ours, ref = models(arch, extra_config=EVERYTHING) if bits == "all" else models(arch, bits)
    la, lb, ta, tb = run_both(ours, ref, prompt_ids(PROMPT_LEN), context_len=None, chunk=None, steps=STEPS)
    assert ta == tb
    np.testing.assert_allclose(np.stack(la), np.stack(lb), atol=ATOL[None if bits == "all" else bits], rtol=0)


@pytest.mark.parametrize("arch,bits", [("qwen3_moe", None), ("gemma4_text", None), ("gemma4", 4)])
def test_context_bound_rotating_matches_mlx_lm(models, arch: str, bits: int | None) -> None:
    """context_len 24 < a 30-token prompt (chunks of 16) plus 32 generated tokens."""
    ours, ref = models(arch, bits)
    la, lb, ta, tb = run_both(ours, ref, prompt_ids(30, seed=2), context_len=24, chunk=16, steps=STEPS)
    assert ta == tb
    np.testing.assert_allclose(np.stack(la), np.stack(lb), atol=ATOL[bits], rtol=0)


@pytest.mark.parametrize("arch,bits", [("qwen3_moe", None), ("qwen2_moe", 4), ("gemma4", None), ("gemma4", 4)])
def test_many_tokens_sorted_by_expert(models, arch: str, bits: int | None) -> None:
    """A 48-token batch of 2 routes 192 (token, expert) pairs: they are sorted by expert before
    gather_mm. Logits equal mlx-lm's, and our own chunked prefill of 8 tokens (16 pairs, unsorted)."""
    ours, ref = models(arch, bits)
    ids = prompt_ids(48, batch=2, seed=8)
    full = np.asarray(ours.model(mx.array(ids)))
    np.testing.assert_allclose(full, np.array(ref(mlx.array(ids))), atol=ATOL[bits], rtol=0)
    cache = ours.model.make_cache(None)
    chunks = [np.asarray(ours.model(mx.array(ids[:1, s:s + 8]), cache)) for s in range(0, 48, 8)]
    np.testing.assert_allclose(np.concatenate(chunks, axis=1), full[:1], atol=ATOL[bits], rtol=0)


def test_gemma4_cached_decode_equals_full_forward(models) -> None:
    """Through the caches (the shared tail reads its source layers' keys, the sliding window of 16
    is crossed) the logits of each step equal a cacheless forward over the whole sequence."""
    ours, ref = models("gemma4_text", extra_config=EVERYTHING)
    prompt = prompt_ids(PROMPT_LEN)
    la, _, toks, _ = run_both(ours, ref, prompt, context_len=None, chunk=4, steps=20)
    seq = np.concatenate([prompt, np.array([toks], np.int32)], axis=1)
    full = np.asarray(ours.model(mx.array(seq)))
    np.testing.assert_allclose(np.stack(la)[:, 0], full[0, PROMPT_LEN - 1:PROMPT_LEN - 1 + 20], atol=1e-4, rtol=0)


def test_structure_after_loading(models) -> None:
    """Per-expert HF tensors are stacked; quantized stacks and routers keep their own settings; the
    shared tail has no k/v of its own and no caches; the vision tower is gone."""
    q3, _ = models("qwen3_moe")
    moe, dense = q3.model.layers
    assert isinstance(moe.mlp, qwen3_moe.SparseMoeBlock) and isinstance(dense.mlp, qwen3_moe.llama.MLP)
    assert isinstance(moe.mlp.switch_mlp.up_proj, SwitchLinear)
    assert moe.mlp.switch_mlp.up_proj.weight.shape == (4, 32, 64)
    assert not any(".experts." in k for k in q3.model.parameters())

    q3q, _ = models("qwen3_moe", 4)
    mlp = q3q.model.layers[0].mlp
    assert isinstance(mlp.switch_mlp.down_proj, QuantizedSwitchLinear) and mlp.switch_mlp.down_proj.bits == 4
    assert isinstance(mlp.gate, nn.QuantizedLinear) and (mlp.gate.bits, mlp.gate.group_size) == (8, 64)
    assert q3q.quantization == {"group_size": 32, "bits": 4}

    g4t, _ = models("gemma4_text")
    assert len(g4t.model.make_cache()) == 2 and len(g4t.model.layers) == 4
    assert "k_proj" not in vars(g4t.model.layers[3].self_attn)
    assert g4t.model.layers[3].mlp.up_proj.weight.shape == (256, 64)  # double wide
    g4, _ = models("gemma4")
    attn = g4.model.layers[1].self_attn
    assert "v_proj" not in vars(attn) and attn.head_dim == 32 and attn.n_kv_heads == 1
    assert not any("vision" in k for k in g4.model.parameters())


def test_tiny_checkpoints_have_hf_names(tmp_path: Path) -> None:
    """What the writer stores before any loader touches it: HF's per-expert and fused-expert
    tensors when dense, mlx-lm's stacks when quantized, and the multimodal wrapper's names."""
    from safetensors.numpy import load_file

    def names(arch: str, bits: int | None = None) -> dict[str, Any]:
        path = write_tiny_model(tmp_path / f"{arch}-{bits}", arch, quantize_bits=bits)
        return load_file(str(path / "model.safetensors"))

    q2 = names("qwen2_moe")
    assert q2["model.layers.0.mlp.experts.3.up_proj.weight"].shape == (32, 64)
    assert q2["model.layers.0.mlp.shared_expert_gate.weight"].shape == (1, 64)
    assert "model.layers.0.self_attn.q_proj.bias" in q2 and "lm_head.weight" in q2
    q3q = names("qwen3_moe", 4)
    assert q3q["model.layers.0.mlp.switch_mlp.up_proj.weight"].shape == (4, 32, 64 * 4 // 32)
    assert q3q["model.layers.0.mlp.gate.weight"].shape == (4, 64 * 8 // 32)  # the router at 8 bits
    assert "model.layers.1.mlp.gate_proj.weight" in q3q  # mlp_only_layers
    g4t = names("gemma4_text")
    assert g4t["model.layers.0.self_attn.q_proj.weight"].shape == (64, 64)  # sliding: head_dim 16
    assert g4t["model.layers.1.self_attn.q_proj.weight"].shape == (128, 64)  # full: global_head_dim 32
    assert "model.layers.2.self_attn.k_proj.weight" not in g4t and g4t["model.layers.0.layer_scalar"].shape == (1,)
    assert g4t["model.embed_tokens_per_layer.weight"].shape == (512, 4 * 16)
    g4 = names("gemma4")
    assert g4["model.language_model.layers.0.experts.gate_up_proj"].shape == (4, 64, 64)
    assert "model.language_model.layers.1.self_attn.v_proj.weight" not in g4  # K = V
    assert "model.vision_tower.patch_embedder.input_proj.weight" in g4
    g4q = names("gemma4", 4)
    assert g4q["model.language_model.layers.0.experts.switch_glu.gate_proj.scales"].shape == (4, 32, 2)


def test_missing_expert_is_named(tmp_path: Path) -> None:
    from safetensors.numpy import load_file, save_file

    path = write_tiny_model(tmp_path / "m", "qwen2_moe")
    weights = load_file(str(path / "model.safetensors"))
    del weights["model.layers.1.mlp.experts.2.down_proj.weight"]
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(nn.WeightsError, match=r"model\.layers\.1\.mlp\.experts\.2\.down_proj\.weight"):
        load_weights_and_config(path)


@pytest.mark.parametrize("arch", ["qwen3_moe", "gemma4"])
def test_quantized_by_mlx_lm_with_overrides(tmp_path: Path, arch: str) -> None:
    """A checkpoint quantized by mlx-lm itself: routers left dense by a `false` override, the
    experts' down projections at 8 bits, 4 bits elsewhere."""
    src = write_tiny_model(tmp_path / "src", arch)
    model, config = mlx_utils.load_model(src)

    def predicate(path: str, module: Any) -> Any:
        if path.endswith(("mlp.gate", "router.proj")):
            return False
        if path.endswith("down_proj") and ("switch" in path):
            return {"group_size": 32, "bits": 8}
        return True

    model, config = mlx_utils.quantize_model(model, config, 32, 4, quant_predicate=predicate)
    routers = [p for p, _ in model.named_modules() if p.endswith(("mlp.gate", "router.proj"))]
    for p in routers:
        config["quantization"][p] = False
    dst = tmp_path / "q"
    mlx_utils.save_model(dst, model)
    mlx_utils.save_config(config, dst / "config.json")
    with load_weights_and_config(dst) as ours:
        layer = ours.model.layers[0]
        experts = layer.mlp.switch_mlp if arch == "qwen3_moe" else layer.experts.switch_glu
        router = layer.mlp.gate if arch == "qwen3_moe" else layer.router.proj
        assert isinstance(router, nn.Linear)
        assert isinstance(experts.down_proj, QuantizedSwitchLinear) and experts.down_proj.bits == 8
        assert isinstance(experts.up_proj, QuantizedSwitchLinear) and experts.up_proj.bits == 4
        ref = mlx_utils.load_model(dst)[0]
        ids = prompt_ids(40, batch=2)
        np.testing.assert_allclose(np.asarray(ours.model(mx.array(ids))), np.array(ref(mlx.array(ids))),
                                   atol=1e-3, rtol=0)


def test_gemma4_config_defaults_are_mlx_lm_s() -> None:
    """mlx-lm's field names and defaults (not HF's: e.g. 20 shared layers, soft-capping at 30)."""
    from mlx_lm.models import gemma4_text as ref

    theirs = ref.ModelArgs()
    ours = gemma4.ModelArgs()
    mine = {f.name for f in dataclasses.fields(ours)}
    unused = {"partial_rotary_factor", "global_partial_rotary_factor", "pad_token_id"}  # read by nothing
    assert {f.name for f in dataclasses.fields(theirs)} - mine == unused
    for name in mine:
        assert getattr(ours, name) == getattr(theirs, name), name
    nested = gemma4.ModelArgs.from_dict({"model_type": "gemma4", "text_config": {"hidden_size": 64}})
    assert (nested.num_attention_heads, nested.num_key_value_heads, nested.vocab_size) == (8, 1, 262144)


def test_config_errors() -> None:
    with pytest.raises(ConfigError, match="enable_moe_block needs"):
        gemma4.ModelArgs(enable_moe_block=True)
    with pytest.raises(ConfigError, match="unsupported layer types"):
        gemma4.ModelArgs.from_dict({"num_hidden_layers": 2, "layer_types": ["sliding_attention", "chunked_attention"]})
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        qwen3_moe.ModelArgs.from_dict({"hidden_size": 64, "num_hidden_layers": 1, "intermediate_size": 64,
                                       "num_attention_heads": 4, "vocab_size": 10, "num_experts": 4,
                                       "num_experts_per_tok": 5})


def test_switch_glu_sorted_equals_unsorted() -> None:
    """The sorted dispatch (>= 64 pairs) gives what one gather_mm per pair in token order gives."""
    rng = np.random.default_rng(0)
    glu = SwitchGLU(8, 16, 4)
    glu.update({f"{p}.weight": mx.array(rng.normal(size=s).astype(np.float32)) for p, s in
                (("gate_proj", (4, 16, 8)), ("up_proj", (4, 16, 8)), ("down_proj", (4, 8, 16)))})
    x = mx.array(rng.normal(size=(2, 20, 8)).astype(np.float32))
    inds = mx.array(rng.integers(0, 4, size=(2, 20, 2)).astype(np.int32))
    many = np.asarray(glu(x, inds))  # 80 pairs: sorted
    one_by_one = np.concatenate([np.asarray(glu(x[:, i:i + 1], inds[:, i:i + 1])) for i in range(20)], axis=1)
    # Outputs reach ~17: rtol admits a GPU's different float32 summation order (2e-5 seen on an H100).
    np.testing.assert_allclose(many, one_by_one, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_load_model_generates_as_mlx_lm(tmp_path: Path, arch: str) -> None:
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    import pymlxc

    path = write_tiny_model(tmp_path / arch, arch, seed=1)
    with pymlxc.load_model(str(path), backend="metal") as model:
        prompt = "Once upon a time"
        ours = [t.id for t in model.generate(prompt, max_tokens=16)]
        assert model.err() is None and len(ours) == 16
        prompt_ids_ = model.encode(prompt)
        chat = [t.id for t in model.chat([{"role": "user", "content": "hi"}], max_tokens=4)]
        assert len(chat) == 4
    lm, _ = load(str(path))
    theirs = [int(t) for t, _ in generate_step(mlx.array(prompt_ids_), lm, max_tokens=16)]
    assert ours == theirs

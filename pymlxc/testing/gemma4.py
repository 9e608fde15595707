"""Gemma 4's config fields and HF tensors (per-layer inputs, shared k/v layers, experts beside the MLP)."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np


def gemma4_config(arch: str, *, num_layers: int, head_dim: int, vocab_size: int) -> dict[str, Any]:
    """Sliding and full layers alternate (full ones with twice the head size and partial
    "proportional" RoPE). gemma4_text is shaped like the small Gemma 4 (per-layer inputs, the last
    half of the layers sharing earlier k/v with double-wide MLPs), gemma4 like the 26B MoE
    (experts beside the MLP, K = V on full layers). `extra_config` switches features on or off."""
    small = arch == "gemma4_text"
    return {
        "rms_norm_eps": 1e-6, "hidden_activation": "gelu_pytorch_tanh", "global_head_dim": 2 * head_dim,
        "sliding_window": 16, "final_logit_softcapping": 30.0,
        "layer_types": ["full_attention" if i % 2 else "sliding_attention" for i in range(num_layers)],
        "rope_parameters": {
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        "hidden_size_per_layer_input": 16 if small else 0, "vocab_size_per_layer_input": vocab_size,
        "num_kv_shared_layers": num_layers // 2 if small and num_layers >= 4 else 0, "use_double_wide_mlp": True,
        "attention_k_eq_v": not small, "num_global_key_value_heads": None if small else 1,
        "enable_moe_block": not small, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 32,
        "architectures": ["Gemma4ForCausalLM"],
    }


def gemma4_weights(config: Mapping[str, Any], arch: str, w: dict[str, np.ndarray],
                   linear: Callable[[int, int], np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """HF's Gemma 4 tensors after the embedding in `w` (`experts.gate_up_proj` [E, 2 * moe_inter,
    hidden] fused), in the text model's names; the multimodal checkpoint gets two vision tensors that
    loading must drop."""
    hidden, inter, n_layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    ple, first_shared = config["hidden_size_per_layer_input"], n_layers - config["num_kv_shared_layers"]

    def norm(dim: int) -> np.ndarray:  # Gemma 4's RMSNorms scale by w itself
        return rng.normal(1.0, 0.05, size=(dim,))

    for i, kind in enumerate(config["layer_types"]):
        p = f"model.layers.{i}."
        full = kind == "full_attention"
        hd = config["global_head_dim"] if full else config["head_dim"]
        k_eq_v = config["attention_k_eq_v"] and full
        kvh = config["num_global_key_value_heads"] or kv_heads if k_eq_v else kv_heads
        w[p + "self_attn.q_proj.weight"] = linear(heads * hd, hidden)
        w[p + "self_attn.o_proj.weight"] = linear(hidden, heads * hd)
        # The attention scale is 1: q/k norm weights near hd^-1/4 keep the scores O(1), as trained ones do.
        w[p + "self_attn.q_norm.weight"] = norm(hd) * hd**-0.25
        if i < first_shared:
            w[p + "self_attn.k_proj.weight"] = linear(kvh * hd, hidden)
            if not k_eq_v:
                w[p + "self_attn.v_proj.weight"] = linear(kvh * hd, hidden)
            w[p + "self_attn.k_norm.weight"] = norm(hd) * hd**-0.25
        width = inter * (2 if config["use_double_wide_mlp"] and i >= first_shared > 0 else 1)
        w[p + "mlp.gate_proj.weight"] = linear(width, hidden)
        w[p + "mlp.up_proj.weight"] = linear(width, hidden)
        w[p + "mlp.down_proj.weight"] = linear(hidden, width)
        for name in ("input", "post_attention", "pre_feedforward", "post_feedforward"):
            w[p + f"{name}_layernorm.weight"] = norm(hidden)
        w[p + "layer_scalar"] = rng.uniform(0.7, 1.3, size=(1,))
        if config["enable_moe_block"]:
            n, moe_inter = config["num_experts"], config["moe_intermediate_size"]
            w[p + "router.proj.weight"] = linear(n, hidden)
            w[p + "router.scale"] = norm(hidden)
            w[p + "router.per_expert_scale"] = rng.uniform(0.5, 1.5, size=(n,))
            w[p + "experts.gate_up_proj"] = np.stack([linear(2 * moe_inter, hidden) for _ in range(n)])
            w[p + "experts.down_proj"] = np.stack([linear(hidden, moe_inter) for _ in range(n)])
            for name in ("post_feedforward_layernorm_1", "post_feedforward_layernorm_2", "pre_feedforward_layernorm_2"):
                w[p + f"{name}.weight"] = norm(hidden)
        if ple:
            w[p + "per_layer_input_gate.weight"] = linear(ple, hidden)
            w[p + "per_layer_projection.weight"] = linear(hidden, ple)
            w[p + "post_per_layer_input_norm.weight"] = norm(hidden)
    if ple:
        w["model.embed_tokens_per_layer.weight"] = rng.normal(
            0.0, ple**-0.5, size=(config["vocab_size_per_layer_input"], n_layers * ple))
        w["model.per_layer_model_projection.weight"] = linear(n_layers * ple, hidden)
        w["model.per_layer_projection_norm.weight"] = norm(ple)
    w["model.norm.weight"] = norm(hidden)
    if not config["tie_word_embeddings"]:
        w["lm_head.weight"] = linear(config["vocab_size"], hidden)
    if arch == "gemma4":
        w["model.vision_tower.patch_embedder.input_proj.weight"] = linear(16, 48)
        w["model.embed_vision.embedding_projection.weight"] = linear(hidden, 16)
    return w


__all__ = ["gemma4_config", "gemma4_weights"]

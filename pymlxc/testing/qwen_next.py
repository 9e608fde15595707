"""Qwen3-Next and Qwen 3.5 (Gated DeltaNet linear attention): config fields, HF tensors, and
mlx-lm's layout and quantization of them."""
from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from .moe import is_moe_layer, to_switch_layout
from .quantize import ROUTER_QUANT, quantize_affine


def next_config(arch: str, *, num_layers: int) -> dict[str, Any]:
    """Linear-attention layers with full attention every second layer (`full_attention_interval`),
    2 key heads of 32 and 4 value heads of 16, a window of 4; qwen3_next and qwen3_5_moe with 4
    experts (top 2) and a shared expert, qwen3_5 dense. Qwen 3.5 nests its RoPE settings in
    `rope_parameters` (transformers 5), Qwen3-Next keeps them flat."""
    config: dict[str, Any] = {
        "rms_norm_eps": 1e-6, "hidden_act": "silu", "full_attention_interval": 2,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32,
        "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
    }
    if arch == "qwen3_next":
        config.update(rope_theta=10000.0, partial_rotary_factor=0.25, rope_scaling=None,
                      architectures=["Qwen3NextForCausalLM"])
    else:
        config["model_type"] = f"{arch}_text"
        config["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                     "mrope_section": [1, 1, 0], "mrope_interleaved": True}
    if arch != "qwen3_5":
        config.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=64, decoder_sparse_step=1, mlp_only_layers=[],
                      norm_topk_prob=True)
    return config


def next_multimodal_config(arch: str, text: dict[str, Any], ids: Mapping[str, Any], dtype: str) -> dict[str, Any]:
    name = "Qwen3_5MoeForConditionalGeneration" if arch == "qwen3_5_moe" else "Qwen3_5ForConditionalGeneration"
    text_only = {k: v for k, v in text.items() if k != "architectures"}
    return {"architectures": [name], "model_type": arch, "text_config": text_only,
            "vision_config": {"model_type": "qwen3_5_vision", "hidden_size": 16, "depth": 1},
            "vocab_size": text["vocab_size"], "tie_word_embeddings": text["tie_word_embeddings"], "torch_dtype": dtype,
            **ids}


def next_weights(config: Mapping[str, Any], arch: str, w: dict[str, np.ndarray],
                 linear: Callable[[int, int], np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """HF's tensors: RMSNorm weights as offsets from 1 (but the gated norm's), conv weights [C, 1,
    K], experts apart (qwen3_next) or fused `experts.gate_up_proj` (qwen3_5_moe); a multi-token
    prediction tensor, and for Qwen 3.5 a vision tensor, that loading must drop."""
    hidden, inter, heads = config["hidden_size"], config["intermediate_size"], config["num_attention_heads"]
    hd, kv_heads = config["head_dim"], config["num_key_value_heads"]
    nk, nv = config["linear_num_key_heads"], config["linear_num_value_heads"]
    dk, dv, width = config["linear_key_head_dim"], config["linear_value_head_dim"], config["linear_conv_kernel_dim"]
    key_dim, value_dim = nk * dk, nv * dv

    def offset_norm(dim: int) -> np.ndarray:
        return rng.normal(0.0, 0.05, size=(dim,))

    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        if (i + 1) % config["full_attention_interval"]:
            a = p + "linear_attn."
            if arch == "qwen3_next":
                w[a + "in_proj_qkvz.weight"] = linear(2 * key_dim + 2 * value_dim, hidden)
                w[a + "in_proj_ba.weight"] = linear(2 * nv, hidden)
            else:
                w[a + "in_proj_qkv.weight"] = linear(2 * key_dim + value_dim, hidden)
                w[a + "in_proj_z.weight"] = linear(value_dim, hidden)
                w[a + "in_proj_b.weight"] = linear(nv, hidden)
                w[a + "in_proj_a.weight"] = linear(nv, hidden)
            w[a + "conv1d.weight"] = rng.normal(0.0, width**-0.5, size=(2 * key_dim + value_dim, 1, width))
            w[a + "dt_bias"] = rng.normal(0.0, 0.5, size=(nv,))
            w[a + "A_log"] = np.log(rng.uniform(1.0, 16.0, size=(nv,)))
            w[a + "norm.weight"] = rng.normal(1.0, 0.05, size=(dv,))
            w[a + "out_proj.weight"] = linear(hidden, value_dim)
        else:
            w[p + "self_attn.q_proj.weight"] = linear(2 * heads * hd, hidden)
            w[p + "self_attn.k_proj.weight"] = linear(kv_heads * hd, hidden)
            w[p + "self_attn.v_proj.weight"] = linear(kv_heads * hd, hidden)
            w[p + "self_attn.o_proj.weight"] = linear(hidden, heads * hd)
            w[p + "self_attn.q_norm.weight"] = offset_norm(hd)
            w[p + "self_attn.k_norm.weight"] = offset_norm(hd)
        n = config.get("num_experts", 0)
        moe = n > 0 and (arch != "qwen3_next" or is_moe_layer(config, i))
        if moe:
            moe_inter, shared = config["moe_intermediate_size"], config["shared_expert_intermediate_size"]
            w[p + "mlp.gate.weight"] = linear(n, hidden)
            if arch == "qwen3_next":
                for e in range(n):
                    w[p + f"mlp.experts.{e}.gate_proj.weight"] = linear(moe_inter, hidden)
                    w[p + f"mlp.experts.{e}.up_proj.weight"] = linear(moe_inter, hidden)
                    w[p + f"mlp.experts.{e}.down_proj.weight"] = linear(hidden, moe_inter)
            else:
                w[p + "mlp.experts.gate_up_proj"] = np.stack([linear(2 * moe_inter, hidden) for _ in range(n)])
                w[p + "mlp.experts.down_proj"] = np.stack([linear(hidden, moe_inter) for _ in range(n)])
            w[p + "mlp.shared_expert.gate_proj.weight"] = linear(shared, hidden)
            w[p + "mlp.shared_expert.up_proj.weight"] = linear(shared, hidden)
            w[p + "mlp.shared_expert.down_proj.weight"] = linear(hidden, shared)
            w[p + "mlp.shared_expert_gate.weight"] = linear(1, hidden)
        else:
            w[p + "mlp.gate_proj.weight"] = linear(inter, hidden)
            w[p + "mlp.up_proj.weight"] = linear(inter, hidden)
            w[p + "mlp.down_proj.weight"] = linear(hidden, inter)
        w[p + "input_layernorm.weight"] = offset_norm(hidden)
        w[p + "post_attention_layernorm.weight"] = offset_norm(hidden)
    w["model.norm.weight"] = offset_norm(hidden)
    if not config["tie_word_embeddings"]:
        w["lm_head.weight"] = linear(config["vocab_size"], hidden)
    w["mtp.fc.weight"] = linear(hidden, 2 * hidden)
    if arch != "qwen3_next":
        w["model.visual.patch_embed.proj.weight"] = linear(16, 48)
    return w


def next_to_mlx_layout(weights: dict[str, np.ndarray], arch: str) -> dict[str, np.ndarray]:
    """What mlx-lm's conversion writes: experts stacked, conv [C, K, 1], norms + 1, no MTP or
    vision tensors, Qwen 3.5's text model under `language_model.`."""
    unfused: dict[str, np.ndarray] = {}
    for name, value in weights.items():
        if name.endswith(".experts.gate_up_proj"):
            base = name[: -len(".experts.gate_up_proj")] + ".switch_mlp"
            unfused[base + ".gate_proj.weight"], unfused[base + ".up_proj.weight"] = np.split(value, 2, axis=-2)
        elif name.endswith(".experts.down_proj"):
            unfused[name[: -len(".experts.down_proj")] + ".switch_mlp.down_proj.weight"] = value
        elif not name.startswith(("mtp.", "model.visual.")):
            unfused[name] = value
    out: dict[str, np.ndarray] = {}
    for name, value in to_switch_layout(unfused).items():
        if name.endswith("conv1d.weight"):
            value = np.swapaxes(value, 1, 2)
        elif name.endswith(("layernorm.weight", "model.norm.weight", "language_model.norm.weight", "_norm.weight")):
            value = value + 1
        if name.startswith("model.language_model."):
            name = "language_model.model." + name[len("model.language_model."):]
        elif arch != "qwen3_next" and name.startswith("lm_head."):
            name = "language_model." + name
        out[name] = value
    return out


def quantize_next(weights: dict[str, np.ndarray], arch: str, group_size: int,
                  bits: int) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """mlx-lm's quantization of these families: every projection, embedding and expert stack (not
    the convolution), the routers (`mlp.gate`, `mlp.shared_expert_gate`) at 8 bits as overrides."""
    out: dict[str, np.ndarray] = {}
    overrides: dict[str, Any] = {}
    for name, value in next_to_mlx_layout(weights, arch).items():
        stem = name[: -len(".weight")]
        router = name.endswith((".mlp.gate.weight", ".mlp.shared_expert_gate.weight"))
        params = ROUTER_QUANT if router else {"group_size": group_size, "bits": bits}
        if (name.endswith(".weight") and value.ndim >= 2 and "conv1d" not in name
                and value.shape[-1] % params["group_size"] == 0):
            out[name], out[stem + ".scales"], out[stem + ".biases"] = quantize_affine(value, **params)
            if router:
                overrides[stem] = dict(params)
        else:
            out[name] = value
    return out, overrides


def next_tensors(config: Mapping[str, Any]) -> Iterator[tuple[str, tuple[int, ...], str]]:
    """(name, shape, kind) of every tensor of a Qwen 3.5 MoE text config in what mlx-lm's conversion
    writes (`next_to_mlx_layout`'s names and shapes, for the real-shape writer, which draws them one
    by one). Kinds: "embedding", "linear" (expert stacks [E, out, in] too), "router" (8-bit when
    quantized), "norm" (stored with the + 1, so around 1), "conv" ([C, K, 1], never quantized),
    "dt_bias" and "a_log"."""
    hidden, heads, hd = config["hidden_size"], config["num_attention_heads"], config["head_dim"]
    kv_heads, n = config["num_key_value_heads"], config["num_experts"]
    nk, nv = config["linear_num_key_heads"], config["linear_num_value_heads"]
    dk, dv, width = config["linear_key_head_dim"], config["linear_value_head_dim"], config["linear_conv_kernel_dim"]
    key_dim, value_dim = nk * dk, nv * dv
    moe_inter, shared = config["moe_intermediate_size"], config["shared_expert_intermediate_size"]
    m = "language_model.model."
    yield m + "embed_tokens.weight", (config["vocab_size"], hidden), "embedding"
    for i in range(config["num_hidden_layers"]):
        p = f"{m}layers.{i}."
        if (i + 1) % config["full_attention_interval"]:
            a = p + "linear_attn."
            yield a + "in_proj_qkv.weight", (2 * key_dim + value_dim, hidden), "linear"
            yield a + "in_proj_z.weight", (value_dim, hidden), "linear"
            yield a + "in_proj_b.weight", (nv, hidden), "linear"
            yield a + "in_proj_a.weight", (nv, hidden), "linear"
            yield a + "conv1d.weight", (2 * key_dim + value_dim, width, 1), "conv"
            yield a + "dt_bias", (nv,), "dt_bias"
            yield a + "A_log", (nv,), "a_log"
            yield a + "norm.weight", (dv,), "norm"
            yield a + "out_proj.weight", (hidden, value_dim), "linear"
        else:
            s = p + "self_attn."
            yield s + "q_proj.weight", (2 * heads * hd, hidden), "linear"  # the query and its gate
            yield s + "k_proj.weight", (kv_heads * hd, hidden), "linear"
            yield s + "v_proj.weight", (kv_heads * hd, hidden), "linear"
            yield s + "o_proj.weight", (hidden, heads * hd), "linear"
            yield s + "q_norm.weight", (hd,), "norm"
            yield s + "k_norm.weight", (hd,), "norm"
        yield p + "mlp.gate.weight", (n, hidden), "router"
        yield p + "mlp.switch_mlp.gate_proj.weight", (n, moe_inter, hidden), "linear"
        yield p + "mlp.switch_mlp.up_proj.weight", (n, moe_inter, hidden), "linear"
        yield p + "mlp.switch_mlp.down_proj.weight", (n, hidden, moe_inter), "linear"
        yield p + "mlp.shared_expert.gate_proj.weight", (shared, hidden), "linear"
        yield p + "mlp.shared_expert.up_proj.weight", (shared, hidden), "linear"
        yield p + "mlp.shared_expert.down_proj.weight", (hidden, shared), "linear"
        yield p + "mlp.shared_expert_gate.weight", (1, hidden), "router"
        yield p + "input_layernorm.weight", (hidden,), "norm"
        yield p + "post_attention_layernorm.weight", (hidden,), "norm"
    yield m + "norm.weight", (hidden,), "norm"
    if not config["tie_word_embeddings"]:
        yield "language_model.lm_head.weight", (config["vocab_size"], hidden), "linear"


__all__ = ["next_config", "next_multimodal_config", "next_tensors", "next_to_mlx_layout", "next_weights",
           "quantize_next"]

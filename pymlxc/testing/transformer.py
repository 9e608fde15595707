"""The standard decoder block's tensors (attention, MLP or experts, RMSNorms) in HF names, and the
config fields of the families built of it; one list of tensors serves the tiny writer (numpy) and
the real-shape writer (MLX)."""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from .moe import is_moe_layer, moe_tensors

if TYPE_CHECKING:
    from .specs import ArchSpec

Tensor = tuple[str, tuple[int, ...], str]  # HF name, shape, kind: "embedding", "linear", "norm" or "bias"


def tensors(config: Mapping[str, Any], spec: ArchSpec) -> Iterator[Tensor]:
    """Every tensor of a model whose blocks are the standard one, in the checkpoint's order."""
    hidden, inter, hd = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q_out, kv_out = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    yield "model.embed_tokens.weight", (config["vocab_size"], hidden), "embedding"
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        yield p + "self_attn.q_proj.weight", (q_out, hidden), "linear"
        yield p + "self_attn.k_proj.weight", (kv_out, hidden), "linear"
        yield p + "self_attn.v_proj.weight", (kv_out, hidden), "linear"
        yield p + "self_attn.o_proj.weight", (hidden, q_out), "linear"
        if spec.qkv_bias:
            for name, dim in (("q", q_out), ("k", kv_out), ("v", kv_out)):
                yield p + f"self_attn.{name}_proj.bias", (dim,), "bias"
        if spec.qk_norm:
            yield p + "self_attn.q_norm.weight", (hd,), "norm"
            yield p + "self_attn.k_norm.weight", (hd,), "norm"
        if spec.moe and is_moe_layer(config, i):
            yield from moe_tensors(config, p)
        else:
            yield p + "mlp.gate_proj.weight", (inter, hidden), "linear"
            yield p + "mlp.up_proj.weight", (inter, hidden), "linear"
            yield p + "mlp.down_proj.weight", (hidden, inter), "linear"
        yield p + "input_layernorm.weight", (hidden,), "norm"
        yield p + "post_attention_layernorm.weight", (hidden,), "norm"
        if spec.sandwich_norms:
            yield p + "pre_feedforward_layernorm.weight", (hidden,), "norm"
            yield p + "post_feedforward_layernorm.weight", (hidden,), "norm"
    yield "model.norm.weight", (hidden,), "norm"
    if not config["tie_word_embeddings"]:
        yield "lm_head.weight", (config["vocab_size"], hidden), "linear"


# -- the families' config.json fields (beside the shared ones the writer sets) ----------------------
def llama_fields(arch: str, *, num_layers: int, head_dim: int, vocab_size: int,
                 rope_scaling: Mapping[str, Any] | None) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0 if arch == "llama" else 1000000.0, "hidden_act": "silu",
        "mlp_bias": False, "rope_scaling": dict(rope_scaling) if rope_scaling else None,
        "architectures": ["LlamaForCausalLM" if arch == "llama" else "MistralForCausalLM"],
    }
    if arch == "mistral":
        fields["sliding_window"] = None
    return fields


def qwen_fields(arch: str, *, num_layers: int, head_dim: int, vocab_size: int,
                rope_scaling: Mapping[str, Any] | None) -> dict[str, Any]:
    return {"rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "hidden_act": "silu", "rope_scaling": rope_scaling,
            "use_sliding_window": False, "sliding_window": None, "max_window_layers": num_layers,
            "architectures": ["Qwen2ForCausalLM" if arch == "qwen2" else "Qwen3ForCausalLM"]}


def gemma2_fields(arch: str, *, num_layers: int, head_dim: int, vocab_size: int,
                  rope_scaling: Mapping[str, Any] | None) -> dict[str, Any]:
    return {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "gelu_pytorch_tanh",
            "hidden_activation": "gelu_pytorch_tanh", "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": 30.0, "query_pre_attn_scalar": head_dim,
            "sliding_window": 4096, "cache_implementation": "hybrid", "architectures": ["Gemma2ForCausalLM"]}


def gemma3_fields(arch: str, *, num_layers: int, head_dim: int, vocab_size: int,
                  rope_scaling: Mapping[str, Any] | None) -> dict[str, Any]:
    pattern = min(2, num_layers)  # tiny: alternate sliding and global so both kinds are exercised
    return {"rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
            "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": head_dim,
            "sliding_window": 16, "sliding_window_pattern": pattern, "rope_scaling": rope_scaling,
            "layer_types": ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                            for i in range(num_layers)],
            "attn_logit_softcapping": None, "final_logit_softcapping": None, "cache_implementation": "hybrid",
            "architectures": ["Gemma3ForCausalLM"]}


__all__ = ["Tensor", "gemma2_fields", "gemma3_fields", "llama_fields", "qwen_fields", "tensors"]

"""Mixture-of-experts pieces shared by the Qwen MoE, Gemma 4 and Qwen 3.5 writers: Qwen's expert
config and HF tensors, and mlx-lm's stacked-expert layout and quantization."""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from .quantize import ROUTER_QUANT, quantize_affine


def moe_config(arch: str, *, num_layers: int) -> dict[str, Any]:
    """4 experts, top 2. Qwen 3 MoE renormalises the top-k and (with 2+ layers) keeps its last
    layer dense through `mlp_only_layers`; Qwen 2 MoE adds the gated shared expert."""
    config: dict[str, Any] = {
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "hidden_act": "silu", "rope_scaling": None,
        "use_sliding_window": False, "sliding_window": None, "max_window_layers": num_layers,
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "decoder_sparse_step": 1,
        "norm_topk_prob": arch == "qwen3_moe", "output_router_logits": False, "router_aux_loss_coef": 0.001,
        "mlp_only_layers": [num_layers - 1] if arch == "qwen3_moe" and num_layers > 1 else [],
        "architectures": ["Qwen3MoeForCausalLM" if arch == "qwen3_moe" else "Qwen2MoeForCausalLM"],
    }
    if arch == "qwen2_moe":
        config["shared_expert_intermediate_size"] = 64
    return config


def is_moe_layer(config: Mapping[str, Any], i: int) -> bool:
    return i not in config["mlp_only_layers"] and (i + 1) % config["decoder_sparse_step"] == 0


def moe_tensors(config: Mapping[str, Any], p: str) -> Iterator[tuple[str, tuple[int, ...], str]]:
    """HF's layout of one MoE layer `p`: a router `mlp.gate` and each expert apart
    (`mlp.experts.E.up_proj`), then the gated shared expert where the config has one."""
    hidden, inter, n = config["hidden_size"], config["moe_intermediate_size"], config["num_experts"]
    yield p + "mlp.gate.weight", (n, hidden), "linear"
    for e in range(n):
        yield p + f"mlp.experts.{e}.gate_proj.weight", (inter, hidden), "linear"
        yield p + f"mlp.experts.{e}.up_proj.weight", (inter, hidden), "linear"
        yield p + f"mlp.experts.{e}.down_proj.weight", (hidden, inter), "linear"
    if "shared_expert_intermediate_size" in config:
        shared = config["shared_expert_intermediate_size"]
        yield p + "mlp.shared_expert.gate_proj.weight", (shared, hidden), "linear"
        yield p + "mlp.shared_expert.up_proj.weight", (shared, hidden), "linear"
        yield p + "mlp.shared_expert.down_proj.weight", (hidden, shared), "linear"
        yield p + "mlp.shared_expert_gate.weight", (1, hidden), "linear"


def to_switch_layout(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """HF expert tensors -> mlx-lm's stacked ones (what mlx-lm writes when it quantizes)."""
    out: dict[str, np.ndarray] = {}
    experts: dict[str, dict[int, np.ndarray]] = {}
    for name, value in weights.items():
        if ".mlp.experts." in name:  # Qwen: mlp.experts.E.P.weight -> mlp.switch_mlp.P.weight
            head, rest = name.split(".mlp.experts.")
            e, proj = rest.split(".", 1)
            experts.setdefault(f"{head}.mlp.switch_mlp.{proj}", {})[int(e)] = value
        elif name.endswith(".experts.gate_up_proj"):  # Gemma 4: split the fused gate/up
            base = name[: -len(".gate_up_proj")] + ".switch_glu"
            out[base + ".gate_proj.weight"], out[base + ".up_proj.weight"] = np.split(value, 2, axis=-2)
        elif name.endswith(".experts.down_proj"):
            out[name[: -len(".down_proj")] + ".switch_glu.down_proj.weight"] = value
        else:
            out[name] = value
    for name, by_expert in experts.items():
        out[name] = np.stack([by_expert[e] for e in sorted(by_expert)])
    return out


def quantize_switch(weights: dict[str, np.ndarray], arch: str, group_size: int,
                    bits: int) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Quantize as mlx-lm does for these families: every Linear, Embedding and expert stack whose
    input size fits the group, the routers at 8 bits (recorded as per-layer overrides)."""
    out: dict[str, np.ndarray] = {}
    overrides: dict[str, Any] = {}
    for name, value in to_switch_layout(weights).items():
        stem = name[: -len(".weight")]
        router = name.endswith((".mlp.gate.weight", ".router.proj.weight"))
        params = ROUTER_QUANT if router else {"group_size": group_size, "bits": bits}
        tower = "vision" in name
        if (name.endswith(".weight") and value.ndim >= 2 and not tower
                and value.shape[-1] % params["group_size"] == 0):
            out[name], out[stem + ".scales"], out[stem + ".biases"] = quantize_affine(value, **params)
            if router:  # keyed by mlx-lm's module path (gemma4: language_model.model.layers...)
                key = ("language_model.model." + stem[len("model.language_model."):]
                       if stem.startswith("model.language_model.") else stem)
                overrides[key] = dict(params)
        else:
            out[name] = value
    return out, overrides


__all__ = ["is_moe_layer", "moe_config", "moe_tensors", "quantize_switch", "to_switch_layout"]

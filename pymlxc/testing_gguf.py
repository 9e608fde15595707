"""Write GGUF files from Hugging Face model directories, the way llama.cpp's converter does: for
tests (tiny models) and for `benchmarks/compare_llama_cpp.py` (random real-shape models that
llama.cpp's own tools then quantize). Needs the `gguf` extra.

The names come from the `gguf` package's own `TensorNameMap` and the special ids, merges and chat
template from its `SpecialVocab`, so the reader in `backends/metal/formats/gguf.py` is checked against an
independent writer. The converter's conventions are applied here on purpose:
Llama's q/k rows permuted for interleaved RoPE, Gemma's norms stored as 1 + w, Llama 3's RoPE scaling
as a `rope_freqs` tensor, 1-D tensors kept in F32; for Qwen3-Next and Qwen 3.5 those of
`_gated_delta_tensors` (A_log as -exp(A_log), squeezed conv weights, norms as 1 + w, Qwen3-Next's
q|k|v|z split, Qwen 3.5's value heads tiled, the multi-token prediction block after the model's).
"""
from __future__ import annotations

import json
import math
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QType
from safetensors.numpy import load_file, save_file

ARCH = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3,
        "gemma2": gguf.MODEL_ARCH.GEMMA2, "gemma3_text": gguf.MODEL_ARCH.GEMMA3, "gemma3": gguf.MODEL_ARCH.GEMMA3,
        "qwen2_moe": gguf.MODEL_ARCH.QWEN2MOE, "qwen3_moe": gguf.MODEL_ARCH.QWEN3MOE,
        "gemma4": gguf.MODEL_ARCH.GEMMA4, "gemma4_text": gguf.MODEL_ARCH.GEMMA4,
        "qwen3_next": gguf.MODEL_ARCH.QWEN3NEXT, "qwen3_5": gguf.MODEL_ARCH.QWEN35,
        "qwen3_5_moe": gguf.MODEL_ARCH.QWEN35MOE}
GATED_DELTA = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
LEGACY = (QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1, QType.Q8_0)  # gguf.quants writes these
K_QUANTS = (QType.Q2_K, QType.Q3_K, QType.Q4_K, QType.Q5_K, QType.Q6_K)  # encode_k writes these


def _permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    # llama.cpp's convert: rows of each head go from halves to interleaved pairs.
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_rope_factors(config: Mapping[str, Any], head_dim: int) -> np.ndarray:
    scaling = config["rope_scaling"]
    base = config.get("rope_theta", 10000.0)
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factor = scaling.get("factor", 8.0)
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old = scaling.get("original_max_position_embeddings", 8192)
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def _encode(w: np.ndarray, qtype: QType, named: bool = False) -> tuple[np.ndarray, QType, np.ndarray]:
    """(data to write, its type, the float32 values a reader must find: gguf's dequantization).
    Vectors stay F32 unless `named` (extra_types names them: a file llama.cpp would not write)."""
    if (w.ndim == 1 and not named) or qtype == QType.F32:
        return w.astype(np.float32), QType.F32, w.astype(np.float32)
    if qtype == QType.F16:
        return w.astype(np.float16), QType.F16, w.astype(np.float16).astype(np.float32)
    data = encode_k(w, qtype) if qtype in K_QUANTS else gguf.quants.quantize(w.astype(np.float32), qtype)
    return data, qtype, gguf.quants.dequantize(data, qtype).reshape(w.shape)


def _stack_experts(weights: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], set[str]]:
    """HF's per-expert tensors -> llama.cpp's stacked `mlp.experts.P` [E, out, in] (named as the
    name map knows them), in the order of the first expert's key; and the stacked names."""
    out: dict[str, np.ndarray] = {}
    groups: dict[str, dict[int, np.ndarray]] = {}
    for name, w in weights.items():
        parts = name.split(".")
        if len(parts) > 6 and parts[4] == "experts" and parts[5].isdigit():
            key = ".".join(parts[:5] + parts[6:])
            if key not in groups:
                groups[key] = {}
                out[key] = w  # a placeholder keeping the order
            groups[key][int(parts[5])] = w
        else:
            out[name] = w
    for key, experts in groups.items():
        out[key] = np.stack([experts[e] for e in range(len(experts))])
    return out, set(groups)


_GEMMA4_SPECIAL = {"experts.gate_up_proj": "ffn_gate_up_exps.weight", "experts.down_proj": "ffn_down_exps.weight",
                   "router.scale": "ffn_gate_inp.scale", "router.per_expert_scale": "ffn_down_exps.scale",
                   "layer_scalar": "layer_output_scale.weight"}


def _gemma4_name(hf: str, names: gguf.TensorNameMap) -> str | None:
    """The GGUF name llama.cpp's converter gives a Gemma 4 tensor; None for the vision/audio towers."""
    name = hf.replace("model.language_model.", "model.")
    parts = name.split(".")
    if len(parts) > 3 and parts[:2] == ["model", "layers"]:
        special = _GEMMA4_SPECIAL.get(".".join(parts[3:]))
        if special is not None:
            return f"blk.{parts[2]}.{special}"
    stem, _, suffix = name.rpartition(".")
    found = names.get_name(stem)
    return f"{found}.{suffix}" if found else None


def _gemma4_metadata(writer: gguf.GGUFWriter, text: Mapping[str, Any]) -> None:
    """Gemma 4's keys as llama.cpp's converter writes them (per-layer arrays, two head sizes)."""
    layers, shared = text["num_hidden_layers"], text.get("num_kv_shared_layers", 0)
    swa = [t == "sliding_attention" for t in text["layer_types"]]
    ff, first = text["intermediate_size"], layers - shared
    wide = text.get("use_double_wide_mlp", False)
    writer.add_feed_forward_length([ff * 2 if wide and i >= first else ff for i in range(layers)] if wide else ff)
    kv, kv_full = text["num_key_value_heads"], text.get("num_global_key_value_heads")
    writer.add_head_count_kv([kv if s else kv_full for s in swa] if kv_full is not None else kv)
    writer.add_key_length(text["global_head_dim"])
    writer.add_value_length(text["global_head_dim"])
    writer.add_key_length_swa(text["head_dim"])
    writer.add_value_length_swa(text["head_dim"])
    rope = text["rope_parameters"]
    writer.add_rope_freq_base(rope["full_attention"]["rope_theta"])
    writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    writer.add_rope_dimension_count(text["global_head_dim"])
    writer.add_rope_dimension_count_swa(int(text["head_dim"] * text.get("partial_rotary_factor", 1.0)))
    writer.add_shared_kv_layers(shared)
    writer.add_embedding_length_per_layer_input(text.get("hidden_size_per_layer_input") or 0)
    writer.add_sliding_window_pattern(swa)
    writer.add_sliding_window(text["sliding_window"])
    writer.add_final_logit_softcapping(text["final_logit_softcapping"])
    if text.get("enable_moe_block"):
        writer.add_expert_count(text["num_experts"])
        writer.add_expert_used_count(text["top_k_experts"])
        writer.add_expert_feed_forward_length(text["moe_intermediate_size"])


def _extra_name(stem: str) -> str | None:
    """Names the name map of this gguf version lacks: Qwen 2 MoE's shared expert, and the dense MLP
    of a MoE model's `mlp_only_layers` (llama.cpp's qwen3moe has none; pymlxc reads them)."""
    parts = stem.split(".")
    table = {"shared_expert.gate_proj": "ffn_gate_shexp", "shared_expert.up_proj": "ffn_up_shexp",
             "shared_expert.down_proj": "ffn_down_shexp", "shared_expert_gate": "ffn_gate_inp_shexp",
             "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
    if len(parts) > 4 and parts[:2] == ["model", "layers"] and parts[3] == "mlp":
        found = table.get(".".join(parts[4:]))
        return f"blk.{parts[2]}.{found}" if found else None
    return None


def _unstack_experts(name: str, w: np.ndarray) -> dict[str, np.ndarray]:
    parts = name.split(".")
    if len(parts) > 5 and parts[4] == "experts" and w.ndim == 3:
        return {".".join([*parts[:5], str(e), *parts[5:]]): w[e] for e in range(w.shape[0])}
    return {name: w}


# ---------------------------------------------------------------------- Qwen3-Next and Qwen 3.5

_ALWAYS_F32 = ("ssm_conv1d.weight", "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")  # as the converter keeps them


def _gated_delta_metadata(writer: gguf.GGUFWriter, text: Mapping[str, Any], model_type: str, head_dim: int) -> None:
    """The keys of llama.cpp's Qwen3NextModel / Qwen3_5TextModel converters."""
    rope = text.get("rope_parameters") or {}
    partial = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
    writer.add_rope_freq_base(rope.get("rope_theta", text.get("rope_theta", 10000.0)))
    writer.add_rope_dimension_count(int(head_dim * partial))
    writer.add_ssm_conv_kernel(text["linear_conv_kernel_dim"])
    writer.add_ssm_state_size(text["linear_key_head_dim"])
    writer.add_ssm_group_count(text["linear_num_key_heads"])
    writer.add_ssm_time_step_rank(text["linear_num_value_heads"])
    writer.add_ssm_inner_size(text["linear_value_head_dim"] * text["linear_num_value_heads"])
    writer.add_full_attention_interval(text.get("full_attention_interval", 4))
    if text.get("layer_types") is not None:  # newer converters: per layer, the MTP block last (not recurrent)
        writer.add_array(f"{writer.arch}.attention.recurrent_layers",
                         [t == "linear_attention" for t in text["layer_types"]] + [False])
    if model_type != "qwen3_next":
        sections = list(rope.get("mrope_section", [11, 11, 10]))
        writer.add_rope_dimension_sections((sections + [0] * 4)[:4])
    writer.add_nextn_predict_layers(1)


def _tiled(w: np.ndarray, axis: int, key_heads: int, value_heads: int, head: int) -> np.ndarray:
    """The converter's `_reorder_v_heads`: value heads grouped by key head -> tiled, along `axis`."""
    w = np.moveaxis(w, axis, 0)
    shape = w.shape
    w = w.reshape(key_heads, value_heads // key_heads, head, *shape[1:]).swapaxes(0, 1).reshape(shape)
    return np.moveaxis(w, 0, axis)


def _untiled(w: np.ndarray, axis: int, key_heads: int, value_heads: int, head: int) -> np.ndarray:
    w = np.moveaxis(w, axis, 0)
    shape = w.shape
    w = w.reshape(value_heads // key_heads, key_heads, head, *shape[1:]).swapaxes(0, 1).reshape(shape)
    return np.moveaxis(w, 0, axis)


Parts = list[tuple[str, np.ndarray]]


def _gated_delta_tensors(hf: str, w: np.ndarray, text: Mapping[str, Any], model_type: str, layers: int,
                         names: gguf.TensorNameMap) -> tuple[Parts, Any]:
    """HF tensor -> ([(GGUF name, float32 data)], inverse: the written parts' values -> the HF
    tensor a reader must rebuild). No parts: a tensor the converter leaves out (the vision tower)."""
    nk, nv = text["linear_num_key_heads"], text["linear_num_value_heads"]
    dk, dv = text["linear_key_head_dim"], text["linear_value_head_dim"]
    qk = 2 * nk * dk
    tile = model_type != "qwen3_next" and nk != nv
    name = hf.replace("model.language_model.", "model.")
    if name.startswith(("model.visual.", "visual.")):
        return [], None
    if name.startswith("mtp."):  # the converter's MTP block: numbered after the model's layers
        return [(f"blk.{layers}.nextn.eh_proj.weight", w)] if name == "mtp.fc.weight" else [], lambda v: w
    parts = name.split(".")
    blk = f"blk.{parts[2]}" if parts[:2] == ["model", "layers"] else None
    leaf = ".".join(parts[3:]) if blk else ""

    def same(v: list[np.ndarray]) -> np.ndarray:
        return v[0]

    def v_rows(v: np.ndarray, head: int, undo: bool = False) -> np.ndarray:
        return (_untiled if undo else _tiled)(v, 0, nk, nv, head) if tile else v

    def qkv_rows(v: np.ndarray, undo: bool = False) -> np.ndarray:
        return np.concatenate([v[:qk], v_rows(v[qk:], dv, undo)]) if tile else v

    if leaf == "linear_attn.A_log":
        a = -np.exp(v_rows(w, 1))
        return [(f"{blk}.ssm_a", a)], lambda v: v_rows(np.log(-v[0]).astype(np.float32), 1, undo=True)
    if leaf == "linear_attn.dt_bias":
        return [(f"{blk}.ssm_dt.bias", v_rows(w, 1))], lambda v: v_rows(v[0], 1, undo=True)
    if leaf == "linear_attn.conv1d.weight":
        return [(f"{blk}.ssm_conv1d.weight", qkv_rows(w[:, 0]))], lambda v: qkv_rows(v[0], undo=True)[:, None]
    if leaf == "linear_attn.in_proj_qkv.weight":
        return [(f"{blk}.attn_qkv.weight", qkv_rows(w))], lambda v: qkv_rows(v[0], undo=True)
    if leaf == "linear_attn.in_proj_z.weight":
        return [(f"{blk}.attn_gate.weight", v_rows(w, dv))], lambda v: v_rows(v[0], dv, undo=True)
    if leaf in ("linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight"):
        gguf_name = "ssm_beta" if leaf.endswith("_b.weight") else "ssm_alpha"
        return [(f"{blk}.{gguf_name}.weight", v_rows(w, 1))], lambda v: v_rows(v[0], 1, undo=True)
    if leaf == "linear_attn.out_proj.weight":
        def cols(x: np.ndarray, undo: bool = False) -> np.ndarray:
            return (_untiled if undo else _tiled)(x, 1, nk, nv, dv) if tile else x
        return [(f"{blk}.ssm_out.weight", cols(w))], lambda v: cols(v[0], undo=True)
    if leaf == "linear_attn.in_proj_qkvz.weight":  # [q, k, v, z] per key head -> all q, k, v | all z
        per = nv // nk * dv
        g = w.reshape(nk, 2 * dk + 2 * per, -1)
        q, k, v, z = np.split(g, [dk, 2 * dk, 2 * dk + per], axis=1)
        flat = [x.reshape(-1, w.shape[-1]) for x in (q, k, v, z)]

        def regroup(vals: list[np.ndarray]) -> np.ndarray:
            qkv, zz = vals
            qq, kk, vv = np.split(qkv, [nk * dk, 2 * nk * dk])
            return np.concatenate([x.reshape(nk, -1, w.shape[-1]) for x in (qq, kk, vv, zz)], axis=1).reshape(w.shape)
        return [(f"{blk}.attn_qkv.weight", np.concatenate(flat[:3])), (f"{blk}.attn_gate.weight", flat[3])], regroup
    if leaf == "mlp.experts.gate_up_proj":  # the converter splits HF's fused experts
        mid = w.shape[-2] // 2
        return ([(f"{blk}.ffn_gate_exps.weight", w[..., :mid, :]), (f"{blk}.ffn_up_exps.weight", w[..., mid:, :])],
                lambda v: np.concatenate(v, axis=-2))
    if leaf == "mlp.experts.down_proj":
        return [(f"{blk}.ffn_down_exps.weight", w)], same
    stem, _, suffix = name.rpartition(".")
    found = names.get_name(stem) or _extra_name(stem)
    if found is None:
        raise ValueError(f"{hf}: no GGUF name for this tensor")
    if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        return [(f"{found}.{suffix}", w + np.float32(1))], lambda v: v[0] - np.float32(1)  # HF: the offset from 1
    return [(f"{found}.{suffix}", w)], same


def _write_tokenizer(writer: gguf.GGUFWriter, model_dir: Path, pre: str) -> None:
    data = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    vocab: dict[str, int] = dict(data["model"]["vocab"])
    added = {t["id"]: t for t in data.get("added_tokens", [])}
    n = max([*vocab.values(), *added]) + 1
    tokens = [""] * n
    types = [gguf.TokenType.NORMAL] * n
    for text, i in vocab.items():
        tokens[i] = text
    for i, t in added.items():
        tokens[i] = t["content"]
        types[i] = gguf.TokenType.CONTROL if t.get("special") else gguf.TokenType.USER_DEFINED
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([int(t) for t in types])
    gguf.SpecialVocab(model_dir, load_merges=True, n_vocab=n).add_to_gguf(writer, quiet=True)


def _load_weights(model_dir: Path) -> dict[str, np.ndarray]:
    """Every tensor of the directory's safetensors files (one file or shards), in file order.
    numpy has no bfloat16: a bfloat16 checkpoint is an error that says so."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors file in {model_dir}")
    weights: dict[str, np.ndarray] = {}
    for f in files:
        try:
            weights.update(load_file(str(f)))
        except TypeError as exc:
            raise ValueError(f"{f}: cannot read its tensors with numpy ({exc}); write the model in "
                             "float16 or float32") from exc
    return weights


def export_gguf(model_dir: str | Path, out: str | Path, qtype: QType = QType.F32, *, pre: str = "gpt-2",
                tokenizer: bool = True, skip: Sequence[str] = (), extra_types: Mapping[str, QType] | None = None,
                twin: str | Path | None = None) -> Path:
    """Write the model at `model_dir` as one GGUF file at `out`. 2-D and 3-D weights get `qtype` (or
    the type `extra_types` names for a GGUF tensor name, vectors too: a hostile file); `skip` drops
    GGUF tensor names. `twin`: also write there a copy of `model_dir` whose safetensors hold, in HF
    layout, exactly the float32 values that `gguf.quants.dequantize` gives for the written tensors
    (the reference model)."""
    model_dir, out = Path(model_dir), Path(out)
    config = json.loads((model_dir / "config.json").read_text())
    text = config.get("text_config", config)
    model_type = config["model_type"]
    arch = ARCH[model_type]
    arch_name = gguf.MODEL_ARCH_NAMES[arch]
    layers = text["num_hidden_layers"]
    heads, kv_heads = text["num_attention_heads"], text["num_key_value_heads"]
    head_dim = text.get("head_dim") or text["hidden_size"] // heads
    names = gguf.get_tensor_name_map(arch, layers)

    writer = gguf.GGUFWriter(str(out), arch_name)
    writer.add_name(model_dir.name)
    writer.add_block_count(layers + (1 if model_type in GATED_DELTA else 0))  # + the MTP block
    writer.add_context_length(text["max_position_embeddings"])
    writer.add_embedding_length(text["hidden_size"])
    writer.add_head_count(heads)
    writer.add_layer_norm_rms_eps(text["rms_norm_eps"])
    writer.add_vocab_size(text["vocab_size"])
    gemma4 = model_type.startswith("gemma4")
    gated = model_type in GATED_DELTA
    if gemma4:
        _gemma4_metadata(writer, text)
    elif gated:
        if text.get("intermediate_size"):
            writer.add_feed_forward_length(text["intermediate_size"])
        writer.add_head_count_kv(kv_heads)
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        _gated_delta_metadata(writer, text, model_type, head_dim)
    else:
        writer.add_feed_forward_length(text["intermediate_size"])
        writer.add_head_count_kv(kv_heads)
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_rope_freq_base(text["rope_theta"])
        writer.add_rope_dimension_count(head_dim)
    if model_type == "gemma2":
        writer.add_attn_logit_softcapping(text["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(text["final_logit_softcapping"])
        writer.add_sliding_window(text["sliding_window"])
    if "num_experts" in text and not gemma4:
        writer.add_expert_count(text["num_experts"])
        writer.add_expert_used_count(text["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(text["moe_intermediate_size"])
        if text.get("shared_expert_intermediate_size"):
            writer.add_expert_shared_feed_forward_length(text["shared_expert_intermediate_size"])
    if model_type in ("gemma3", "gemma3_text"):
        writer.add_sliding_window(text["sliding_window"])
        writer.add_sliding_window_pattern(text["sliding_window_pattern"])  # llama.cpp assumes 6 without it
    scaling = text.get("rope_scaling") or {}
    if scaling.get("rope_type", scaling.get("type")) == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(scaling["factor"])
    if tokenizer:
        _write_tokenizer(writer, model_dir, pre)

    weights = {k.removeprefix("language_model."): v for k, v in _load_weights(model_dir).items()}
    weights, stacked = _stack_experts(weights)
    if gated:
        _finish(writer, model_dir, twin, _write_gated_delta(writer, weights, stacked, text, model_type, layers, names,
                                                            qtype, extra_types or {}, skip))
        return out
    gemma = model_type in ("gemma2", "gemma3", "gemma3_text")  # norms stored as 1 + w (not Gemma 4's)
    reference: dict[str, np.ndarray] = {}
    for hf, w in weights.items():
        name: str | None
        if gemma4:
            full = _gemma4_name(hf, names)
            if full is None:  # the vision and audio towers
                reference[hf] = w
                continue
            name, suffix = full.rsplit(".", 1)
            stem = hf
        else:
            stem, _, suffix = hf.rpartition(".")
            name = names.get_name(stem) or _extra_name(stem)
        assert name is not None, hf
        w = w.astype(np.float32)
        order = None
        if model_type == "llama" and stem.endswith(("q_proj", "k_proj")):
            order = _permute(np.arange(w.shape[0]), heads if stem.endswith("q_proj") else kv_heads)
            w = w[order]
        if gemma and hf.endswith("norm.weight"):
            w = w + 1
        full = f"{name}.{suffix}"
        if full in skip:
            continue
        data, t, values = _encode(w, (extra_types or {}).get(full, qtype), named=full in (extra_types or {}))
        writer.add_tensor(full, data, raw_dtype=t if t not in (QType.F32, QType.F16) else None)
        if gemma and hf.endswith("norm.weight"):
            values = values - np.float32(1)  # as the reader undoes it, in float32
        if order is not None:
            values = values[np.argsort(order)]
        reference.update(_unstack_experts(hf, values) if hf in stacked else {hf: values})
    if scaling.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", _llama3_rope_factors(text, head_dim))
    if gemma4:  # the full layers' proportional RoPE: 1 for rotated pairs, 1e30 for fixed ones
        full = text["rope_parameters"]["full_attention"]
        rotated = int(text["global_head_dim"] * full.get("partial_rotary_factor", 1.0) / 2)
        fixed = text["global_head_dim"] // 2 - rotated
        writer.add_tensor("rope_freqs.weight", np.array([1.0] * rotated + [1e30] * fixed, np.float32))
    _finish(writer, model_dir, twin, reference)
    return out


def _finish(writer: gguf.GGUFWriter, model_dir: Path, twin: str | Path | None,
            reference: dict[str, np.ndarray]) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if twin is not None:
        shutil.copytree(model_dir, twin)
        save_file(reference, str(Path(twin) / "model.safetensors"))


def _write_gated_delta(writer: gguf.GGUFWriter, weights: Mapping[str, np.ndarray], stacked: set[str],
                       text: Mapping[str, Any], model_type: str, layers: int, names: gguf.TensorNameMap, qtype: QType,
                       extra_types: Mapping[str, QType], skip: Sequence[str]) -> dict[str, np.ndarray]:
    """Qwen3-Next / Qwen 3.5 tensors as the converter writes them; the HF-layout reference."""
    reference: dict[str, np.ndarray] = {}
    for hf, w in weights.items():
        parts, inverse = _gated_delta_tensors(hf, w.astype(np.float32), text, model_type, layers, names)
        if not parts:
            reference[hf] = w
            continue
        values = []
        for full, data in parts:
            if full in skip:
                continue
            kind = extra_types.get(full, QType.F32 if full.endswith(_ALWAYS_F32) else qtype)
            encoded, t, value = _encode(np.ascontiguousarray(data), kind)
            writer.add_tensor(full, encoded, raw_dtype=t if t not in (QType.F32, QType.F16) else None)
            values.append(value)
        if len(values) == len(parts):
            result = np.ascontiguousarray(inverse(values))  # safetensors writes the buffer as it lies
            reference.update(_unstack_experts(hf, result) if hf in stacked else {hf: result})
    return reference


def write_spm_gguf(out: str | Path, spm_dir: str | Path, *, add_space_prefix: bool = True,
                   user_defined: Sequence[str] = (), arch: str = "llama",
                   extra: Mapping[str, Any] | None = None) -> Path:
    """A tokenizer-only GGUF (tiny dummy tensor) from a SentencePiece `tokenizer.model` in `spm_dir`."""
    import sentencepiece as spm

    proc = spm.SentencePieceProcessor(model_file=str(Path(spm_dir) / "tokenizer.model"))
    vocab = gguf.vocab.SentencePieceVocab(Path(spm_dir))
    tokens, scores, types = (list(x) for x in zip(*vocab.all_tokens(), strict=True))
    # SentencePieceVocab leaves user-defined pieces NORMAL; llama.cpp's converter marks them.
    types = [gguf.TokenType.USER_DEFINED if t.decode() in user_defined else k
             for t, k in zip(tokens, types, strict=True)]
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_tokenizer_model("llama")
    writer.add_token_list([t.decode("utf-8") for t in tokens])
    writer.add_token_scores(list(scores))
    writer.add_token_types([int(t) for t in types])
    writer.add_bos_token_id(proc.bos_id())
    writer.add_eos_token_id(proc.eos_id())
    writer.add_unk_token_id(proc.unk_id())
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(add_space_prefix)
    for key, value in (extra or {}).items():
        writer.add_string(key, value)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(out)


# ---------------------------------------------------------------------- K-quant encoders (test side)
# The `gguf` package dequantizes every type but quantizes only the legacy ones. These encoders make
# valid K-quant blocks near `w` (plain min/max choices, not llama.cpp's search): tests compare a
# loaded file against the package's own dequantization of the very blocks written, so how close the
# blocks are to `w` only keeps the tiny models' logits in a sane range.

def _q(x: np.ndarray, scale: np.ndarray, lo: int, hi: int) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(scale != 0, np.rint(x / np.where(scale != 0, scale, 1)), 0)
    return np.clip(q, lo, hi).astype(np.int16)


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _crumbs(q: np.ndarray) -> np.ndarray:
    """256 2-bit values -> 64 bytes: value 128h + 32s + j at bits 2s of byte 32h + j."""
    q = q.reshape(-1, 2, 4, 32).astype(np.uint8)
    packed: np.ndarray = (q[:, :, 0] | (q[:, :, 1] << 2) | (q[:, :, 2] << 4) | (q[:, :, 3] << 6)).reshape(-1, 64)
    return packed


def _k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins -> the 12 bytes of Q4_K/Q5_K."""
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    out = np.empty((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    return out


def _min_max_blocks(x: np.ndarray, sub: int, levels: int, scale_levels: int) -> tuple[np.ndarray, ...]:
    """Per sub-block of `sub`: w = d*sc*q - dmin*m, q < levels, sc and m < scale_levels."""
    x = x.reshape(x.shape[0], -1, sub)
    low = np.minimum(x.min(-1), 0)
    scale = (x.max(-1) - low) / (levels - 1)
    d = scale.max(-1, keepdims=True) / (scale_levels - 1)
    dmin = (-low).max(-1, keepdims=True) / (scale_levels - 1)
    d, dmin = d.astype(np.float16).astype(np.float32), dmin.astype(np.float16).astype(np.float32)
    sc = _q(scale, d, 0, scale_levels - 1)
    m = _q(-low, dmin, 0, scale_levels - 1)
    q = _q(x + (dmin * m)[..., None], (d * sc)[..., None], 0, levels - 1)
    return d, dmin, sc, m, q


def encode_k(w: np.ndarray, qtype: QType) -> np.ndarray:
    """Float rows (..., n*256) -> K-quant blocks (..., n*type_size) uint8 of Q2_K..Q6_K."""
    shape = w.shape
    if shape[-1] % 256:
        raise ValueError(f"{qtype.name} needs rows of a multiple of 256 values, not {shape[-1]}")
    x = w.astype(np.float32).reshape(-1, 256)
    n = x.shape[0]
    if qtype == QType.Q6_K:
        sub = x.reshape(n, 16, 16)
        amax = np.take_along_axis(sub, np.abs(sub).argmax(-1)[..., None], -1)[..., 0]
        scale = amax / -32
        d = (np.abs(scale).max(-1, keepdims=True) / 127).astype(np.float16).astype(np.float32)
        sc = _q(scale, d, -128, 127)
        # One name for each branch's quantized values, whose shape differs by branch.
        q: np.ndarray = (_q(sub, (d * sc)[..., None], -32, 31) + 32).astype(np.uint8).reshape(n, 2, 128)
        ql = (q[:, :, :64] & 0x0F) | ((q[:, :, 64:] & 0x0F) << 4)
        qh = _crumbs((q >> 4).reshape(n, 256))
        blocks = np.concatenate([ql.reshape(n, 128), qh, sc.astype(np.int8).view(np.uint8), _f16_bytes(d)], -1)
    elif qtype == QType.Q3_K:
        sub = x.reshape(n, 16, 16)
        amax = np.take_along_axis(sub, np.abs(sub).argmax(-1)[..., None], -1)[..., 0]
        scale = amax / -4
        d = (np.abs(scale).max(-1, keepdims=True) / 32).astype(np.float16).astype(np.float32)
        sc = _q(scale, d, -32, 31)
        q = (_q(sub, (d * sc)[..., None], -4, 3) + 4).astype(np.uint8).reshape(n, 256)
        hmask = np.zeros((n, 32), np.uint8)
        for s in range(8):
            hmask |= (q[:, 32 * s:32 * (s + 1)] >> 2) << s
        s6 = (sc + 32).astype(np.uint8)
        shifts = np.array([0, 2, 4, 6], np.uint8)[:, None]
        scales = np.concatenate([(s6[:, :8] & 0x0F) | ((s6[:, 8:] & 0x0F) << 4),
                                 ((s6 >> 4).reshape(n, 4, 4) << shifts).sum(1, dtype=np.uint8)], -1)
        blocks = np.concatenate([hmask, _crumbs(q & 3), scales, _f16_bytes(d)], -1)
    elif qtype == QType.Q2_K:
        d, dmin, sc, m, q = _min_max_blocks(x, 16, 4, 16)
        blocks = np.concatenate([(sc | (m << 4)).astype(np.uint8), _crumbs(q.reshape(n, 256)), _f16_bytes(d),
                                 _f16_bytes(dmin)], -1)
    elif qtype in (QType.Q4_K, QType.Q5_K):
        d, dmin, sc, m, q = _min_max_blocks(x, 32, 16 if qtype == QType.Q4_K else 32, 64)
        q = q.astype(np.uint8).reshape(n, 4, 2, 32)
        qs = ((q[:, :, 0] & 0x0F) | ((q[:, :, 1] & 0x0F) << 4)).reshape(n, 128)
        parts = [_f16_bytes(d), _f16_bytes(dmin), _k_scales(sc, m)]
        if qtype == QType.Q5_K:
            high = (q.reshape(n, 8, 32) >> 4).astype(np.uint8)
            parts.append((high << np.arange(8, dtype=np.uint8)[:, None]).sum(1, dtype=np.uint8))
        blocks = np.concatenate([*parts, qs], -1)
    else:
        raise ValueError(f"{qtype.name} is not a K-quant")
    return blocks.reshape(*shape[:-1], -1)

"""Write GGUF files from tiny Hugging Face model directories, the way llama.cpp's converter does.

Test-side only: the names come from the `gguf` package's own `TensorNameMap` and the special ids,
merges and chat template from its `SpecialVocab`, so the reader in `backends/metal/gguf.py` is
checked against an independent writer. The converter's conventions are applied here on purpose:
Llama's q/k rows permuted for interleaved RoPE, Gemma's norms stored as 1 + w, Llama 3's RoPE scaling
as a `rope_freqs` tensor, 1-D tensors kept in F32.
"""
from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QType
from safetensors.numpy import load_file

ARCH = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3,
        "gemma2": gguf.MODEL_ARCH.GEMMA2, "gemma3_text": gguf.MODEL_ARCH.GEMMA3, "gemma3": gguf.MODEL_ARCH.GEMMA3}
QUANTIZED = (QType.Q8_0, QType.Q4_0, QType.Q4_1)


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


def _encode(w: np.ndarray, qtype: QType) -> tuple[np.ndarray, QType]:
    if w.ndim == 1 or qtype == QType.F32:
        return w.astype(np.float32), QType.F32
    if qtype == QType.F16:
        return w.astype(np.float16), QType.F16
    return gguf.quants.quantize(w.astype(np.float32), qtype), qtype


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


def export_gguf(model_dir: str | Path, out: str | Path, qtype: QType = QType.F32, *, pre: str = "gpt-2",
                tokenizer: bool = True, skip: Sequence[str] = (), extra_types: Mapping[str, QType] | None = None) -> Path:
    """Write the model at `model_dir` as one GGUF file at `out`. 2-D weights get `qtype` (or the
    type `extra_types` names for a GGUF tensor name); `skip` drops GGUF tensor names."""
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
    writer.add_block_count(layers)
    writer.add_context_length(text["max_position_embeddings"])
    writer.add_embedding_length(text["hidden_size"])
    writer.add_feed_forward_length(text["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(text["rms_norm_eps"])
    writer.add_rope_freq_base(text["rope_theta"])
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(text["vocab_size"])
    if model_type == "gemma2":
        writer.add_attn_logit_softcapping(text["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(text["final_logit_softcapping"])
        writer.add_sliding_window(text["sliding_window"])
    if model_type in ("gemma3", "gemma3_text"):
        writer.add_sliding_window(text["sliding_window"])
        writer.add_sliding_window_pattern(text["sliding_window_pattern"])  # llama.cpp assumes 6 without it
    scaling = text.get("rope_scaling") or {}
    if scaling.get("rope_type", scaling.get("type")) == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(scaling["factor"])
    if tokenizer:
        _write_tokenizer(writer, model_dir, pre)

    weights = {k.removeprefix("language_model."): v for k, v in load_file(str(model_dir / "model.safetensors")).items()}
    gemma = model_type.startswith("gemma")
    for hf, w in weights.items():
        stem, _, suffix = hf.rpartition(".")
        name = names.get_name(stem)
        assert name is not None, hf
        w = w.astype(np.float32)
        if model_type == "llama" and stem.endswith(("q_proj", "k_proj")):
            w = _permute(w, heads if stem.endswith("q_proj") else kv_heads)
        if gemma and hf.endswith("norm.weight"):
            w = w + 1
        full = f"{name}.{suffix}"
        if full in skip:
            continue
        data, t = _encode(w, (extra_types or {}).get(full, qtype))
        writer.add_tensor(full, data, raw_dtype=t if t in QUANTIZED or t == QType.BF16 else None)
    if scaling.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", _llama3_rope_factors(text, head_dim))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def write_spm_gguf(out: str | Path, spm_dir: str | Path, *, add_space_prefix: bool = True,
                   user_defined: Sequence[str] = (), arch: str = "llama", extra: Mapping[str, Any] | None = None) -> Path:
    """A tokenizer-only GGUF (tiny dummy tensor) from a SentencePiece `tokenizer.model` in `spm_dir`."""
    import sentencepiece as spm

    proc = spm.SentencePieceProcessor(model_file=str(Path(spm_dir) / "tokenizer.model"))
    vocab = gguf.vocab.SentencePieceVocab(Path(spm_dir))
    tokens, scores, types = (list(x) for x in zip(*vocab.all_tokens()))
    # SentencePieceVocab leaves user-defined pieces NORMAL; llama.cpp's converter marks them.
    types = [gguf.TokenType.USER_DEFINED if t.decode() in user_defined else k for t, k in zip(tokens, types)]
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

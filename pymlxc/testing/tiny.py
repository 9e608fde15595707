"""Tiny random model directories, for smoke tests without downloads.

`write_tiny_model(path, arch)` writes what a Hugging Face checkpoint of that architecture holds:
`config.json`, `generation_config.json`, `tokenizer.json` (a byte-level BPE trained here on a short
built-in text), `tokenizer_config.json` (with the family's chat template), `special_tokens_map.json`
and `model.safetensors` with seeded random weights under the checkpoint's own names, optionally in
mlx-lm's quantized layout. The result loads in mlx-lm and transformers' `AutoTokenizer`. What differs
between architectures is in their `specs.SPECS` entry.

Weights are stored as float32 or float16. bfloat16 cannot be written with `safetensors.numpy`
(numpy has no bfloat16); convert a float32 tiny model if you need it.

CLI: `python -m pymlxc.testing ARCH PATH [--quantize-bits N] [--seed S] [--dtype float16]`.
"""
from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer

from .quantize import QUANTIZE_BITS
from .specs import SPECS, spec_of
from .tokenizer import train_tokenizer

ARCHITECTURES = tuple(SPECS)
DTYPES = ("float32", "float16")
LLAMA3_ROPE_SCALING: dict[str, Any] = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def build_tokenizer(arch: str, vocab_size: int) -> Tokenizer:
    """A byte-level BPE with `arch`'s special tokens, exactly `vocab_size` ids in all."""
    return train_tokenizer(spec_of(arch).tokens, vocab_size, arch)


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_tiny_model(
    path: str | Path,
    arch: str = "llama",
    *,
    seed: int = 0,
    dtype: str = "float32",
    quantize_bits: int | None = None,
    group_size: int = 32,
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_layers: int | None = None,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    tie_word_embeddings: bool | None = None,
    chat_template: str | None = None,
    rope_scaling: Mapping[str, Any] | None = None,
    extra_config: Mapping[str, Any] | None = None,
    mute_special_tokens: bool = True,
) -> Path:
    """Write a tiny random `arch` model directory at `path` (created if needed) and return it.

    `tie_word_embeddings` defaults to the family's usual choice (untied for llama and mistral).
    `chat_template`: None writes the family's template, "" writes none, any other string is used.
    `rope_scaling`: e.g. `LLAMA3_ROPE_SCALING`. `extra_config` is merged into the text model's
    config last (weight shapes follow the merged values, e.g. `head_dim`).
    `mute_special_tokens`: zero the output rows of the special tokens (and so, when tied, their
    embeddings). Random logits have a positive maximum, so greedy decoding then never picks EOS
    and streams run to max_tokens, which tests can count on.
    """
    spec = spec_of(arch)
    family = spec.tokens
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES} (bfloat16 needs a conversion step), got {dtype!r}")
    if quantize_bits is not None and quantize_bits not in QUANTIZE_BITS:
        raise ValueError(f"quantize_bits must be one of {QUANTIZE_BITS}, got {quantize_bits}")
    tie = spec.tied if tie_word_embeddings is None else tie_word_embeddings
    num_layers = num_layers or spec.layers
    if spec.always_tied and not tie:
        raise ValueError(f"{arch} always ties its output projection to the embeddings")
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError("hidden_size must divide by num_heads, and num_heads by num_kv_heads")
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)

    tok = build_tokenizer(arch, vocab_size)
    tok.save(str(root / "tokenizer.json"))
    token_id = tok.token_to_id
    eos_ids = [token_id(t) for t in family.config_eos]
    ids: dict[str, Any] = {
        "bos_token_id": token_id(family.bos) if family.bos else token_id(family.specials[0]),
        # Qwen's config.json names only <|im_end|>; generation_config.json lists both.
        "eos_token_id": eos_ids[0] if arch.startswith("qwen") or len(eos_ids) == 1 else eos_ids,
    }
    if family.pad:
        ids["pad_token_id"] = token_id(family.pad)

    head_dim = hidden_size // num_heads
    text: dict[str, Any] = {
        "model_type": spec.text_model_type or arch,
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "intermediate_size": intermediate_size,
        "vocab_size": vocab_size,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": tie,
        "attention_bias": spec.qkv_bias,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        **ids,
    }
    text.update(spec.fields(arch, num_layers=num_layers, head_dim=head_dim, vocab_size=vocab_size,
                            rope_scaling=rope_scaling))
    text.update(extra_config or {})
    text["torch_dtype"] = dtype
    np_dtype = np.dtype(dtype)
    weights = {spec.rename(k): v.astype(np_dtype)
               for k, v in spec.weights(text, spec, np.random.default_rng(seed)).items()}
    if mute_special_tokens:
        out_name = spec.rename("model.embed_tokens.weight" if tie else "lm_head.weight")
        special_ids = [i for i, added in tok.get_added_tokens_decoder().items() if added.special]
        weights[out_name][special_ids] = 0
    config = text if spec.outer is None else spec.outer(arch, text, ids, dtype)
    if quantize_bits is not None:
        quant: dict[str, Any] = {"group_size": group_size, "bits": quantize_bits, "mode": "affine"}
        weights, overrides = spec.quantize(weights, arch, group_size, quantize_bits)
        quant.update(overrides)
        config["quantization"] = quant
        config["quantization_config"] = dict(quant)
    save_file(weights, str(root / "model.safetensors"), metadata={"format": "pt"})
    _write_json(root / "config.json", config)
    _write_json(root / "generation_config.json", {"bos_token_id": ids["bos_token_id"], "eos_token_id": eos_ids,
                                                  **({"pad_token_id": ids["pad_token_id"]} if family.pad else {})})

    named = {"bos_token": family.bos, "eos_token": family.eos, "unk_token": family.unk, "pad_token": family.pad}
    named = {k: v for k, v in named.items() if v is not None}
    tok_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": text["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
        **named,
    }
    if family.bos is None:
        tok_config["bos_token"] = None
    if family.add_bos_token is not None:
        tok_config["add_bos_token"] = family.add_bos_token
        tok_config["add_eos_token"] = False
    template = family.chat_template if chat_template is None else chat_template
    if template:
        tok_config["chat_template"] = template
    _write_json(root / "tokenizer_config.json", tok_config)
    _write_json(root / "special_tokens_map.json", named)
    return root


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pymlxc.testing", description="Write a tiny random model.")
    parser.add_argument("arch", choices=ARCHITECTURES)
    parser.add_argument("path")
    parser.add_argument("--quantize-bits", type=int, choices=QUANTIZE_BITS)
    parser.add_argument("--group-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--llama3-rope-scaling", action="store_true", help="add Llama 3.1's rope_scaling")
    args = parser.parse_args(argv)
    out = write_tiny_model(args.path, args.arch, seed=args.seed, dtype=args.dtype, quantize_bits=args.quantize_bits,
                           group_size=args.group_size,
                           rope_scaling=LLAMA3_ROPE_SCALING if args.llama3_rope_scaling else None)
    print(out)
    return 0


__all__ = ["ARCHITECTURES", "DTYPES", "LLAMA3_ROPE_SCALING", "build_tokenizer", "main", "write_tiny_model"]

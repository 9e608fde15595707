"""Random-weight model directories of real shapes, written on the fly (no downloads), for the benchmarks.

`write_random_model(path, "llama-3.2-1b", bits=4)` writes what a Hugging Face checkpoint of that
shape holds for loading by pymlxc and mlx-lm: `config.json` (the published config's fields) and
safetensors shards in HF names, bfloat16, or quantized in mlx-lm's layout (packed uint32 `weight`,
bfloat16 `scales`/`biases` per group, `quantization` in the config; every linear and the embedding
quantized, as `mlx_lm.convert -q` does). The tensors are the tiny writer's list for the same
architecture (`specs.SPECS`, `transformer.tensors`). The benchmarks feed token ids;
`write_byte_tokenizer` adds a byte-level BPE `tokenizer.json` of the shape's vocabulary where a file
format needs one (GGUF files carry their vocabulary, and llama.cpp's tools load it).

Qwen 3.5 MoE (`qwen3.5-35b-a3b`: Gated DeltaNet linear attention and 256 experts) is written as an
mlx-community checkpoint after mlx-lm's conversion instead: the multimodal config with the text
fields under `text_config`, tensors under `language_model.` in mlx-lm's layout (stacked experts,
conv1d [C, K, 1] kept dense, norms with the + 1 applied, `qwen_next.next_tensors`), the routers at
8 bits as per-layer entries of `quantization`.

Weights are drawn tensor by tensor with mlx.core's generator directly in bfloat16 (or --dtype; std
1/sqrt(fan_in), so activations stay O(1) through the layers), quantized right away and written in
shards of about 1 GB, so that an 8B model never needs more than a shard of memory and is written in
seconds on a GPU. Values are random: only shapes, dtypes and layouts are real. This module needs
MLX's own Python package (`mlx`, a dependency of pymlxc).

CLI: `python -m pymlxc.testing.shapes SHAPE PATH [--bits 4] [--layers N] [--tokenizer]`.
"""
from __future__ import annotations

import argparse
import json
import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import mlx.core as mx

from .quantize import ROUTER_QUANT
from .qwen_next import next_multimodal_config, next_tensors
from .specs import ArchSpec, spec_of
from .tokenizer import write_byte_tokenizer
from .transformer import Tensor, tensors

LLAMA31_ROPE = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192, "rope_type": "llama3"}
LLAMA32_ROPE = {**LLAMA31_ROPE, "factor": 32.0}

# The published configs' fields that shape the computation (HF config.json names).
SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 2048,
        "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
        "intermediate_size": 8192, "vocab_size": 128256, "tie_word_embeddings": True, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "rope_scaling": LLAMA32_ROPE, "max_position_embeddings": 131072,
        "attention_bias": False, "mlp_bias": False, "hidden_act": "silu",
        "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
    },
    "qwen3-0.6b": {
        "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 1024,
        "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
        "intermediate_size": 3072, "vocab_size": 151936, "tie_word_embeddings": True, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "rope_scaling": None, "max_position_embeddings": 40960,
        "attention_bias": False, "hidden_act": "silu", "bos_token_id": 151643, "eos_token_id": 151645,
    },
    "gemma-3-1b": {
        "model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], "hidden_size": 1152,
        "num_hidden_layers": 26, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
        "intermediate_size": 6912, "vocab_size": 262144, "tie_word_embeddings": True, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "rope_scaling": None,
        "query_pre_attn_scalar": 256, "sliding_window": 512, "sliding_window_pattern": 6,
        "max_position_embeddings": 32768, "attn_logit_softcapping": None, "final_logit_softcapping": None,
        "hidden_activation": "gelu_pytorch_tanh", "bos_token_id": 2, "eos_token_id": [1, 106],
    },
}
# Llama 3.1 8B: Llama 3.2 1B's config with its widths, depth, untied head and RoPE factor.
SHAPES["llama-3.1-8b"] = {**SHAPES["llama-3.2-1b"], "hidden_size": 4096, "num_hidden_layers": 32, "head_dim": 128,
                          "intermediate_size": 14336, "tie_word_embeddings": False, "rope_scaling": LLAMA31_ROPE}

# Qwen 3.5 MoE (Gated DeltaNet linear attention, full attention every 4th layer, 256 experts top 8
# and a shared expert): the published Qwen3.5-35B-A3B text config. Kept flat here (the harness reads
# the text fields); the writer nests it as the checkpoint does (`text_config`, model_type
# qwen3_5_moe_text). intermediate_size is unused (every layer is MoE) but the harness asks for it.
QWEN35_ROPE = {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
               "mrope_section": [11, 11, 10], "mrope_interleaved": True}
SHAPES["qwen3.5-35b-a3b"] = {
    "model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"], "hidden_size": 2048,
    "num_hidden_layers": 40, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
    "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "intermediate_size": 512, "vocab_size": 248320, "tie_word_embeddings": False, "rms_norm_eps": 1e-6,
    "rope_parameters": QWEN35_ROPE, "max_position_embeddings": 262144, "attention_bias": False,
    "hidden_act": "silu", "bos_token_id": 248044, "eos_token_id": 248046,
}

# The same layer counts and layer kinds with small widths and vocabularies: per-token time is then
# the host's and the framework's per-operation cost (what bounds small models on a fast GPU), which
# a slow CPU can measure; the real shapes on a CPU are bound by its memory bandwidth instead.
NARROW = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 64, "vocab_size": 8192}
for _name in ("llama-3.2-1b", "qwen3-0.6b", "gemma-3-1b"):
    SHAPES[_name + "-narrow"] = {**SHAPES[_name], **NARROW, "bos_token_id": 1, "eos_token_id": 2}
    if SHAPES[_name]["model_type"] == "gemma3_text":
        SHAPES[_name + "-narrow"].update(num_key_value_heads=1, head_dim=64, query_pre_attn_scalar=64)
# Fewer layers too (8: two full-attention ones), for checks on a CPU.
SHAPES["qwen3.5-35b-a3b-narrow"] = {
    **SHAPES["qwen3.5-35b-a3b"], **NARROW, "num_hidden_layers": 8, "num_experts": 8, "num_experts_per_tok": 2,
    "moe_intermediate_size": 128, "shared_expert_intermediate_size": 128, "intermediate_size": 128,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 64, "linear_value_head_dim": 64,
    "bos_token_id": 1, "eos_token_id": 2,
}

SHARD_BYTES = 1 << 30


def shape_config(shape: str, layers: int | None = None) -> dict[str, Any]:
    """The config of `shape`, optionally with fewer layers (for quick runs on a CPU)."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    config: dict[str, Any] = json.loads(json.dumps(SHAPES[shape]))
    if layers is not None:
        config["num_hidden_layers"] = layers
    if config["model_type"] == "gemma3_text":
        p = config["sliding_window_pattern"]
        config["layer_types"] = ["full_attention" if (i + 1) % p == 0 else "sliding_attention"
                                 for i in range(config["num_hidden_layers"])]
    return config


def tensor_shapes(config: dict[str, Any]) -> Iterator[Tensor]:
    """(name, shape, kind) of every tensor of a real-shape config: HF names for the standard block,
    mlx-lm's converted layout for Qwen 3.5 MoE (`qwen_next.next_tensors`)."""
    if config["model_type"] in ("qwen3_5_moe", "qwen3_5_moe_text"):
        return next_tensors(config)
    return tensors(config, spec_of(config["model_type"]))


DTYPES = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}


def _draw(shape: tuple[int, ...], kind: str, spec: ArchSpec, key: mx.array, dtype: mx.Dtype) -> mx.array:
    if kind == "norm":
        return (spec.norm_center + 0.05 * mx.random.normal(shape, key=key)).astype(dtype)
    if kind == "a_log":  # the decay rates' log, kept float32 as mlx-lm keeps it (cast_predicate)
        return mx.log(mx.random.uniform(1.0, 16.0, shape, key=key))
    if kind == "dt_bias":
        return (0.5 * mx.random.normal(shape, key=key)).astype(dtype)
    if kind == "conv":  # [C, K, 1]: std 1/sqrt(K)
        return mx.random.normal(shape, dtype=dtype, scale=1.0 / math.sqrt(shape[1]), key=key)
    if kind == "bias":
        return (0.02 * mx.random.normal(shape, key=key)).astype(dtype)
    # Linears and the (tied) embedding alike: std 1/sqrt(fan_in) keeps outputs and logits O(1).
    return mx.random.normal(shape, dtype=dtype, scale=1.0 / math.sqrt(shape[-1]), key=key)


def write_random_model(path: str | Path, shape: str, *, bits: int | None = None, group_size: int = 64,
                       layers: int | None = None, seed: int = 0, dtype: str = "bfloat16",
                       module_bits: Mapping[str, int] | None = None) -> Path:
    """Write a random `shape` model at `path` (`dtype`, or `bits`-bit quantized with `dtype` scales)
    and return it. `module_bits`: other bit widths for some modules (by path, `model.layers.0.mlp.down_proj`;
    0 keeps one dense), recorded per module in the config's `quantization` as mlx-lm records a
    mixed recipe (`false` for a dense one)."""
    if module_bits and bits is None:
        raise ValueError("module_bits needs bits: a dense model has no quantization to vary")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    text = shape_config(shape, layers)
    text["torch_dtype"] = dtype
    spec = spec_of(text["model_type"])
    unknown = sorted(set(module_bits or ()) - {name[: -len(".weight")] for name, _, _ in tensor_shapes(text)})
    if unknown:
        raise ValueError(f"module_bits names modules the {shape} model does not have: {', '.join(unknown)}")
    if text["model_type"] == "qwen3_5_moe":  # nested as the multimodal checkpoint is
        text["model_type"] = "qwen3_5_moe_text"
        ids = {k: text[k] for k in ("bos_token_id", "eos_token_id")}
        config = next_multimodal_config(spec.name, text, ids, dtype)
    else:
        config = text
    quant: dict[str, Any] = {"group_size": group_size, "bits": bits, "mode": "affine"}
    if bits is not None:
        config["quantization"] = quant  # the routers' 8-bit overrides are added as they are written
    key = mx.random.key(seed)
    shard: dict[str, mx.array] = {}
    shard_bytes = 0
    weight_map: dict[str, str] = {}
    n_written = 0

    def flush() -> None:
        nonlocal shard, shard_bytes, n_written
        if not shard:
            return
        n_written += 1
        name = f"model-{n_written:05d}.safetensors"
        mx.save_safetensors(str(root / name), shard, metadata={"format": "mlx"})
        weight_map.update({k: name for k in shard})
        shard, shard_bytes = {}, 0

    total = 0
    for name, shp, kind in tensor_shapes(text):
        key, sub = mx.random.split(key)
        w = _draw(shp, kind, spec, sub, DTYPES[dtype])
        # mlx-lm's quant_predicate: the MoE routers at 8 bits, recorded per layer
        stem = name[: -len(".weight")]
        params = dict(ROUTER_QUANT) if kind == "router" else {"group_size": group_size, "bits": bits or 0}
        if module_bits and stem in module_bits:
            params["bits"] = module_bits[stem]
        if module_bits and module_bits.get(stem) == 0:
            parts = {name: w}
            quant[stem] = False
        elif (bits is not None and kind in ("linear", "embedding", "router")
                and shp[-1] % params["group_size"] == 0):
            q, scales, biases = mx.quantize(w, group_size=params["group_size"], bits=params["bits"])
            parts = {name: q, stem + ".scales": scales, stem + ".biases": biases}
            if kind == "router" or params["bits"] != bits:
                quant[stem] = params
        else:
            parts = {name: w}
        mx.eval(list(parts.values()))
        for k, v in parts.items():
            shard[k] = v
            shard_bytes += v.nbytes
            total += v.nbytes
        if shard_bytes >= SHARD_BYTES:
            flush()
    flush()
    if bits is not None:
        config["quantization_config"] = dict(quant)
    (root / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (root / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return root


def weight_bytes(path: str | Path) -> int:
    """Bytes of the tensors of a model directory written here (from its index)."""
    index = json.loads((Path(path) / "model.safetensors.index.json").read_text())
    return int(index["metadata"]["total_size"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("path")
    parser.add_argument("--bits", type=int, default=None, help="quantize (mlx-lm's affine format)")
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=None, help="fewer layers than the real model")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--tokenizer", action="store_true", help="also write a byte-level BPE tokenizer.json")
    args = parser.parse_args(argv)
    out = write_random_model(args.path, args.shape, bits=args.bits, group_size=args.group_size,
                             layers=args.layers, seed=args.seed, dtype=args.dtype)
    if args.tokenizer:
        write_byte_tokenizer(out, shape_config(args.shape, args.layers))
    print(f"{out} ({weight_bytes(out) / 2**30:.2f} GiB)")
    return 0




__all__ = ["SHAPES", "shape_config", "tensor_shapes", "weight_bytes", "write_byte_tokenizer", "write_random_model"]

if __name__ == "__main__":
    raise SystemExit(main())

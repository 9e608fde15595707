"""Random-weight model directories of real shapes, written on the fly (no downloads), for the benchmarks.

`write_random_model(path, "llama-3.2-1b", bits=4)` writes what a Hugging Face checkpoint of that
shape holds for loading by pymlxc and mlx-lm: `config.json` (the published config's fields) and
safetensors shards in HF names, bfloat16, or quantized in mlx-lm's layout (packed uint32 `weight`,
bfloat16 `scales`/`biases` per group, `quantization` in the config; every linear and the embedding
quantized, as `mlx_lm.convert -q` does). The tensors are the tiny writer's list for the same
architecture (`specs.SPECS`, `transformer.tensors`). The benchmarks feed token ids;
`write_byte_tokenizer` adds a byte-level BPE `tokenizer.json` of the shape's vocabulary where a file
format needs one (GGUF files carry their vocabulary, and llama.cpp's tools load it).

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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx

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

# The same layer counts and layer kinds with small widths and vocabularies: per-token time is then
# the host's and the framework's per-operation cost (what bounds small models on a fast GPU), which
# a slow CPU can measure; the real shapes on a CPU are bound by its memory bandwidth instead.
NARROW = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 64, "vocab_size": 8192}
for _name in ("llama-3.2-1b", "qwen3-0.6b", "gemma-3-1b"):
    SHAPES[_name + "-narrow"] = {**SHAPES[_name], **NARROW, "bos_token_id": 1, "eos_token_id": 2}
    if SHAPES[_name]["model_type"] == "gemma3_text":
        SHAPES[_name + "-narrow"].update(num_key_value_heads=1, head_dim=64, query_pre_attn_scalar=64)

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
    """(HF name, shape, kind) of every tensor of a real-shape config."""
    return tensors(config, spec_of(config["model_type"]))


DTYPES = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}


def _draw(shape: tuple[int, ...], kind: str, spec: ArchSpec, key: mx.array, dtype: mx.Dtype) -> mx.array:
    if kind == "norm":
        return (spec.norm_center + 0.05 * mx.random.normal(shape, key=key)).astype(dtype)
    if kind == "bias":
        return (0.02 * mx.random.normal(shape, key=key)).astype(dtype)
    # Linears and the (tied) embedding alike: std 1/sqrt(fan_in) keeps outputs and logits O(1).
    return mx.random.normal(shape, dtype=dtype, scale=1.0 / math.sqrt(shape[-1]), key=key)


def write_random_model(path: str | Path, shape: str, *, bits: int | None = None, group_size: int = 64,
                       layers: int | None = None, seed: int = 0, dtype: str = "bfloat16") -> Path:
    """Write a random `shape` model at `path` (`dtype`, or `bits`-bit quantized with `dtype` scales)
    and return it."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    config = shape_config(shape, layers)
    config["torch_dtype"] = dtype
    if bits is not None:
        config["quantization"] = {"group_size": group_size, "bits": bits, "mode": "affine"}
        config["quantization_config"] = dict(config["quantization"])
    spec = spec_of(config["model_type"])
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
    for name, shp, kind in tensors(config, spec):
        key, sub = mx.random.split(key)
        w = _draw(shp, kind, spec, sub, DTYPES[dtype])
        if bits is not None and kind in ("linear", "embedding") and shp[-1] % group_size == 0:
            q, scales, biases = mx.quantize(w, group_size=group_size, bits=bits)
            stem = name[: -len(".weight")]
            parts = {name: q, stem + ".scales": scales, stem + ".biases": biases}
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

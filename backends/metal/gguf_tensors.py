"""The tensors of a validated GGUF file under HF names, read from the file's read-only memory map.

Each tensor is read on its own from the `gguf` reader's `np.memmap` (opened with mode "r", so a file
the user may only read loads, and nothing is ever written through the map), converted, and copied
into one MLX array; the file's pages are the page cache's, so the weights are in memory once, plus
one tensor's conversion at a time. Types (see `gguf_quants.py`): F32, F16 and BF16 as stored; the
affine-expressible quantizations as MLX's `weight`/`scales`/`biases`; Q2_K, Q3_K and Q6_K as the
file's blocks, their layers swapped for block layers by `use_block_layers`.

Conventions of llama.cpp's converter undone here: Llama's q/k projection rows permuted for
interleaved RoPE (rows of blocks are permuted like rows of floats); Gemma's norm weights stored as
1 + w; experts already stacked [E, out, in] as in mlx-lm's switch layout.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as QType
from gguf import GGUFReader
from gguf.constants import GGML_QUANT_SIZES

import pymlxc.core as mx
from pymlxc.core import Array

from .gguf_quants import AFFINE_BITS, BLOCK_TYPES, QuantError, repack_affine

# llama.cpp's tensor names -> HF module paths. `ffn_norm` is the pre-MLP norm everywhere, which
# Llama and Qwen call post_attention_layernorm and Gemma pre_feedforward_layernorm.
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_norm": "post_attention_layernorm",
    # mixture of experts (qwen2moe, qwen3moe): router, stacked experts, Qwen 2's shared expert
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
    "ffn_up_exps": "mlp.switch_mlp.up_proj",
    "ffn_down_exps": "mlp.switch_mlp.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
GEMMA_BLOCK_NAMES = {
    **BLOCK_NAMES,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Gemma 4 (llama.cpp's names -> ours, whole parameter names: the router's and the experts' scales
# are `.scale` tensors, the layer scalar has no `.weight` in HF, and the experts' gate and up
# projections come fused as `ffn_gate_up_exps`, split on reading).
GEMMA4_GLOBAL_NAMES = {"per_layer_token_embd.weight": "model.embed_tokens_per_layer.weight",
                       "per_layer_model_proj.weight": "model.per_layer_model_projection.weight",
                       "per_layer_proj_norm.weight": "model.per_layer_projection_norm.weight"}
GEMMA4_BLOCK_NAMES = {
    **{f"{k}.weight": f"{v}.weight" for k, v in BLOCK_NAMES.items() if not k.startswith("ffn_") or k in
       ("ffn_gate", "ffn_up", "ffn_down")},
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "pre_ffw_norm_2.weight": "pre_feedforward_layernorm_2.weight",
    "post_ffw_norm_1.weight": "post_feedforward_layernorm_1.weight",
    "post_ffw_norm_2.weight": "post_feedforward_layernorm_2.weight",
    "ffn_gate_inp.weight": "router.proj.weight",
    "ffn_gate_inp.scale": "router.scale",
    "ffn_down_exps.scale": "router.per_expert_scale",
    "ffn_down_exps.weight": "experts.switch_glu.down_proj.weight",
    "ffn_gate_up_exps.weight": "experts.switch_glu.gate_up_proj.weight",
    "layer_output_scale.weight": "layer_scalar",
    "inp_gate.weight": "per_layer_input_gate.weight",
    "proj.weight": "per_layer_projection.weight",
    "post_norm.weight": "post_per_layer_input_norm.weight",
}
FUSED_GATE_UP = ".experts.switch_glu.gate_up_proj.weight"
SUFFIXES = ("weight", "bias")
IGNORED = ("rope_freqs.weight",)  # folded into the config (Llama 3 RoPE scaling)


class TensorError(ValueError):
    """A tensor that has no place in the model or cannot be converted; `gguf.py` adds the file."""


def hf_name(name: str, arch: str) -> str:
    """llama.cpp's tensor name -> ours (HF's)."""
    if arch == "gemma4":
        return _gemma4_name(name)
    stem, _, suffix = name.rpartition(".")
    if suffix not in SUFFIXES or not stem:
        raise TensorError(f"tensor {name!r} has no counterpart in the {arch} model")
    if stem in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[stem]}.{suffix}"
    parts = stem.split(".")
    table = GEMMA_BLOCK_NAMES if arch.startswith("gemma") else BLOCK_NAMES
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in table:
        return f"model.layers.{int(parts[1])}.{table[parts[2]]}.{suffix}"
    raise TensorError(f"tensor {name!r} has no counterpart in the {arch} model")


def _gemma4_name(name: str) -> str:
    if name in GEMMA4_GLOBAL_NAMES:
        return GEMMA4_GLOBAL_NAMES[name]
    stem, _, suffix = name.rpartition(".")
    if stem in GLOBAL_NAMES and suffix == "weight":
        return f"{GLOBAL_NAMES[stem]}.weight"
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in GEMMA4_BLOCK_NAMES:
        return f"model.layers.{int(parts[1])}.{GEMMA4_BLOCK_NAMES[parts[2]]}"
    raise TensorError(f"tensor {name!r} has no counterpart in the gemma4 model")


def unpermute_order(rows: int, n_heads: int) -> np.ndarray:
    """Row order undoing llama.cpp's q/k permutation: within each head its rows were reordered from
    the halves layout [x0..x(d/2-1), y0..] to pairs (x0, y0, x1, y1, ...) for interleaved RoPE."""
    if rows % (2 * n_heads):
        raise TensorError(f"a q/k projection with {rows} rows cannot be split into {n_heads} heads")
    half = rows // n_heads // 2
    return np.arange(rows).reshape(n_heads, half, 2).transpose(0, 2, 1).reshape(-1)


@dataclass
class GGUFWeights:
    """What the loader builds the model from: arrays under HF names, and the module paths whose
    weight is kept as GGUF blocks (path -> type)."""
    arrays: dict[str, Array] = field(default_factory=dict)
    block_layers: dict[str, QType] = field(default_factory=dict)


def _raw(reader: GGUFReader, tensor: Any) -> np.ndarray:
    """The tensor's bytes as rows (prod(outer dims), row bytes), a view of the read-only map."""
    dims = [int(d) for d in tensor.shape]  # fastest-varying first
    block, size = GGML_QUANT_SIZES[tensor.tensor_type]
    row = dims[0] // block * size
    rows = int(np.prod(dims[1:], dtype=np.int64)) if len(dims) > 1 else 1
    start = int(tensor.data_offset)
    return reader.data[start:start + rows * row].view(np.ndarray).reshape(rows, row)


def read_tensors(reader: GGUFReader, arch: str, config: Mapping[str, Any]) -> GGUFWeights:
    """Every tensor of the file (already validated by `read_gguf`) under HF names, converted."""
    heads, kv_heads = int(config["num_attention_heads"]), int(config["num_key_value_heads"])
    shifted_norms = arch in ("gemma2", "gemma3")  # stored as 1 + w (Gemma 4's are stored as they are)
    # llama.cpp keeps 1-D tensors (norms, biases) in F32 whatever the model's precision. In an
    # all-F16 or all-BF16 file they go back to that dtype, as in the HF checkpoint: F32 norms would
    # make every activation float32 and every matmul widen its half-precision weight per call.
    matrices = frozenset(t.tensor_type for t in reader.tensors if len(t.shape) >= 2)
    half = {frozenset({QType.F16}): mx.float16, frozenset({QType.BF16}): mx.bfloat16}.get(matrices)
    out = GGUFWeights()
    for tensor in reader.tensors:
        name, qtype = tensor.name, tensor.tensor_type
        if name in IGNORED:
            continue
        target = hf_name(name, arch)
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))  # MLX order
        raw = _raw(reader, tensor)
        if arch == "llama" and (".self_attn.q_proj." in target or ".self_attn.k_proj." in target):
            order = unpermute_order(raw.shape[0], heads if ".q_proj." in target else kv_heads)
            raw = raw[order]
        if target.endswith(".mlp.shared_expert_gate.weight") and len(shape) == 1:
            shape = (1, shape[0])  # llama.cpp stores Qwen 2 MoE's shared-expert gate as a vector
        if target.endswith(FUSED_GATE_UP):
            if len(shape) != 3 or shape[1] % 2:
                raise TensorError(f"tensor {name!r} has shape {shape}, not [experts, 2 * ff, hidden]")
            halves = raw.reshape(shape[0], 2, -1, raw.shape[-1])
            for i, part in enumerate(("gate_proj", "up_proj")):
                _convert(out, halves[:, i].reshape(-1, raw.shape[-1]), qtype, (shape[0], shape[1] // 2, shape[2]),
                         target.replace("gate_up_proj", part), name, half=half)
            continue
        _convert(out, raw, qtype, shape, target, name, half=half,
                 shift=shifted_norms and target.endswith("norm.weight"))
    return out


def _convert(out: GGUFWeights, raw: np.ndarray, qtype: QType, shape: tuple[int, ...], target: str, name: str, *,
             half: Any, shift: bool = False) -> None:
    """One tensor's rows of bytes into `out` under `target` (its type's arrays); `shift`: a norm
    stored as 1 + w."""
    module = target.rpartition(".")[0]
    if qtype in AFFINE_BITS:
        try:
            packed, scales, biases = repack_affine(raw, qtype, name)
        except QuantError as exc:
            raise TensorError(str(exc)) from None
        lead = shape[:-1]
        out.arrays[target] = mx.array(packed.reshape(*lead, packed.shape[-1]))
        out.arrays[f"{module}.scales"] = mx.array(scales.reshape(*lead, scales.shape[-1]))
        out.arrays[f"{module}.biases"] = mx.array(biases.reshape(*lead, biases.shape[-1]))
        return
    if qtype in BLOCK_TYPES:
        size = GGML_QUANT_SIZES[qtype][1]
        out.arrays[target] = mx.array(np.ascontiguousarray(raw).reshape(*shape[:-1], -1, size))
        out.block_layers[module] = qtype
        return
    dtype = {QType.F32: np.float32, QType.F16: np.float16, QType.BF16: np.uint16}[qtype]
    value = mx.array(np.ascontiguousarray(raw).view(dtype).reshape(shape))
    if qtype == QType.BF16:
        value = mx.view(value, mx.bfloat16)  # bit-exact from the file
    if shift:
        value = (value.astype(mx.float32) - 1.0).astype(value.dtype)
    if half is not None and value.ndim == 1 and value.dtype == mx.float32:
        value = value.astype(half)
    out.arrays[target] = value


__all__ = ["GLOBAL_NAMES", "BLOCK_NAMES", "GEMMA_BLOCK_NAMES", "TensorError", "GGUFWeights", "hf_name",
           "unpermute_order", "read_tensors"]

"""The tensors of a validated GGUF file under HF names, read from the file's read-only memory map.

Each tensor is read on its own from the `gguf` reader's `np.memmap` (opened with mode "r", so a file
the user may only read loads, and nothing is ever written through the map), converted, and copied
into one MLX array; the file's pages are the page cache's, so the weights are in memory once, plus
two tensors' conversions at a time (a pool of threads repacks the next tensor's chunks of rows
while this thread copies the last one into MLX). Types (see `gguf_quants.py`): F32, F16 and BF16 as stored; the
affine-expressible quantizations as MLX's `weight`/`scales`/`biases`; Q2_K, Q3_K and Q6_K as the
file's blocks, their layers swapped for block layers by `use_block_layers`.

Conventions of llama.cpp's converter undone here: Llama's q/k projection rows permuted for
interleaved RoPE (rows of blocks are permuted like rows of floats); Gemma's norm weights stored as
1 + w; experts already stacked [E, out, in] as in mlx-lm's switch layout. Qwen3-Next and Qwen 3.5
(`GATED_DELTA`): A_log stored as A = -exp(A_log), the conv weight squeezed to [C, K], the norms
already 1 + w (mlx-lm's layout), Qwen3-Next's per-key-head q|k|v|z projection split into `attn_qkv`
and `attn_gate` (merged back), Qwen 3.5's value heads reordered from grouped by key head to tiled
(`_value_order`; rows are permuted in any type, the output projection's columns in float and
repacked types, and a Q2_K/Q3_K/Q6_K output projection, whose 256-value blocks span two heads, is
dequantized), and the multi-token prediction blocks after the model's own dropped.

The dtype the model computes in (`compute_dtype`): llama.cpp keeps norms and other small tensors in
F32 whatever the file's type, which would make every activation float32 and keep quantized layers
off the half-precision kernels. A file's float tensors therefore go to the compute dtype: float16
for quantized files of the architectures in HALF_SAFE on a GPU (as MLX's quantized models compute in
their scales' dtype), float32 for other quantized ones and on a CPU, the matrices' own dtype in
all-F16 or all-BF16 files, float32 in F32 files; a LoadConfig.dtype names another.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as QType
from gguf import GGUFReader
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize

import pymlxc.core as mx
from pymlxc.core import Array

from .gguf_config import GATED_DELTA
from .gguf_quants import AFFINE_BITS, BLOCK_TYPES, GROUP, QuantError, Repacked, convert_workers, start_repack

# Quantized files of these compute in float16 by default. Gemma's residual stream grows past
# float16's range (HF refuses float16 for Gemma 2 and 3; llama.cpp keeps activations in F32), and
# Qwen3-Next / Qwen 3.5's recurrent state is kept in float32 by mlx-lm: those stay float32.
HALF_SAFE = frozenset({"llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe"})
FLOAT16_MAX = 65504.0
_DTYPES = {QType.F32: mx.float32, QType.F16: mx.float16, QType.BF16: mx.bfloat16}

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
# Qwen3-Next and Qwen 3.5 (whole parameter names: A_log and dt_bias have no `.weight`).
GATED_DELTA_BLOCK_NAMES = {
    **{f"{k}.{s}": f"{v}.{s}" for k, v in BLOCK_NAMES.items() if k != "ffn_norm" for s in ("weight", "bias")},
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight",
    "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_in.weight": "linear_attn.in_proj_qkvz.weight",  # Qwen3-Next files of older converters
    "ssm_ba.weight": "linear_attn.in_proj_ba.weight",
    "ssm_beta.weight": "linear_attn.in_proj_b.weight",
    "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_a": "linear_attn.A_log",
    "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
    "ffn_gate_up_exps.weight": "mlp.switch_mlp.gate_up_proj.weight",
}
FUSED_GATE_UP = (".experts.switch_glu.gate_up_proj.weight", ".mlp.switch_mlp.gate_up_proj.weight")
SUFFIXES = ("weight", "bias")
IGNORED = ("rope_freqs.weight",)  # folded into the config (Llama 3 RoPE scaling)


class TensorError(ValueError):
    """A tensor that has no place in the model or cannot be converted; `gguf.py` adds the file."""


def hf_name(name: str, arch: str) -> str:
    """llama.cpp's tensor name -> ours (HF's)."""
    if arch == "gemma4":
        return _gemma4_name(name)
    if arch in GATED_DELTA:
        parts = name.split(".", 2)
        if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in GATED_DELTA_BLOCK_NAMES:
            return f"model.layers.{int(parts[1])}.{GATED_DELTA_BLOCK_NAMES[parts[2]]}"
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
    """What the loader builds the model from: arrays under HF names, the module paths whose
    weight is kept as GGUF blocks (path -> type), the repacked layers' quantization (path ->
    {"group_size", "bits"}: the loader then checks their packed shapes against the model's instead
    of reading bits and group from them, which a matrix of the wrong width would fake), and each
    HF name's tensor in the file (for errors)."""
    arrays: dict[str, Array] = field(default_factory=dict)
    block_layers: dict[str, QType] = field(default_factory=dict)
    quantization: dict[str, dict[str, int]] = field(default_factory=dict)
    names: dict[str, str] = field(default_factory=dict)


def _raw(reader: GGUFReader, tensor: Any) -> np.ndarray:
    """The tensor's bytes as rows (prod(outer dims), row bytes), a view of the read-only map."""
    dims = [int(d) for d in tensor.shape]  # fastest-varying first
    block, size = GGML_QUANT_SIZES[tensor.tensor_type]
    row = dims[0] // block * size
    rows = int(np.prod(dims[1:], dtype=np.int64)) if len(dims) > 1 else 1
    start = int(tensor.data_offset)
    return reader.data[start:start + rows * row].view(np.ndarray).reshape(rows, row)


def _matrix_types(reader: GGUFReader) -> frozenset[QType]:
    """The types of the file's weight matrices (not the linear layers' conv weights, F32 anyway)."""
    return frozenset(t.tensor_type for t in reader.tensors if len(t.shape) >= 2 and ".ssm_conv1d." not in t.name)


def compute_dtype(reader: GGUFReader, arch: str, requested: Any = None, *, fast_half: bool = True) -> Any:
    """The dtype the model of this file computes in: `requested` (LoadConfig.dtype) where given, else
    float16 for a quantized file of a HALF_SAFE architecture without BF16 matrices where the device
    computes half precision at speed (`fast_half`: a GPU), float32 for other quantized files, the
    matrices' dtype where they are all F16 or all BF16 (F32 ones beside them allowed), else float32.
    (MLX's CPU computes a float16 quantized product element by element: a Q4_K_M file of
    Llama-3.2-1B's layers at narrow widths prefilled 64 tokens in 17.0 s in float16, 0.61 s in
    float32; docs/gguf.md.)"""
    matrices = _matrix_types(reader)
    affine = sorted(t.name for t in reader.tensors if t.tensor_type in AFFINE_BITS)
    if requested is not None:
        if requested == mx.bfloat16 and affine:
            # Their scales are float16 (exact); quantized_matmul of bfloat16 x with them gives float32.
            raise TensorError(f"dtype 'bfloat16' cannot compute tensor {affine[0]!r} "
                              f"({QType(next(t.tensor_type for t in reader.tensors if t.name == affine[0])).name}): "
                              "its scales are float16; load it with dtype 'auto', 'float16' or 'float32'")
        return requested
    halves = matrices & {QType.F16, QType.BF16}
    if matrices - set(_DTYPES):  # quantized
        return mx.float16 if fast_half and arch in HALF_SAFE and QType.BF16 not in halves else mx.float32
    return _DTYPES[next(iter(halves))] if len(halves) == 1 else mx.float32


def read_tensors(reader: GGUFReader, arch: str, config: Mapping[str, Any], dtype: Any = mx.float32, *,
                 explicit: bool = False) -> GGUFWeights:
    """Every tensor of the file (already validated by `read_gguf`) under HF names, converted; float
    tensors in `dtype` (`compute_dtype`'s) as `_convert` says, every one where `explicit` (asked for).
    A pool of `convert_workers()` threads repacks the quantized tensors' chunks of rows, the next
    tensor's while this thread copies the last one into MLX: at most that many chunks' temporaries
    and two tensors' results exist at once. Errors are raised in file order, as one by one."""
    workers = convert_workers()
    if workers == 1:
        return _read_tensors(reader, arch, config, dtype, explicit, None)
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="gguf-convert")
    try:
        return _read_tensors(reader, arch, config, dtype, explicit, pool)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # after an error, the chunks queued for nothing


Finish = Callable[[], None]  # completes a tensor begun by `_read_tensors`, into its GGUFWeights


def _read_tensors(reader: GGUFReader, arch: str, config: Mapping[str, Any], dtype: Any, explicit: bool,
                  pool: Executor | None) -> GGUFWeights:
    heads, kv_heads = int(config["num_attention_heads"]), int(config["num_key_value_heads"])
    shifted_norms = arch in ("gemma2", "gemma3")  # stored as 1 + w (Gemma 4's are stored as they are)
    gated = _GatedDelta(config, dtype, pool) if arch in GATED_DELTA else None
    cast = _Cast(dtype, explicit)
    out = GGUFWeights()

    def begin(tensor: Any) -> Finish | None:
        """A repacked tensor's chunks queued on the pool now; what completes it (all of the work,
        for the others), or None for a tensor not loaded."""
        name, qtype = tensor.name, tensor.tensor_type
        if name in IGNORED:
            return None
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))  # MLX order
        if (len(shape) == 1 or name.endswith("norm.weight")) and (qtype in AFFINE_BITS or qtype in BLOCK_TYPES):
            # llama.cpp quantizes the layers' matrices only; a quantized norm passed for a quantized layer
            raise TensorError(f"tensor {name!r} is a {'vector' if len(shape) == 1 else 'norm'} stored as "
                              f"{QType(qtype).name}; only the layers' matrices are quantized (norms and "
                              "vectors are F32, F16 or BF16)")
        raw = _raw(reader, tensor)
        if gated is not None:
            return functools.partial(_gated_tensor, out, gated, arch, name, raw, qtype, shape, cast, pool)
        target = hf_name(name, arch)
        order = None
        if arch == "llama" and (".self_attn.q_proj." in target or ".self_attn.k_proj." in target):
            if len(shape) == 1:  # a bias: llama.cpp permuted its values as it did the weight's rows
                if GGML_QUANT_SIZES[qtype][0] != 1:
                    raise TensorError(f"tensor {name!r} is a {qtype.name} bias; its values cannot be put back in "
                                      "head order (llama.cpp stores them as F32)")
                raw = raw.reshape(shape[0], -1)
            order = unpermute_order(raw.shape[0], heads if ".q_proj." in target else kv_heads)
        if target.endswith(".mlp.shared_expert_gate.weight") and len(shape) == 1:
            shape = (1, shape[0])  # llama.cpp stores Qwen 2 MoE's shared-expert gate as a vector
        if target.endswith(FUSED_GATE_UP):
            return functools.partial(_split_gate_up, out, raw, qtype, shape, target, name, cast, pool)
        return _start_convert(out, raw, qtype, shape, target, name, cast=cast,
                              shift=shifted_norms and target.endswith("norm.weight"), rows=order, pool=pool)

    previous: Finish | None = None
    for tensor in reader.tensors:
        error: Exception | None = None
        try:
            current = begin(tensor)
        except Exception as exc:  # raised after the tensors before it are done: theirs come first
            current, error = None, exc
        if previous is not None:
            previous()
        if error is not None:
            raise error
        previous = current
    if previous is not None:
        previous()
    if gated is not None:
        gated.finish()
    return out


def _gated_tensor(out: GGUFWeights, gated: _GatedDelta, arch: str, name: str, raw: np.ndarray, qtype: QType,
                  shape: tuple[int, ...], cast: _Cast, pool: Executor | None) -> None:
    """One tensor of a Qwen3-Next / Qwen 3.5 file into `out` (see `_GatedDelta`)."""
    if gated.skips(name):
        return
    target = hf_name(name, arch)
    converted, qtype, shape, cols, target = gated.convert(out, name, target, raw, qtype, shape)
    if converted is None:
        return  # held until its partner comes (Qwen3-Next's attn_qkv and attn_gate)
    if cols is not None and (qtype in BLOCK_TYPES or (qtype in AFFINE_BITS and cols.size % GROUP)):
        # A column order that splits the type's blocks: the reference dequantization, dense.
        dense = dequantize(converted, qtype)[:, cols]
        out.arrays[target] = mx.array(dense).astype(gated.dense_dtype)
        return
    _convert(out, converted, qtype, shape, target, name, cast=cast, cols=cols,
             half_2d=target.endswith(".conv1d.weight"), pool=pool)


def _split_gate_up(out: GGUFWeights, raw: np.ndarray, qtype: QType, shape: tuple[int, ...], target: str, name: str,
                   cast: _Cast | None, pool: Executor | None) -> None:
    """llama.cpp's fused experts [E, 2 * ff, hidden] (gate rows first) -> gate_proj and up_proj."""
    if len(shape) != 3 or shape[1] % 2:
        raise TensorError(f"tensor {name!r} has shape {shape}, not [experts, 2 * ff, hidden]")
    per = shape[1] // 2
    for i, part in enumerate(("gate_proj", "up_proj")):
        # Half i's rows of every expert, taken by index (a repacked half is gathered chunk by chunk).
        rows = (np.arange(shape[0])[:, None] * shape[1] + i * per + np.arange(per)).reshape(-1)
        _convert(out, raw, qtype, (shape[0], per, shape[2]), target.replace("gate_up_proj", part), name, cast=cast,
                 rows=rows, pool=pool)


def _value_order(key_heads: int, value_heads: int, head: int) -> np.ndarray:
    """Positions, in llama.cpp's tiled order of value heads (v0 of every key head, then v1, ...),
    of the HF order's rows (the value heads of key head 0, then of key head 1, ...): `tiled[order]`
    is HF's. `head`: rows per value head."""
    per = value_heads // key_heads
    heads = np.arange(value_heads).reshape(per, key_heads).T.reshape(-1)
    return (heads[:, None] * head + np.arange(head)).reshape(-1)


class _GatedDelta:
    """Qwen3-Next / Qwen 3.5 tensors from llama.cpp's layout back to mlx-lm's (see the module doc)."""

    def __init__(self, config: Mapping[str, Any], dtype: Any, pool: Executor | None = None) -> None:
        self.layers = int(config["num_hidden_layers"])
        nk, nv = int(config["linear_num_key_heads"]), int(config["linear_num_value_heads"])
        self.nk, self.nv = nk, nv
        self.dk, self.dv = int(config["linear_key_head_dim"]), int(config["linear_value_head_dim"])
        self.qk = 2 * nk * self.dk
        # Qwen 3.5's converter tiles the value heads; Qwen3-Next's keeps HF's grouping.
        self.next = config["model_type"] == "qwen3_next"
        self.tiled = not self.next and nk != nv
        self.dense_dtype = dtype  # a dense fallback computes in the model's dtype, never widened per call
        self.pool = pool  # repacks the fused experts' halves
        self._pending: dict[int, dict[str, tuple[np.ndarray, QType, str]]] = {}

    def skips(self, name: str) -> bool:
        """The multi-token prediction blocks (numbered after the model's own)."""
        parts = name.split(".")
        return len(parts) > 2 and parts[0] == "blk" and parts[1].isdigit() and int(parts[1]) >= self.layers

    def _values(self, head: int) -> np.ndarray:
        return _value_order(self.nk, self.nv, head)

    def convert(self, out: GGUFWeights, name: str, target: str, raw: np.ndarray, qtype: QType,
                shape: tuple[int, ...]) -> tuple[Any, QType, tuple[int, ...], np.ndarray | None, str]:
        """(rows in mlx-lm's order, type, shape, column order or None, target); rows None: done or
        held back."""
        stem = target.rpartition(".linear_attn.")[2]
        if target.endswith(".mlp.shared_expert_gate.weight") and len(shape) == 1:
            return raw, qtype, (1, shape[0]), None, target
        if target.endswith(FUSED_GATE_UP[1]):
            _split_gate_up(out, raw, qtype, shape, target, name, None, self.pool)
            return None, qtype, shape, None, target
        if ".linear_attn." not in target:
            return raw, qtype, shape, None, target
        qkv_rows = np.concatenate([np.arange(self.qk), self.qk + self._values(self.dv)]) if self.tiled else None
        if stem == "conv1d.weight":
            if len(shape) != 2:
                raise TensorError(f"tensor {name!r} has shape {shape}, not [channels, kernel]")
            return (raw if qkv_rows is None else raw[qkv_rows]), qtype, (*shape, 1), None, target
        if stem == "A_log":
            a = dequantize(raw, qtype).reshape(-1)
            if not np.all(a < 0):
                raise TensorError(f"tensor {name!r} must hold A = -exp(A_log) < 0; it has {a.max()}")
            if self.tiled:
                a = a[self._values(1)]
            a_log = np.log(-a).astype(np.float32)  # the converter stored -exp(A_log)
            return a_log.view(np.uint8).reshape(1, -1), QType.F32, shape, None, target
        if self.tiled:
            if stem == "in_proj_qkv.weight":
                return raw[qkv_rows], qtype, shape, None, target
            if stem == "in_proj_z.weight":
                return raw[self._values(self.dv)], qtype, shape, None, target
            if stem in ("in_proj_b.weight", "in_proj_a.weight"):
                return raw[self._values(1)], qtype, shape, None, target
            if stem == "dt_bias":  # a vector: its elements as rows of bytes
                return raw.reshape(shape[0], -1)[self._values(1)].reshape(1, -1), qtype, shape, None, target
            if stem == "out_proj.weight":
                return raw, qtype, shape, self._values(self.dv), target
        if self.next and stem in ("in_proj_qkv.weight", "in_proj_z.weight"):
            return self._merge_qkvz(out, name, target, raw, qtype, shape)
        return raw, qtype, shape, None, target

    def finish(self) -> None:
        if self._pending:
            block, parts = next(iter(self._pending.items()))
            missing = "attn_gate" if "in_proj_qkv.weight" in parts else "attn_qkv"
            raise TensorError(f"tensor blk.{block}.{missing}.weight is missing (Qwen3-Next's linear layers have "
                              "attn_qkv and attn_gate)")

    def _merge_qkvz(self, out: GGUFWeights, name: str, target: str, raw: np.ndarray, qtype: QType,
                    shape: tuple[int, ...]) -> tuple[Any, QType, tuple[int, ...], None, str]:
        """Qwen3-Next: attn_qkv [all q, all k, all v] and attn_gate [all z] -> HF's in_proj_qkvz,
        q|k|v|z per key head. Of two types, the reference dequantization (float32) of both."""
        block = int(name.split(".")[1])
        stem = target.rpartition(".linear_attn.")[2]
        parts = self._pending.setdefault(block, {})
        parts[stem] = (raw, qtype, name)
        merged_target = target.replace(stem, "in_proj_qkvz.weight")
        if len(parts) < 2:
            return None, qtype, shape, None, merged_target
        del self._pending[block]
        (qkv, qkv_type, _), (z, z_type, _) = parts["in_proj_qkv.weight"], parts["in_proj_z.weight"]
        nk, dk, per_v = self.nk, self.dk, self.nv // self.nk * self.dv
        rows = []
        for g in range(nk):
            rows += [np.arange(g * dk, (g + 1) * dk), nk * dk + np.arange(g * dk, (g + 1) * dk),
                     self.qk + np.arange(g * per_v, (g + 1) * per_v),
                     self.qk + nk * per_v + np.arange(g * per_v, (g + 1) * per_v)]
        order = np.concatenate(rows)
        hidden = shape[-1]
        if qkv_type == z_type:
            return np.concatenate([qkv, z])[order], qkv_type, (order.size, hidden), None, merged_target
        dense = np.concatenate([dequantize(qkv, qkv_type), dequantize(z, z_type)])[order]
        out.arrays[merged_target] = mx.array(dense).astype(self.dense_dtype)
        return None, qkv_type, shape, None, merged_target


@dataclass(frozen=True)
class _Cast:
    """Which float tensors go to the compute dtype: all where `explicit`; else vectors (norms,
    biases) and the conv weights llama.cpp keeps in F32, and F32 matrices where the model computes
    in half precision (a router, an F32 head). Half-precision matrices are never widened unasked."""
    dtype: Any
    explicit: bool

    def __call__(self, value: Array, name: str, vector_like: bool) -> Array:
        if value.dtype == self.dtype:
            return value
        if not (self.explicit or vector_like or (value.dtype == mx.float32 and self.dtype.size == 2)):
            return value
        if self.dtype == mx.float16:
            peak = float(mx.max(mx.abs(value.astype(mx.float32))).item()) if value.size else 0.0
            if peak != peak:  # noqa: PLR0124 - NaN
                raise TensorError(f"tensor {name!r} holds NaN values")
            if not peak <= FLOAT16_MAX:
                raise TensorError(f"tensor {name!r} holds values up to {peak:g} in size, beyond float16's "
                                  f"{FLOAT16_MAX:g}; load it with dtype 'float32'")
        return value.astype(self.dtype)


def _convert(out: GGUFWeights, raw: np.ndarray, qtype: QType, shape: tuple[int, ...], target: str, name: str, *,
             cast: _Cast | None, shift: bool = False, cols: np.ndarray | None = None, half_2d: bool = False,
             rows: np.ndarray | None = None, pool: Executor | None = None) -> None:
    """One tensor's rows of bytes into `out` under `target` (its type's arrays); `cast`: the cast
    of float tensors to the compute dtype; `shift`: a norm stored as 1 + w; `cols`: the order to take
    the columns in (whole groups of 32 when repacked); `half_2d`: a matrix llama.cpp keeps in F32
    that is cast like the vectors; `rows`: the order to take the rows in (`raw[rows]`); `pool`: the
    threads that repack an affine tensor's chunks."""
    _start_convert(out, raw, qtype, shape, target, name, cast=cast, shift=shift, cols=cols, half_2d=half_2d,
                   rows=rows, pool=pool)()


def _start_convert(out: GGUFWeights, raw: np.ndarray, qtype: QType, shape: tuple[int, ...], target: str, name: str,
                   *, cast: _Cast | None, shift: bool = False, cols: np.ndarray | None = None, half_2d: bool = False,
                   rows: np.ndarray | None = None, pool: Executor | None = None) -> Finish:
    """`_convert` begun: an affine tensor's chunks queued on `pool`; the function returned does the rest."""
    out.names[target] = name
    if qtype in AFFINE_BITS:
        # The rows are gathered chunk by chunk: no copy of the whole tensor in the new order.
        repacked = start_repack(raw, qtype, name, rows=rows, pool=pool)
        return functools.partial(_finish_affine, out, repacked, qtype, shape, target, cols)
    return functools.partial(_convert_now, out, raw, qtype, shape, target, name, cast, shift, cols, half_2d, rows)


def _finish_affine(out: GGUFWeights, repacked: Callable[[], Repacked], qtype: QType, shape: tuple[int, ...],
                   target: str, cols: np.ndarray | None) -> None:
    module = target.rpartition(".")[0]
    out.quantization[module] = {"group_size": GROUP, "bits": AFFINE_BITS[qtype]}
    try:
        packed, scales, biases = repacked()
    except QuantError as exc:
        raise TensorError(str(exc)) from None
    if cols is not None:  # whole groups: each is `bits` words of the packed row
        groups = cols.reshape(-1, GROUP)[:, 0] // GROUP
        packed = packed.reshape(packed.shape[0], scales.shape[1], -1)[:, groups].reshape(packed.shape)
        scales, biases = scales[:, groups], biases[:, groups]
    lead = shape[:-1]
    out.arrays[target] = mx.array(packed.reshape(*lead, packed.shape[-1]))
    out.arrays[f"{module}.scales"] = mx.array(scales.reshape(*lead, scales.shape[-1]))
    out.arrays[f"{module}.biases"] = mx.array(biases.reshape(*lead, biases.shape[-1]))


def _convert_now(out: GGUFWeights, raw: np.ndarray, qtype: QType, shape: tuple[int, ...], target: str, name: str,
                 cast: _Cast | None, shift: bool, cols: np.ndarray | None, half_2d: bool,
                 rows: np.ndarray | None) -> None:
    """A tensor kept as the file's blocks or as floats (see `_convert`)."""
    module = target.rpartition(".")[0]
    if rows is not None:
        raw = raw[rows]
    if qtype in BLOCK_TYPES:
        size = GGML_QUANT_SIZES[qtype][1]
        out.arrays[target] = mx.array(np.ascontiguousarray(raw).reshape(*shape[:-1], -1, size))
        out.block_layers[module] = qtype
        return
    dtype = {QType.F32: np.float32, QType.F16: np.float16, QType.BF16: np.uint16}[qtype]
    values = np.ascontiguousarray(raw).view(dtype)
    if cols is not None:
        values = np.ascontiguousarray(values.reshape(values.shape[0], -1)[:, cols])
    value = mx.array(values.reshape(shape))
    if qtype == QType.BF16:
        value = mx.view(value, mx.bfloat16)  # bit-exact from the file
    if shift:
        value = (value.astype(mx.float32) - 1.0).astype(value.dtype)
    if cast is not None:
        value = cast(value, name, value.ndim == 1 or half_2d)
    out.arrays[target] = value


__all__ = ["GLOBAL_NAMES", "BLOCK_NAMES", "GEMMA_BLOCK_NAMES", "HALF_SAFE", "TensorError", "GGUFWeights", "hf_name",
           "unpermute_order", "compute_dtype", "read_tensors"]

"""The GGUF block layers: weights kept as llama.cpp's Q2_K/Q3_K/Q6_K blocks (`formats/gguf_quants.py`
says which types and why), their products through the GPU kernels of `kernels/gguf_blocks.py` where
those passed their check, else MLX ops; `use_block_layers` swaps them into a built model. Many-row
products dequantize chunks of rows (`chunk_weights`), not the whole of a large matrix at once.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as QType

import pymlxc.core as mx
from pymlxc.core import Array

from . import kernel_choice, nn
from .formats.gguf_quants import QK_K, QuantError, block_shape, dequantize_blocks
from .kernels import gguf_blocks
from .models.switch_layers import SwitchLinear

# Weights dequantized at once for a many-row product: a bound on its transient memory. On a GPU each
# chunk costs MLX's host work for several operations: an H200 took 165 us for a 128-row product of
# Llama-3.1-8B's Q6_K down projection (58.7M weights) in one chunk, 225 us in four (2**24 weights),
# 420 us in 14 (2**22) (`probe_gguf_blocks.py --rows 128 --chunk-weights N`,
# `benchmarks/results/h200-q6k-prefill-chunks.json`); so a GPU dequantizes 2**26 at a time (128 MiB
# in half precision). The CPU keeps 2**24 (not timed there): its MLX ops dequantize through float32
# temporaries of a chunk's size, and memory, not host work per operation, is what a chunk costs it.
CHUNK_WEIGHTS = 1 << 24
GPU_CHUNK_WEIGHTS = 1 << 26


def chunk_weights() -> int:
    """Weights a many-row product dequantizes at a time on the default device."""
    return CHUNK_WEIGHTS if gguf_blocks.device_kind() is None else GPU_CHUNK_WEIGHTS


def dequantize_rows(weight: Array, qtype: QType, dtype: Any) -> Array:
    """Blocks [rows, NB, S] -> [rows, NB * 256] of `dtype`: the GPU kernel where it passed its check,
    else MLX ops (float32, as the reference, then cast). Inside `kernel_choice.mlx_kernels_only()` MLX ops
    always: a shapeless trace cannot re-infer a custom kernel's output shape."""
    kind = gguf_blocks.ready(qtype, dtype) if kernel_choice.kernels_allowed() else None
    if kind is not None:
        return gguf_blocks.dequantize(weight, qtype, dtype, kind)
    return dequantize_blocks(weight, qtype).astype(dtype)


def planes_rows(planes: Array, start: int, stop: int, dtype: Any) -> Array:
    """Rows start..stop of Q6_K planes (`gguf_blocks.to_planes`) as [stop - start, K] of `dtype`: the
    planes' lookup kernel over those rows where it passed its check, else the rows read back into
    blocks first."""
    if kernel_choice.kernels_allowed() and gguf_blocks.planes_lookup_ready(dtype):
        return gguf_blocks.lookup_planes(planes, mx.arange(start, stop, dtype=mx.int32), dtype)
    return dequantize_rows(gguf_blocks.from_planes(planes, start, stop), QType.Q6_K, dtype)


def block_matmul(x: Array, weight: Array, qtype: QType, planes: bool = False) -> Array:
    """x @ W^T for W the rows of blocks `weight` [out, blocks, bytes] (`planes`: Q6_K blocks in
    `gguf_blocks.to_planes`'s layout). A few rows of x (decode) on a GPU: the matvec kernel reading
    the blocks. Otherwise chunks of `chunk_weights()` weights are dequantized, each for its own MLX
    matmul, so no dense copy of the whole matrix is made (MLX may still hold several chunks at once:
    its host side allocates ahead of the device)."""
    n, nb = weight.shape[0], weight.shape[1]
    k = x.shape[-1]
    rows = x.size // k if k else 0
    if 1 <= rows <= gguf_blocks.MAX_X_ROWS and kernel_choice.kernels_allowed():
        kind = gguf_blocks.ready(qtype, x.dtype)
        if kind is not None and k == nb * QK_K:  # planes: their kernel passed its check (`use_planes`)
            y = gguf_blocks.matvec(mx.reshape(x, (1, rows, k)), mx.expand_dims(weight, 0),
                                   mx.zeros((1,), mx.int32), qtype, kind, planes=planes)
            return mx.reshape(y, (*x.shape[:-1], n))
    return nn.product_in_row_chunks(x, n, chunk_weights(), _rows_of(weight, qtype, planes, x.dtype))


def _rows_of(weight: Array, qtype: QType, planes: bool, dtype: Any) -> Callable[[int, int], Array]:
    """`rows(start, stop)`: those rows of the blocks `weight` dequantized in `dtype`."""
    if planes:
        return lambda r, stop: planes_rows(weight, r, stop, dtype)
    return lambda r, stop: dequantize_rows(weight[r:stop], qtype, dtype)


class BlockLinear(nn.Module):
    """A Linear whose weight is rows of GGUF blocks (`weight` uint8 [out, in/256, type_size]),
    dequantized for each call in the input's dtype. `planes`: the Q6_K blocks rearranged for the CUDA
    kernel (`use_planes`)."""

    def __init__(self, input_dims: int, output_dims: int, qtype: QType, bias: bool = False,
                 dtype: mx.Dtype = mx.float16) -> None:
        super().__init__()
        self.qtype = qtype
        self.planes = False
        self.input_dims, self.output_dims = input_dims, output_dims
        self.weight = mx.zeros((output_dims, *block_shape(qtype, input_dims)), mx.uint8)
        if bias:
            self.bias = mx.zeros((output_dims,), dtype)
        self.freeze(recurse=False)

    def __call__(self, x: Array) -> Array:
        given = self.__dict__.get("dense_rows")
        if given is not None:  # a compiled prefill's trace: the rows were dequantized outside it
            y = nn.product_of_row_chunks(x, given)
        else:
            y = block_matmul(x, self.weight, self.qtype, self.planes)
        b = self.__dict__.get("bias")
        return y if b is None else y + b

    def kernel_rows(self, dtype: Any) -> int:
        """Most rows of x in `dtype` whose product the matvec kernel computes from the blocks (no
        dequantized copy): gguf_blocks.MAX_X_ROWS where that kernel passed its check, else 0."""
        if not kernel_choice.kernels_allowed() or gguf_blocks.ready(self.qtype, dtype) is None:
            return 0
        return gguf_blocks.MAX_X_ROWS

    def row_chunks(self) -> list[tuple[int, int]]:
        """The (start, stop) row ranges `block_matmul`'s many-row product dequantizes at a time."""
        return nn.row_chunks(self.output_dims, self.input_dims, chunk_weights())

    def dense_chunks(self, dtype: Any) -> list[Array]:
        """The weight's rows dequantized in `dtype`, in `row_chunks`. The compiled prefill makes them
        outside its shapeless trace, which cannot re-shape a dequantization, and hands them to the
        trace's copy of this layer as `dense_rows`: the same products as op by op."""
        rows = _rows_of(self.weight, self.qtype, self.planes, dtype)
        return [rows(r, stop) for r, stop in self.row_chunks()]


class BlockEmbedding(nn.Module):
    """An Embedding whose table is rows of GGUF blocks: only the looked-up rows are dequantized;
    as the tied output head the whole table is."""

    def __init__(self, num_embeddings: int, dims: int, qtype: QType, dtype: mx.Dtype = mx.float16) -> None:
        super().__init__()
        self.qtype = qtype
        self.planes = False  # Q6_K rows rearranged for the CUDA kernels (`use_planes`)
        self._dtype = dtype
        self.weight = mx.zeros((num_embeddings, *block_shape(qtype, dims)), mx.uint8)
        self.freeze(recurse=False)

    def __call__(self, x: Array) -> Array:
        ids = mx.reshape(x, (-1,))
        if self.planes:  # only where the lookup kernel passed its check (`use_planes`)
            if kernel_choice.kernels_allowed():
                ids = ids if ids.dtype == mx.int32 else ids.astype(mx.int32)
                values = gguf_blocks.lookup_planes(self.weight, ids, self._dtype)
            else:
                values = dequantize_rows(gguf_blocks.take_planes(self.weight, ids), self.qtype, self._dtype)
            return mx.reshape(values, (*x.shape, -1))
        rows = mx.take(self.weight, ids, axis=0)
        return mx.reshape(dequantize_rows(rows, self.qtype, self._dtype), (*x.shape, -1))

    def as_linear(self, x: Array) -> Array:
        return block_matmul(x, self.weight, self.qtype, self.planes)


class BlockSwitchLinear(nn.Module):
    """A SwitchLinear (E stacked experts) whose weight is rows of GGUF blocks [E, out, in/256, type_size]."""

    def __init__(self, input_dims: int, output_dims: int, num_experts: int, qtype: QType, bias: bool = False,
                 dtype: mx.Dtype = mx.float16) -> None:
        super().__init__()
        self.qtype = qtype
        self.weight = mx.zeros((num_experts, output_dims, *block_shape(qtype, input_dims)), mx.uint8)
        if bias:
            self.bias = mx.zeros((num_experts, output_dims), dtype)
        self.freeze(recurse=False)

    @property
    def num_experts(self) -> int:
        return self.weight.shape[0]

    def __call__(self, x: Array, indices: Array, sorted_indices: bool = False) -> Array:
        picks = indices.size
        y = None
        if picks < self.num_experts:
            y = self._picked(x, indices)
            if y is None:
                # Fewer (token, expert) pairs than experts (decoding): dequantize only the picked
                # experts, one copy per pair, each pair pointed at its own copy (still sorted when they were).
                taken = mx.take(self.weight, mx.reshape(indices, (-1,)), axis=0)
                w = dequantize_rows(mx.reshape(taken, (picks * self.weight.shape[1], *self.weight.shape[2:])),
                                    self.qtype, x.dtype)
                w = mx.reshape(w, (picks, self.weight.shape[1], -1))
                rhs = mx.reshape(mx.arange(picks, dtype=mx.uint32), indices.shape)
                y = _gather_mm(x, w, rhs, sorted_indices)
        if y is None:
            e, n = self.weight.shape[:2]
            w = mx.reshape(dequantize_rows(mx.reshape(self.weight, (e * n, *self.weight.shape[2:])), self.qtype,
                                           x.dtype), (e, n, -1))
            y = _gather_mm(x, w, indices, sorted_indices)
        b = self.__dict__.get("bias")
        return y if b is None else y + mx.expand_dims(mx.take(b, indices, axis=0), -2)

    def _picked(self, x: Array, indices: Array) -> Array | None:
        """gather_mm's result through the matvec kernel, which reads each pair's expert in place;
        None where it does not apply (no checked kernel here, or too many rows a pair)."""
        m, k = x.shape[-2], x.shape[-1]
        if not (1 <= m <= gguf_blocks.MAX_X_ROWS and kernel_choice.kernels_allowed()
                and k == self.weight.shape[2] * QK_K):
            return None
        kind = gguf_blocks.ready(self.qtype, x.dtype)
        if kind is None:
            return None
        batch = tuple(np.broadcast_shapes(tuple(x.shape[:-2]), tuple(indices.shape)))
        pairs = int(np.prod(batch, dtype=np.int64))
        xs = mx.reshape(mx.broadcast_to(x, (*batch, m, k)), (pairs, m, k))
        idx = mx.reshape(mx.broadcast_to(indices, batch), (pairs,)).astype(mx.int32)
        y = gguf_blocks.matvec(xs, self.weight, idx, self.qtype, kind)
        return mx.reshape(y, (*batch, m, self.weight.shape[1]))


def _gather_mm(x: Array, w: Array, indices: Array, sorted_indices: bool) -> Array:
    """x @ w[indices]^T through `gather_mm`; MLX's CPU gather_mm takes float32 only, so a model
    computing in half precision (a quantized GGUF MoE file) runs it in float32 there, cast back."""
    if x.dtype != mx.float32 and mx.default_device().type == "cpu":
        y = mx.gather_mm(x.astype(mx.float32), mx.swapaxes(w.astype(mx.float32), -1, -2), rhs_indices=indices,
                         sorted_indices=sorted_indices)
        return y.astype(x.dtype)
    return mx.gather_mm(x, mx.swapaxes(w, -1, -2), rhs_indices=indices, sorted_indices=sorted_indices)


BLOCK_LAYERS = (BlockLinear, BlockEmbedding, BlockSwitchLinear)


def holds_untraceable_blocks(model: nn.Module) -> bool:
    """Whether `model` has GGUF block layers that a shapeless trace cannot take (their dequantization
    slices the blocks): every one but BlockLinear, whose rows the compiled prefill dequantizes
    outside its trace (`BlockLinear.dense_chunks`)."""
    return any(isinstance(m, BLOCK_LAYERS) and not isinstance(m, BlockLinear) for _, m in model.named_modules())


def block_form(layer: nn.Module, qtype: QType, dtype: mx.Dtype) -> nn.Module:
    """The placeholder block layer that replaces `layer` (Linear, Embedding or SwitchLinear)."""
    if isinstance(layer, nn.Linear):
        out_dims, in_dims = layer.weight.shape
        return BlockLinear(in_dims, out_dims, qtype, "bias" in vars(layer), dtype)
    if isinstance(layer, nn.Embedding):
        n, dims = layer.weight.shape
        return BlockEmbedding(n, dims, qtype, dtype)
    if isinstance(layer, SwitchLinear):
        e, out_dims, in_dims = layer.weight.shape
        return BlockSwitchLinear(in_dims, out_dims, e, qtype, "bias" in vars(layer), dtype)
    raise QuantError(f"a {type(layer).__name__} layer cannot hold {qtype.name} blocks")


def use_block_layers(model: nn.Module, types: dict[str, Any], dtype: mx.Dtype = mx.float16) -> int:
    """Swap the layers at the module paths of `types` (path -> QType) for block layers; returns how many."""
    modules = dict(model.named_modules())
    swapped = 0
    for path, qtype in types.items():
        parent, _, name = path.rpartition(".")
        owner = modules.get(parent)
        layer = modules.get(path)
        if layer is None and owner is not None:
            continue  # a tensor the architecture's sanitize drops (Gemma 4's shared-KV layers' own k/v)
        if owner is None or layer is None:
            raise nn.WeightsError(f"tensor {path}.weight ({QType(qtype).name}) has no layer in the model")
        setattr(owner, name, block_form(layer, qtype, dtype))
        swapped += 1
    for qtype in sorted({QType(t) for t in types.values()}):
        gguf_blocks.ready(qtype, dtype)  # check the kernels for this dtype now, not in a generation
    return swapped


def use_planes(model: nn.Module, dtype: mx.Dtype, use: bool = True) -> int:
    """Rearrange the Q6_K weights of `model`'s BlockLinear and BlockEmbedding layers into
    `gguf_blocks.to_planes`'s layout (the same bytes, permuted), where `use` (Settings.cuda_q6k_planes)
    and the planes kernel's check for x of `dtype` pass (for an embedding, also the lookup kernel's);
    returns how many. Once the weights are in (after any split of the model: `file_layout` first
    undoes it). One tensor at a time, each holding up to about 2.6x its bytes while it is copied (by
    the arrays the conversion makes: the old layout, the reordered ql bytes, the planes)."""
    if not use or not gguf_blocks.planes_ready(dtype):
        return 0
    # The lookup kernel reads embeddings' rows and prefill chunks' (`planes_rows`): checked here, on
    # the loading thread (a first check during a generation would run on its decode thread).
    embeddings = gguf_blocks.planes_lookup_ready(dtype)
    done = 0
    for _, layer in model.named_modules():
        if not isinstance(layer, BlockLinear) and not (embeddings and isinstance(layer, BlockEmbedding)):
            continue
        if layer.qtype == QType.Q6_K and not layer.planes:
            planes = gguf_blocks.to_planes(layer.weight)
            mx.eval(planes)  # one matrix at a time: the old layout is freed before the next is copied
            layer.weight = planes
            layer.planes = True
            done += 1
    if done:
        mx.clear_cache()  # the old layouts' buffers (and the copies' temporaries) back to the device
    return done


def file_layout(model: nn.Module) -> int:
    """Undo `use_planes`: every block layer's weight back in the file's block layout; returns how many."""
    done = 0
    for _, layer in model.named_modules():
        if isinstance(layer, BlockLinear | BlockEmbedding) and layer.planes:
            blocks = gguf_blocks.from_planes(layer.weight)
            mx.eval(blocks)
            layer.weight = blocks
            layer.planes = False
            done += 1
    return done


__all__ = ["BLOCK_LAYERS", "CHUNK_WEIGHTS", "GPU_CHUNK_WEIGHTS", "chunk_weights", "dequantize_rows", "planes_rows",
           "block_matmul", "BlockLinear",
           "BlockEmbedding", "BlockSwitchLinear", "block_form", "file_layout", "holds_untraceable_blocks",
           "use_block_layers", "use_planes"]

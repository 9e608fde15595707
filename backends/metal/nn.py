"""A minimal module system on `pymlxc.core`: parameters as attributes, flat names, freezing, loading.

A `Module` holds child modules, lists of modules and `Array` parameters as plain attributes; names
starting with `_` are private (precomputed constants, caches) and are not parameters. The flat name of
a parameter is its attribute path, `model.layers.0.self_attn.q_proj.weight`, which is also its key in
the checkpoint: loading a model is a name match.

Parameters are created as lazy `zeros` placeholders: they cost no memory until evaluated, and the
loader replaces every one of them, so building a 70B model skeleton is free.
"""
from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import pymlxc.core as mx
from pymlxc.core import Array
from pymlxc.settings import SWITCH, Settings

from .kernel_choice import (
    AUTO_MIN_BYTES_PER_LAYER,
    dense_matmul,
    dense_ready,
    kernels_allowed,
    padded_prefill_attention_ready,
    prefill_attention_ready,
    qmm_product,
    qmm_ready,
    qmm_takes,
    quantized_matmul,
    runs_on,
)
from .kernels import qmm as qmm_kernel
from .kernels.check import on_cuda
from .thread_setting import ThreadSetting

_matmul = mx.matmul
_addmm = mx.addmm
_take = mx.take
_T = mx.transpose
_reshape = mx.reshape
_qmm = mx.quantized_matmul
_dequantize = mx.dequantize
_concat = mx.concatenate
_swapaxes = mx.swapaxes
_rms_norm = mx.fast.rms_norm


class WeightsError(ValueError):
    """Checkpoint tensors do not fit the model: the message names the tensor(s); `tensor`, where one
    tensor is at fault, its name (a loader adds where it came from)."""

    def __init__(self, message: str, tensor: str | None = None) -> None:
        super().__init__(message)
        self.tensor = tensor


def child(node: Any, part: str) -> Any:
    """One step of a flat name ("layers", "3", "mlp"): a module's public attribute or a list's
    item, else None."""
    if isinstance(node, (list, tuple)):
        return node[int(part)] if part.isdigit() and int(part) < len(node) else None
    return getattr(node, part, None) if not part.startswith("_") else None


class Module:
    """Base class: attributes that are Arrays are parameters, Modules (or lists of them) are children."""

    def __init__(self) -> None:
        # Local names of parameters excluded from `trainable_parameters()`.
        self._frozen: set[str] = set()

    # ------------------------------------------------------------------ traversal
    def children(self) -> Iterator[tuple[str, Module]]:
        """Direct child modules as (name, module); list items are named `name.i`."""
        for name, value in vars(self).items():
            if name.startswith("_"):
                continue
            if isinstance(value, Module):
                yield name, value
            elif isinstance(value, (list, tuple)):
                for i, item in enumerate(value):
                    if isinstance(item, Module):
                        yield f"{name}.{i}", item

    def named_modules(self, prefix: str = "") -> Iterator[tuple[str, Module]]:
        """This module (named `prefix`) and every descendant, depth first, with flat names."""
        # A stack rather than nested generators: every load, update and free walks the tree.
        stack: list[tuple[str, Module]] = [(prefix, self)]
        while stack:
            path, module = stack.pop()
            yield path, module
            found = [(f"{path}.{name}" if path else name, child) for name, child in module.children()]
            stack.extend(reversed(found))

    def local_parameters(self) -> Iterator[tuple[str, Array]]:
        for name, value in vars(self).items():
            if not name.startswith("_") and isinstance(value, Array):
                yield name, value

    def parameters(self) -> dict[str, Array]:
        """Every parameter by flat name ("a.b.0.c")."""
        return self.parameters_and_constants()[0]

    def parameters_and_constants(self) -> tuple[dict[str, Array], list[Array]]:
        """In one walk: every parameter by flat name, and every other Array the tree holds (private
        constants such as a Linear's W^T, and arrays in lists)."""
        params: dict[str, Array] = {}
        constants: list[Array] = []
        for path, module in self.named_modules():
            for name, value in vars(module).items():
                if isinstance(value, Array):
                    if name.startswith("_"):
                        constants.append(value)
                    else:
                        params[f"{path}.{name}" if path else name] = value
                elif isinstance(value, (list, tuple)):
                    constants.extend(v for v in value if isinstance(v, Array))
        return params, constants

    def trainable_parameters(self) -> dict[str, Array]:
        out: dict[str, Array] = {}
        for path, module in self.named_modules():
            for name, value in module.local_parameters():
                if name not in module._frozen:
                    out[f"{path}.{name}" if path else name] = value
        return out

    # ------------------------------------------------------------------ freezing
    def _set_frozen(self, keys: str | Iterable[str] | None, recurse: bool, frozen: bool) -> None:
        wanted = None if keys is None else {keys} if isinstance(keys, str) else set(keys)
        modules = self.named_modules() if recurse else iter([("", self)])
        for path, module in modules:
            for name, _ in module.local_parameters():
                full = f"{path}.{name}" if path else name
                if wanted is None or name in wanted or full in wanted:
                    if frozen:
                        module._frozen.add(name)
                    else:
                        module._frozen.discard(name)

    def freeze(self, keys: str | Iterable[str] | None = None, *, recurse: bool = True) -> Module:
        """Exclude parameters from training: all, or those whose local name (e.g. "bias") or flat
        name (e.g. "layers.0.mlp.up_proj.weight") is in `keys`."""
        self._set_frozen(keys, recurse, True)
        return self

    def unfreeze(self, keys: str | Iterable[str] | None = None, *, recurse: bool = True) -> Module:
        self._set_frozen(keys, recurse, False)
        return self

    # ------------------------------------------------------------------ updating
    def _owners(self) -> Callable[[str], tuple[Module, str]]:
        """`resolve(flat name)` -> (owning module, local name), KeyError when no such module. The
        modules of every prefix are kept: a checkpoint's names share their prefixes
        ("model.layers.3.self_attn"), so each module is reached by one step from its parent."""
        nodes: dict[str, Any] = {"": self}

        def node(prefix: str) -> Any:
            found = nodes.get(prefix)
            if found is None:
                parent, _, part = prefix.rpartition(".")
                found = child(node(parent), part)
                if found is None:
                    raise KeyError(prefix)
                nodes[prefix] = found
            return found

        def resolve(path: str) -> tuple[Module, str]:
            prefix, _, leaf = path.rpartition(".")
            try:
                module = node(prefix)
            except KeyError:
                raise KeyError(path) from None
            if not isinstance(module, Module):
                raise KeyError(path)
            return module, leaf

        return resolve

    def update(self, weights: Mapping[str, Array], *, strict: bool = False) -> Module:
        """Set parameters by flat name. With `strict`, unknown names raise WeightsError."""
        resolve = self._owners()
        for path, value in weights.items():
            try:
                module, leaf = resolve(path)
            except KeyError:
                if strict:
                    raise WeightsError(f"unexpected parameter {path!r}: the model has no such tensor") from None
                continue
            if strict and not isinstance(getattr(module, leaf, None), Array):
                raise WeightsError(f"unexpected parameter {path!r}: the model has no such tensor")
            setattr(module, leaf, value)
        return self

    def load_weights(self, weights: Mapping[str, Array], *, strict: bool = True) -> Module:
        """Replace parameters from a flat dict. With `strict` (the default) every parameter must be
        given with its shape, and no other tensor may be: errors name the tensor(s)."""
        if strict:
            params = self.parameters()
            missing = sorted(set(params) - set(weights))
            unexpected = sorted(set(weights) - set(params))
            if missing:
                raise WeightsError(f"missing tensor{'s' if len(missing) > 1 else ''} in checkpoint: "
                                   + ", ".join(missing[:10])
                                   + (f" (and {len(missing) - 10} more)" if len(missing) > 10 else ""))
            if unexpected:
                raise WeightsError(f"unexpected tensor{'s' if len(unexpected) > 1 else ''} in checkpoint: "
                                   + ", ".join(unexpected[:10])
                                   + (f" (and {len(unexpected) - 10} more)" if len(unexpected) > 10 else ""))
            for name, value in weights.items():
                want, got = params[name].shape, value.shape
                if want != got:
                    raise WeightsError(f"tensor {name!r} has shape {got} in the checkpoint, the model expects {want}",
                                       tensor=name)
        return self.update(weights, strict=strict)

    # ------------------------------------------------------------------ lifetime
    def arrays(self) -> Iterator[Array]:
        """Every Array this module tree holds, private constants included (for `free`)."""
        for _, module in self.named_modules():
            for value in vars(module).values():
                if isinstance(value, Array):
                    yield value
                elif isinstance(value, (list, tuple)):
                    yield from (v for v in value if isinstance(v, Array))

    def free(self) -> None:
        """Release every Array of the tree now (idempotent); the module is unusable afterwards."""
        for a in self.arrays():
            a.free()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self.parameters())} parameters)"


# ---------------------------------------------------------------------- layers

class Linear(Module):
    """y = x W^T (+ b), W of shape (out, in) as in HF checkpoints."""

    weight: Array
    _wT: Array  # set with `weight`, by __setattr__

    def __init__(self, input_dims: int, output_dims: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = mx.zeros((output_dims, input_dims))
        if bias:
            self.bias = mx.zeros((output_dims,))

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if name == "weight":
            # W^T is a view of W (no copy once evaluated): made once here, not one op per call.
            super().__setattr__("_wT", _T(value))

    # Products of few rows through pymlxc's dense CUDA kernel (`choose_dense_matvec`, at load).
    _cuda_matvec = False

    @property
    def cuda_matvec(self) -> bool:
        return self._cuda_matvec

    def use_cuda_matvec(self, on: bool) -> None:
        self._cuda_matvec = bool(on)

    def __call__(self, x: Array) -> Array:
        return linear_product(x, self.weight, self._wT, self.__dict__.get("bias"), self._cuda_matvec)


def linear_product(x: Array, weight: Array, weight_t: Array, bias: Array | None, cuda_matvec: bool) -> Array:
    """`x @ weight.T (+ bias)` as a dense Linear computes it (and a fused projection of Linears):
    without a bias, pymlxc's dense kernel where `cuda_matvec` and it takes x, else MLX's matmul of
    the kept transpose `weight_t`; with one, MLX's fused `addmm`, or the add after the matmul
    inside `shapeless_trace()`."""
    if bias is None:
        return dense_matmul(x, weight, True, weight_t) if cuda_matvec else _matmul(x, weight_t)
    if _shapeless.get():
        return _matmul(x, weight_t) + bias  # see `shapeless_trace`
    return _addmm(bias, x, weight_t, 1.0, 1.0)


def _packed_dims(dims: int, bits: int) -> int:
    return dims * bits // 32


class CudaMatvecChoice:
    """The mark `choose_cuda_matvec` sets on a 4-bit layer (each layer sets `_cuda_matvec` in its
    __init__): whether its products of few rows go through pymlxc's CUDA kernel."""

    _cuda_matvec: bool

    @property
    def cuda_matvec(self) -> bool:
        """Whether products of few rows go through pymlxc's CUDA kernel (choose_cuda_matvec)."""
        return self._cuda_matvec

    def use_cuda_matvec(self, on: bool) -> None:
        self._cuda_matvec = bool(on)


FOLD_MIN_ROWS = 8  # MLX's CUDA quantized product goes batched-tensor-core from B * M = 8 rows
# From this many rows of x (a prefill chunk) a marked layer dequantizes for a dense matmul: on an
# H200 a 2048-token prefill of Llama-3.2-1B 4-bit took 16.5 ms against 34.1 ms through MLX's
# quantized product; at 128 tokens neither was clearly faster (`benchmarks/profile/probe_prefill.py`).
DENSE_MIN_ROWS = 512
DENSE_CHUNK_WEIGHTS = 1 << 24  # weights dequantized at once (32 MiB in half precision)
# From this many rows of x a marked 4-bit layer takes pymlxc's tensor-core kernel (kernels/qmm.py),
# below DENSE_MIN_ROWS where the layer also goes dense.
QMM_MIN_ROWS = 16
# Blocks with at least this many bytes of such 4-bit layers (weights, scales, biases) prefill op by
# op, through that kernel, instead of through the compiled prefill (MLX's product): on an H100 a
# 128-token prefill of Llama-3.1-8B (117-130 MiB a block at groups 64 and 32) took 24.2 against 34.4
# ms from its Q4_0 GGUF file and 25.9 against 30.6 ms from MLX 4-bit; Llama-3.2-1B's (33-36 MiB)
# took 11.4 against 10.9 and 16.6 against 9.6 ms, the host's work op by op costing more there
# (`benchmarks/profile/probe_prefill.py --modes segmented off`).
QMM_OP_BY_OP_BLOCK_BYTES = 64 << 20
# ... and only layers of these group sizes count. At group 32 (GGUF's Q4_0/Q4_K layouts) the kernel
# takes an 8B block's four 128-row products in 417 us against MLX's 569; at group 64 (MLX's own
# 4-bit) 464 against 497 (`probe_qmm.py`, BENCHMARKS.md), too little for the host's extra work op by
# op: in the llama.cpp harness (H100, `2ed0fa4`) Llama-3.1-8B's Q4_0 file prefilled 128 tokens at
# 3752-5009 tok/s op by op against 3690-3714 compiled in earlier runs, its MLX 4-bit form at 3281-4096
# against 4094-4213 (`benchmarks/results/h100-llama-cpp-8b-qmm-prefill.json`).
QMM_OP_BY_OP_GROUPS = (32,)
# Blocks with at least this many bytes of quantized linears take the compiled prefill's products as
# a dequantization and a dense matmul each (`dequantized_products`, where `Settings.prefill_dequantized`
# is `auto`). On an H200, 128 tokens, runs interleaved in one process (`probe_prefill.py
# --dequantized-ab`): Llama-3.1-8B MLX 4-bit (130 MiB a block) 27.98 against 30.90 ms (medians of 7,
# every run of the one below every run of the other); Llama-3.2-1B (33-36 MiB), host-bound, lost:
# 12.91 against 10.52 ms at group 64, 13.00 against 11.57 at group 32.
DEQUANTIZED_MIN_BLOCK_BYTES = 64 << 20


def row_chunks(rows: int, k: int, chunk_weights: int) -> list[tuple[int, int]]:
    """The (start, stop) row ranges of a W [rows, k] taken `chunk_weights` weights at a time."""
    step = max(1, chunk_weights // max(k, 1))
    return [(r, min(r + step, rows)) for r in range(0, rows, step)]


def product_of_row_chunks(x: Array, chunks: Sequence[Array]) -> Array:
    """x @ W.T for W given as consecutive chunks of its rows, each [rows_i, K] in x's dtype: one
    dense matmul per chunk, the outputs side by side."""
    parts = [_matmul(x, _swapaxes(c, -1, -2)) for c in chunks]
    return parts[0] if len(parts) == 1 else _concat(parts, -1)


def product_in_row_chunks(x: Array, rows: int, chunk_weights: int, dequantize: Callable[[int, int], Array]) -> Array:
    """x @ W.T for a W of `rows` rows kept compressed: `dequantize(r, stop)` gives rows r..stop of W
    [stop - r, K] in x's dtype, at most `chunk_weights` weights at a time, each for its own dense
    matmul, so no dense copy of the whole of W is made."""
    return product_of_row_chunks(x, [dequantize(r, stop) for r, stop in row_chunks(rows, x.shape[-1], chunk_weights)])


def _dense_product(layer: Any, x: Array) -> Array:
    """`x @ dequantize(W).T` through `product_in_row_chunks`: on an H200 MLX's quantized product of
    128 rows reached 150-300 GB/s of weights where its dense matmul of the same shape ran at 0.7-1.6
    TB/s (`benchmarks/profile/probe_gguf_blocks.py --rows 128`)."""
    w, s, b = layer.weight, layer.scales, layer.biases
    return product_in_row_chunks(
        x, w.shape[0], DENSE_CHUNK_WEIGHTS,
        lambda r, stop: _dequantize(w[r:stop], s[r:stop], b[r:stop], layer.group_size, layer.bits).astype(x.dtype))


def dequantized_product(x: Array, weight: Array, scales: Array, biases: Array, group_size: int, bits: int) -> Array:
    """`x @ dequantize(W).T` as one dequantization of the whole W and one dense matmul (inside
    `dequantized_products()`): both shapes fixed by W alone, so a shapeless trace holds them."""
    w = _dequantize(weight, scales, biases, group_size, bits)
    if w.dtype != x.dtype:
        w = w.astype(x.dtype)
    return _matmul(x, _swapaxes(w, -1, -2))


def given_dense_product(layer: Any, x: Array) -> Array | None:
    """`x @ W.T` on the dense copy of `layer`'s quantized weight that the compiled prefill made
    before its trace and handed to the trace's copy of the layer as `dense_weight`
    (decode/prefill.py); None where none was given."""
    dense = layer.__dict__.get("dense_weight")
    if dense is None:
        return None
    if dense.dtype != x.dtype:
        dense = dense.astype(x.dtype)
    return _matmul(x, _swapaxes(dense, -1, -2))


def _quantized_product(layer: Any, x: Array) -> Array:
    """`x @ dequantize(layer's weight).T` for a QuantizedLinear or a QuantizedEmbedding's head:
    pymlxc's CUDA kernel where the layer is marked for it, else MLX directly (no further Python
    call on the uncompiled per-token path).

    A decode batch's activations [B, 1, K] with B >= FOLD_MIN_ROWS go in as one product's rows
    [1, B, K]: MLX's CUDA quantized product takes [B, 1, K] as B products of one row each (its
    batched tensor-core kernel), every one reading all the weights, so a batch's step grew with its
    rows. Below 8 rows MLX's matrix-vector kernel takes either layout alike (and pymlxc's kernel
    reads any), so the two reshapes are not spent there."""
    if _dequantized.get():
        given = given_dense_product(layer, x)
        if given is not None:
            return given
        return dequantized_product(x, layer.weight, layer.scales, layer.biases, layer.group_size, layer.bits)
    shape = x.shape
    if len(shape) == 3 and shape[1] == 1 and shape[0] >= FOLD_MIN_ROWS:
        y = _quantized_product(layer, _reshape(x, (1, shape[0], shape[2])))
        return _reshape(y, (shape[0], 1, y.shape[-1]))
    if layer._dense_rows or layer._qmm_rows:  # a prefill chunk's own products (marked at load)
        rows = math.prod(shape[:-1])
        dense = layer._dense_rows and rows >= layer._dense_rows
        if (dense or (layer._qmm_rows and rows >= layer._qmm_rows)) and not _shapeless.get() and kernels_allowed():
            if dense:
                return _dense_product(layer, x)
            if qmm_takes(x, layer.weight, layer.scales, layer.biases, layer.group_size, 4):
                return qmm_product(x, layer.weight, layer.scales, layer.biases, layer.group_size)
    if layer._cuda_matvec:
        return quantized_matmul(x, layer.weight, layer.scales, layer.biases, layer.group_size, layer.bits, True)
    out: Array = _qmm(x, layer.weight, layer.scales, layer.biases, True, layer.group_size, layer.bits)
    return out


class QuantizedLinear(CudaMatvecChoice, Module):
    """A Linear with an affine-quantized weight: packed uint32 `weight`, per-group `scales`, `biases`."""

    def __init__(self, input_dims: int, output_dims: int, bias: bool = False, *, group_size: int = 64,
                 bits: int = 4, dtype: mx.Dtype = mx.float32) -> None:
        super().__init__()
        if input_dims % group_size:
            raise ValueError(f"input size {input_dims} is not a multiple of the group size {group_size}")
        self.group_size = group_size
        self.bits = bits
        self.weight = mx.zeros((output_dims, _packed_dims(input_dims, bits)), mx.uint32)
        self.scales = mx.zeros((output_dims, input_dims // group_size), dtype)
        self.biases = mx.zeros((output_dims, input_dims // group_size), dtype)
        if bias:
            self.bias = mx.zeros((output_dims,), dtype)
        self.freeze(["weight", "scales", "biases"], recurse=False)
        self._cuda_matvec = False  # set by choose_cuda_matvec
        self._dense_rows = 0  # set by mark_dense_products: 0, or the rows of x from which to go dense
        self._qmm_rows = 0  # set by mark_qmm_products: 0, or the rows of x (op by op) from which kernels/qmm.py runs

    @property
    def input_dims(self) -> int:
        return self.weight.shape[1] * 32 // self.bits

    @property
    def output_dims(self) -> int:
        return self.weight.shape[0]

    @classmethod
    def from_linear(cls, linear: Linear, group_size: int = 64, bits: int = 4) -> QuantizedLinear:
        out_dims, in_dims = linear.weight.shape
        b = linear.__dict__.get("bias")
        q = cls(in_dims, out_dims, b is not None, group_size=group_size, bits=bits, dtype=linear.weight.dtype)
        q.weight, q.scales, q.biases = mx.quantize(linear.weight, group_size, bits)
        if b is not None:
            q.bias = b
        return q

    def __call__(self, x: Array) -> Array:
        y = _quantized_product(self, x)
        b = self.__dict__.get("bias")
        return y if b is None else y + b


class Embedding(Module):
    """Token id -> row of `weight` (vocab, dims)."""

    weight: Array
    _wT: Array  # set with `weight`, by __setattr__

    def __init__(self, num_embeddings: int, dims: int) -> None:
        super().__init__()
        self.weight = mx.zeros((num_embeddings, dims))

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if name == "weight":
            super().__setattr__("_wT", _T(value))  # for as_linear; a view, see Linear

    def __call__(self, x: Array) -> Array:
        return _take(self.weight, x, axis=0)

    def as_linear(self, x: Array) -> Array:
        """The tied output head: x @ weight^T."""
        return _matmul(x, self._wT)


class QuantizedEmbedding(CudaMatvecChoice, Module):
    """An Embedding with an affine-quantized table; rows are dequantized after the gather."""

    def __init__(self, num_embeddings: int, dims: int, *, group_size: int = 64, bits: int = 4,
                 dtype: mx.Dtype = mx.float32) -> None:
        super().__init__()
        if dims % group_size:
            raise ValueError(f"embedding size {dims} is not a multiple of the group size {group_size}")
        self.group_size = group_size
        self.bits = bits
        self.weight = mx.zeros((num_embeddings, _packed_dims(dims, bits)), mx.uint32)
        self.scales = mx.zeros((num_embeddings, dims // group_size), dtype)
        self.biases = mx.zeros((num_embeddings, dims // group_size), dtype)
        self.freeze(recurse=False)
        self._cuda_matvec = False  # set by choose_cuda_matvec
        self._dense_rows = 0  # set by mark_dense_products: 0, or the rows of x from which to go dense
        self._qmm_rows = 0  # set by mark_qmm_products (a tied head's prefill rows)

    @classmethod
    def from_embedding(cls, emb: Embedding, group_size: int = 64, bits: int = 4) -> QuantizedEmbedding:
        n, dims = emb.weight.shape
        q = cls(n, dims, group_size=group_size, bits=bits, dtype=emb.weight.dtype)
        q.weight, q.scales, q.biases = mx.quantize(emb.weight, group_size, bits)
        return q

    def __call__(self, x: Array) -> Array:
        return _dequantize(_take(self.weight, x, axis=0), _take(self.scales, x, axis=0),
                           _take(self.biases, x, axis=0), self.group_size, self.bits)

    def as_linear(self, x: Array) -> Array:
        return _quantized_product(self, x)


class RMSNorm(Module):
    """x / rms(x) * weight, through the fused kernel."""

    def __init__(self, dims: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, x: Array) -> Array:
        return _rms_norm(x, self.weight, self.eps)


class OffsetRMSNorm(Module):
    """Gemma's RMSNorm: the checkpoint stores w and the scale is (1 + w). The sum is formed when the
    weight is set (loading), not in every call, and so never inside a traced function. The initial
    zeros get no sum (a model has hundreds of these norms, and loading replaces them all); a norm
    whose weight was never set forms it in each call."""

    weight: Array
    _scale: Array | None  # 1 + weight, set with `weight` by __setattr__

    def __init__(self, dims: int, eps: float = 1e-6) -> None:
        super().__init__()
        super().__setattr__("weight", mx.zeros((dims,)))
        super().__setattr__("_scale", None)
        self.eps = eps

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if name == "weight":
            super().__setattr__("_scale", value + 1.0)

    @property
    def scale(self) -> Array | None:
        """1 + weight as formed when the weight was set; None for a norm whose weight never was."""
        return self._scale

    def __call__(self, x: Array) -> Array:
        scale = self._scale if self._scale is not None else self.weight + 1.0
        return _rms_norm(x, scale, self.eps)


# ---------------------------------------------------------------------- quantizing a module tree

QuantPredicate = Callable[[str, Module], "dict[str, int] | bool"]

# Other layer types with a quantized form (e.g. the experts' SwitchLinear in models/switch_layers.py): type ->
# factory(layer, group_size=, bits=) giving the placeholder quantized module. Registered by the
# module that defines the layer.
QUANTIZED_FORMS: dict[type, Callable[..., Module]] = {}


def quantize(model: Module, predicate: QuantPredicate, *, group_size: int = 64, bits: int = 4) -> int:
    """Swap Linear/Embedding children for their quantized versions where `predicate(path, module)`
    says so (True: the given group_size/bits; a dict: its own). The new modules hold placeholders
    (no values are quantized): the loader fills them from the checkpoint. Returns how many changed."""
    changed = 0
    for path, module in list(model.named_modules()):
        for name, child in list(module.children()):
            form = QUANTIZED_FORMS.get(type(child))
            if form is None and not isinstance(child, (Linear, Embedding)):
                continue
            full = f"{path}.{name}" if path else name
            choice = predicate(full, child)
            if not choice:
                continue
            params = {"group_size": group_size, "bits": bits}
            new: Module
            if isinstance(choice, dict):
                params.update({k: int(v) for k, v in choice.items() if k in params})
            if form is not None:
                new = form(child, **params)
            elif isinstance(child, Linear):
                out_dims, in_dims = child.weight.shape
                new = QuantizedLinear(in_dims, out_dims, "bias" in vars(child), dtype=child.weight.dtype, **params)
            elif isinstance(child, Embedding):
                n, dims = child.weight.shape
                new = QuantizedEmbedding(n, dims, dtype=child.weight.dtype, **params)
            else:  # not reached: the test above lets only these through
                continue
            _replace(module, name, new)
            changed += 1
    return changed


def _replace(parent: Module, name: str, new: Module) -> None:
    if "." in name:
        attr, index = name.split(".")
        getattr(parent, attr)[int(index)] = new
    else:
        setattr(parent, name, new)


# ---------------------------------------------------------------------- the module tree as arrays

def arrays_of(model: object, with_classes: bool = False) -> Any:
    """Every Array the module tree holds (parameters and private constants), each once, in a fixed
    order for a given tree structure (none in an object outside Modules, lists, tuples and dicts);
    with `with_classes`, also the module classes in walk order (what a trace depends on besides
    shapes: an attached or fused LoRA adapter changes them).
    (Iterative: recursive closures would make reference cycles that keep the weights alive until a
    garbage collection.)"""
    out: list[Array] = []
    classes: list[str] = []
    seen: set[int] = set()
    stack: list[Any] = [model]
    while stack:
        value = stack.pop()
        if isinstance(value, Array):
            if id(value) not in seen:
                seen.add(id(value))
                out.append(value)
        elif isinstance(value, Module):
            if id(value) not in seen:
                seen.add(id(value))
                classes.append(type(value).__qualname__)
                stack.extend(reversed(list(vars(value).values())))
        elif isinstance(value, (list, tuple)):
            stack.extend(reversed(value))
        elif isinstance(value, dict):
            stack.extend(reversed(list(value.values())))
    return (out, tuple(classes)) if with_classes else out


class Cloner:
    """Copies module trees with their Arrays replaced by `substitute[id(array)]` (a trace's inputs
    for the model's weights); the originals are untouched (another thread may be running them).
    Modules shared within or across the trees copied by one Cloner stay shared."""

    def __init__(self, substitute: dict[int, Array]) -> None:
        self.substitute = substitute
        self.memo: dict[int, Module] = {}

    def swap(self, value: Any) -> Any:
        if isinstance(value, Array):
            return self.substitute.get(id(value), value)
        if isinstance(value, Module):
            return self.clone(value)
        if isinstance(value, list):
            return [self.swap(v) for v in value]
        if isinstance(value, tuple):
            return tuple(self.swap(v) for v in value)
        if isinstance(value, dict) and any(isinstance(v, (Array, Module)) for v in value.values()):
            return {k: self.swap(v) for k, v in value.items()}
        return value

    def clone(self, module: Module) -> Module:
        done = self.memo.get(id(module))
        if done is not None:
            return done
        new = copy.copy(module)
        self.memo[id(module)] = new
        # Set through __dict__: a module's __setattr__ may derive constants from what is set.
        new.__dict__.update({k: self.swap(v) for k, v in vars(module).items()})
        return new


_shapeless = ThreadSetting(False)
_dequantized = ThreadSetting(False)


@contextlib.contextmanager
def shapeless_trace() -> Iterator[None]:
    """Within (on this thread): a dense Linear adds its bias after the matmul instead of MLX's fused
    `addmm`, which fixes the row count in a shapeless trace (the compiled prefill)."""
    with _shapeless.set(True):
        yield


@contextlib.contextmanager
def dequantized_products() -> Iterator[None]:
    """Within (on this thread): quantized linears and fused projections multiply as
    `dequantized_product` (the compiled prefill's many-row products where `Settings.prefill_dequantized`
    says so; see decode/prefill.py), or on the dense copies of their weights given to them
    (`given_dense_product`)."""
    with _dequantized.set(True):
        yield


def dequantizing() -> bool:
    """Whether this thread is inside `dequantized_products()`."""
    return bool(_dequantized.get())


# ---------------------------------------------------------------------- kernel choice

def quantized_layers(model: Any) -> list[Any]:
    """`model`'s QuantizedLinear and QuantizedEmbedding modules, the layers the kernel choices mark."""
    return [m for _, m in model.named_modules() if isinstance(m, (QuantizedLinear, QuantizedEmbedding))]


def bytes_per_block(model: Any, layers: Sequence[Any]) -> float:
    """The bytes (weights, scales, biases) of these quantized `layers` per transformer block of `model`."""
    blocks = max(1, len(getattr(model, "layers", None) or ()))
    return float(sum(m.weight.nbytes + m.scales.nbytes + m.biases.nbytes for m in layers)) / blocks


def choose_cuda_matvec(model: Any, setting: str) -> bool:
    """Mark `model`'s 4-bit layers to use pymlxc's matvec kernel (kernel_choice.py) where this process runs
    on CUDA and `setting` (PYMLXC_CUDA_MATVEC: `auto`, `1` or `0`) says so, and the kernel runs here;
    returns whether it did. Elsewhere, a no-op. Decided once, at load, for the device in use then."""
    if setting not in SWITCH:
        raise ValueError(f"the cuda_matvec setting must be one of {', '.join(SWITCH)}, not {setting!r}")
    layers = quantized_layers(model)
    four_bit = [m for m in layers if m.bits == 4 and m.scales.dtype.size == 2]  # what the kernel takes
    use = (setting != "0" and bool(four_bit) and on_cuda()
           and (setting == "1" or bytes_per_block(model, four_bit) >= AUTO_MIN_BYTES_PER_LAYER)
           and runs_on(four_bit[0]))
    chosen = {id(m) for m in four_bit} if use else set()
    for m in layers:
        m.use_cuda_matvec(id(m) in chosen)
    return use


def large_quantized_blocks(model: Any) -> bool:
    """Whether `model`'s quantized linears hold DEQUANTIZED_MIN_BLOCK_BYTES or more a block."""
    linears = [m for m in quantized_layers(model) if isinstance(m, QuantizedLinear)]
    return bool(linears) and bytes_per_block(model, linears) >= DEQUANTIZED_MIN_BLOCK_BYTES


def mark_dense_products(model: Any, use: bool) -> None:
    """Mark `model`'s quantized layers to take products of DENSE_MIN_ROWS or more rows (prefill) as
    dequantized chunks and dense matmuls (`_dense_product`), or not: decided once, at load, by
    `Settings.dense_prefill` (`switch_on`: `auto` on CUDA). The model's `dense_rows` tells the
    prefill (generate._chunk_forward) which chunks skip the compiled prefill."""
    rows = DENSE_MIN_ROWS if use else 0
    marked = quantized_layers(model)
    for m in marked:
        m._dense_rows = rows
    model.dense_rows = rows if marked else 0
    # What the prefill holds per layer in flight (generate.prefill_lead).
    model.dense_block_bytes = dequantized_block_bytes(model) if rows else 0


def dequantized_block_bytes(model: Any) -> int:
    """The dequantized copies one block's dense products make (two bytes a weight; the head and
    the embedding run on one position)."""
    linears = [m for m in quantized_layers(model) if isinstance(m, QuantizedLinear)]
    blocks = max(1, len(getattr(model, "layers", None) or ()))
    return 2 * sum(m.output_dims * m.input_dims for m in linears) // blocks


def mark_qmm_products(model: Any, use: bool, dtype: Any) -> bool:
    """Mark `model`'s 4-bit layers to take products of QMM_MIN_ROWS or more rows through pymlxc's
    tensor-core kernel (`kernels/qmm.py`) where they run op by op (a prefill chunk outside the
    compiled prefill: a GGUF file whose layers hold Q6_K blocks, a masked batch, a classification),
    where `use` (`Settings.cuda_qmm`) and the kernel's check for x of `dtype` (the model's compute
    dtype) at the layers' group sizes pass; returns whether any layer was marked.

    Where the marked layers of a group size in QMM_OP_BY_OP_GROUPS hold QMM_OP_BY_OP_BLOCK_BYTES or
    more a block, the model's `qmm_rows` also takes chunks of QMM_MIN_ROWS rows or more off the
    compiled prefill (the kernel cannot enter
    its shapeless trace), so that they reach the kernel. Smaller blocks keep the compiled prefill: on
    Llama-3.2-1B (H100) a 128-token prefill op by op with the kernel took 10.0 ms where the compiled
    prefill with MLX's product took 8.3 ms, the host's work per layer costing more than the kernel
    saves there (`benchmarks/profile/probe_prefill.py`)."""
    layers = quantized_layers(model)
    for m in layers:
        m._qmm_rows = 0
    model.qmm_rows = 0
    if not use or dtype is None:  # no compute dtype (a model built outside the loader): MLX's product
        return False
    takes = [m for m in layers if m.scales.dtype == dtype
             and qmm_kernel.applies(QMM_MIN_ROWS, m.weight.shape[1] * 32 // m.bits, m.bits, m.group_size, dtype.size)]
    ready = {g: qmm_ready(dtype, g) for g in sorted({m.group_size for m in takes})}
    for m in takes:
        if ready[m.group_size]:
            m._qmm_rows = QMM_MIN_ROWS
    marked = [m for m in takes
              if m._qmm_rows and isinstance(m, QuantizedLinear) and m.group_size in QMM_OP_BY_OP_GROUPS]
    # generate._chunk_forward: chunks of this many rows skip the compiled prefill (0: none do).
    model.qmm_rows = QMM_MIN_ROWS if marked and bytes_per_block(model, marked) >= QMM_OP_BY_OP_BLOCK_BYTES else 0
    return any(m._qmm_rows for m in takes)


def block_linears(model: Any) -> list[Linear]:
    """The dense, bias-free Linear layers inside `model`'s transformer blocks (not its head)."""
    blocks = getattr(model, "layers", None) or ()
    return [m for block in blocks for _, m in block.named_modules()
            if type(m) is Linear and m.__dict__.get("bias") is None]


def segmented_decode_applies(model: Any) -> bool:
    """Whether `model` can decode in segments (`decode.segments.plan`, which also checks its
    blocks), and so take the matvec kernel's forms: it declares `segmented_decode` and every layer
    attends fully."""
    windows = getattr(model, "layer_windows", None)
    return (getattr(model, "segmented_decode", False) is True and callable(windows)
            and all(w is None for w in windows()))


def choose_dense_matvec(model: Any, setting: str, dtype: Any) -> bool:
    """Mark `model`'s block linears of `dtype` (its 2-byte compute type) to use pymlxc's dense matvec
    kernel for products of few rows (`kernel_choice.dense_matmul`) where the model's decode step can
    take the kernel's forms (`segmented_decode_applies`: alone, the kernel's product is no faster than
    MLX's), this process runs on CUDA,
    `setting` (PYMLXC_CUDA_DENSE_MATVEC: `auto` or `1`) says so and the kernel agrees with float64
    here (`dense_ready`); returns whether it did. The segmented decode's fused forms then take those
    layers as they take 4-bit ones: on an H100 Llama-3.2-1B bfloat16 decoded at 806 against 523 tok/s
    without them, Llama-3.1-8B at 174 against 164 (`benchmarks/profile/ab.py`, BENCHMARKS.md)."""
    if setting not in SWITCH:
        raise ValueError(f"the cuda_dense_matvec setting must be one of {', '.join(SWITCH)}, not {setting!r}")
    linears = block_linears(model)
    for m in linears:
        m.use_cuda_matvec(False)
    mine = [m for m in linears if dtype is not None and m.weight.dtype == dtype and dtype.size == 2]
    if (setting == "0" or not mine or not segmented_decode_applies(model) or not on_cuda()
            or not dense_ready(dtype)):
        return False
    for m in mine:
        m.use_cuda_matvec(True)
    return True


def prefill_attention_modules(model: Any) -> list[Any]:
    """`model`'s attention modules that may take pymlxc's prefill attention kernel: those of a class
    that declares `prefill_kernel` (the flag `mark_prefill_attention` sets)."""
    return [m for _, m in model.named_modules() if isinstance(getattr(type(m), "prefill_kernel", None), bool)]


def mark_prefill_attention(model: Any, use: bool, dtype: Any) -> bool:
    """Mark `model`'s attention modules (`prefill_attention_modules`) to run causal chunks through
    pymlxc's CUDA kernel (`kernels/prefill_attention.py`) where `use`
    (`Settings.cuda_prefill_attention`) and the kernel's check for their heads in `dtype` pass (and
    left-padded groups through its padded form where that form's own check passes too); the others
    keep MLX's attention. Returns whether any module was marked."""
    marked = False
    for m in prefill_attention_modules(model):
        on = bool(use and dtype is not None and isinstance(m.scale, float)
                  and prefill_attention_ready(dtype, m.head_dim, m.n_heads, m.n_kv_heads, m.scale))
        if on:  # its left-padded form too, checked now (`kernel_choice.padded_prefill_attention_passed`)
            padded_prefill_attention_ready(dtype, m.head_dim, m.n_heads, m.n_kv_heads, m.scale)
        m.__dict__["prefill_kernel"] = on
        marked = marked or on
    return marked


def choose_kernels(model: Any, settings: Settings, dtype: Any) -> bool:
    """Every load-time kernel choice for `model`'s layers, by `settings`: the 4-bit matvec kernel
    (returned: whether it was chosen), the dense one for 16-bit block linears, the dense prefill
    products and the tensor-core prefill kernel for x of `dtype`. At load, and again where layers
    are replaced (a fused adapter)."""
    cuda_matvec = choose_cuda_matvec(model, settings.cuda_matvec)
    choose_dense_matvec(model, settings.cuda_dense_matvec, dtype)
    mark_dense_products(model, settings.switch_on("dense_prefill", on_cuda()))
    mark_qmm_products(model, settings.switch_on("cuda_qmm", on_cuda()), dtype)
    mark_prefill_attention(model, settings.switch_on("cuda_prefill_attention", on_cuda()), dtype)
    return cuda_matvec


# ---------------------------------------------------------------------- activations

def silu(x: Array) -> Array:
    return x * mx.sigmoid(x)


_SQRT_2_OVER_PI = math.sqrt(2 / math.pi)


def gelu_approx(x: Array) -> Array:
    """The tanh approximation of GELU (HF's gelu_pytorch_tanh)."""
    return 0.5 * x * (1 + mx.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x**3)))

"""Tensor parallelism for the GGUF block layers (`gguf_layers.py`: weights as rows of llama.cpp
blocks, [out, in/block, bytes], experts [E, out, in/block, bytes]). A column-parallel split keeps
whole rows, so any row count splits; a row-parallel one keeps this rank's blocks of every row, so
each rank's inputs must be whole blocks (256 weights for the K-quants, 32 for Q4_0 and its kin).
Loaded here only for GGUF models (the module needs the optional `gguf` package).
"""
from __future__ import annotations

import pymlxc.core as mx
from pymlxc.core import Array
from pymlxc.core import distributed as dist

from .. import nn
from ..gguf_layers import BlockLinear, BlockSwitchLinear, block_matmul


class AllSumBlockLinear(BlockLinear):
    """A BlockLinear holding this rank's input blocks: the partial product summed over the group,
    then the bias (added once)."""

    _group: dist.Group

    def __call__(self, x: Array) -> Array:
        y = dist.all_sum(block_matmul(x, self.weight, self.qtype, self.planes), group=self._group)
        b = self.__dict__.get("bias")
        return y if b is None else y + b


class AllSumBlockSwitchLinear(BlockSwitchLinear):
    """Experts' down projection over this rank's input blocks, summed over the group."""

    _group: dist.Group

    def __call__(self, x: Array, indices: Array, sorted_indices: bool = False) -> Array:
        bias = self.__dict__.pop("bias", None)  # added once, after the sum
        try:
            y = super().__call__(x, indices, sorted_indices)
        finally:
            if bias is not None:
                self.__dict__["bias"] = bias
        y = dist.all_sum(y, group=self._group)
        return y if bias is None else y + mx.expand_dims(mx.take(bias, indices, axis=0), -2)


ROW_FORMS: dict[type[nn.Module], type[nn.Module]] = {
    BlockLinear: AllSumBlockLinear, BlockSwitchLinear: AllSumBlockSwitchLinear,
}
BLOCK_TYPES: tuple[type, ...] = (BlockLinear, BlockSwitchLinear)


def is_block(layer: nn.Module) -> bool:
    return isinstance(layer, BLOCK_TYPES)


__all__ = ["AllSumBlockLinear", "AllSumBlockSwitchLinear", "BLOCK_TYPES", "ROW_FORMS", "is_block"]

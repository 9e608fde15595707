"""Pipeline parallelism applied to a built model: rank r runs a contiguous run of the blocks, takes
its input from rank r-1 (`recv_like`) and hands its output to rank r+1 (`send`); after the last
block every rank gets the last rank's hidden state (`all_gather`), so every rank computes the same
logits and samples the same tokens (the loops stay as they are).

The model keeps its list of blocks: the blocks of other ranks are replaced by `RemoteBlock`s, which
hold no weights and pass the hidden state through; they still advance their layer's cache by the
positions seen (with key/value tensors of no heads, no memory), so cache offsets, masks, trimming
and prompt-cache reuse stay the same on every rank. The weights of the other ranks' blocks are
dropped at once (all ranks read the checkpoint's embedding and head).

Qwen3-Next and Qwen 3.5 mix linear-attention blocks (a RecurrentCache each: a conv window and a
state) with attention blocks: a stand-in keeps its block's `is_linear`, so every rank makes the
same caches, and advances a recurrent cache with empty arrays; it answers its block's kernel
dimensions (`kernel_dims`), which the model checks its decode kernel against once.
"""
from __future__ import annotations

from typing import Any, Protocol

import pymlxc.core as mx
from pymlxc.core import Array
from pymlxc.core import distributed as dist

from .. import nn
from ..cache import Cache, Mask
from ..recurrent_cache import RecurrentCache
from .errors import ShardingError

# Families whose blocks are called `block(h, mask, cache, last_only)` with a KV or recurrent cache each.
PIPELINE_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "gemma3_text", "qwen2_moe", "qwen3_moe",
                     "qwen3_next", "qwen3_5", "qwen3_5_moe")


def layer_ranges(num_layers: int, size: int) -> list[range]:
    """Contiguous runs of blocks per rank, as even as possible (the first ranks get one more)."""
    if num_layers < size:
        raise ShardingError(f"pipeline parallelism over {size} ranks needs at least {size} layers; "
                            f"the model has {num_layers}")
    base, extra = divmod(num_layers, size)
    out, start = [], 0
    for r in range(size):
        n = base + (1 if r < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out


def _advance(cache: Cache | RecurrentCache | None, x: Array) -> None:
    """Move `cache` on by x's positions without storing anything (keys of zero heads; a recurrent
    cache's window and state of zero channels)."""
    if isinstance(cache, RecurrentCache):
        b = x.shape[0]
        cache.update(mx.zeros((b, 0, 0), x.dtype), mx.zeros((b, 0, 0, 0), mx.float32), x.shape[1])
        mx.async_eval(cache.conv, cache.recurrent)
    elif cache is not None:
        empty = mx.zeros((x.shape[0], 0, x.shape[1], 1), x.dtype)
        # Nothing the step computes depends on these: scheduled now, or they would stay lazy until
        # another thread (the batch scheduler reusing a prompt cache) evaluates them on this one's stream.
        mx.async_eval(cache.update_and_fetch(empty, empty))


class _Block(Protocol):
    """A model's decoder block (a Module) as a stage calls it."""

    def __call__(self, x: Array, mask: Mask, cache: Cache | None, last_only: bool = False) -> Array: ...


class _KernelDims:
    """What a linear-attention block's stand-in tells the model's one-time kernel check."""

    def __init__(self, dims: tuple[int, int, int, int, int]) -> None:
        self._dims = dims

    def kernel_dims(self) -> tuple[int, int, int, int, int]:
        return self._dims


def _linear_of(block: Any) -> tuple[bool, Any]:
    """(is_linear, its linear attention or None) of a model's block (False for the families
    without linear attention)."""
    is_linear = bool(getattr(block, "is_linear", False))
    return is_linear, (block.linear_attn if is_linear else None)


class RemoteBlock(nn.Module):
    """The stand-in for a block another rank runs: the hidden state passes through unchanged."""

    def __init__(self, like: Any = None) -> None:
        super().__init__()
        self.is_linear, attn = _linear_of(like)
        if attn is not None:
            self.linear_attn = _KernelDims(attn.kernel_dims())

    def __call__(self, x: Array, mask: Mask, cache: Cache | None, last_only: bool = False) -> Array:
        _advance(cache, x)
        return x[:, -1:] if last_only else x


class StageBlock(nn.Module):
    """A block of this rank, with the stage's hand-overs around it: receive before the stage's
    first block, send after its last, gather the last rank's output after the model's last."""

    def __init__(self, inner: _Block | None, group: dist.Group, *, receive: bool, send: bool,
                 gather: bool, like: Any = None) -> None:
        super().__init__()
        self.inner = inner
        self.is_linear, attn = _linear_of(inner if inner is not None else like)
        if attn is not None:
            self.linear_attn = attn if isinstance(attn, _KernelDims) else _KernelDims(attn.kernel_dims())
        self._group = group
        self._receive, self._send, self._gather = receive, send, gather

    def __call__(self, x: Array, mask: Mask, cache: Cache | None, last_only: bool = False) -> Array:
        g = self._group
        rank = g.rank()
        if self._receive:
            x = dist.recv_like(x, rank - 1, group=g)
        if self.inner is None:
            _advance(cache, x)
            h = x[:, -1:] if last_only else x
        else:
            h = self.inner(x, mask, cache, last_only)
        if self._send:
            h = dist.send(h, rank + 1, group=g)
            # Sent now even where nothing this rank evaluates later needs it (a prefill chunk whose
            # output only fills caches): the next stage's caches wait on it.
            mx.async_eval(h)
        if self._gather:
            n = h.shape[0]
            h = dist.all_gather(h, group=g)[(g.size() - 1) * n:]
        return h


def drop_remote_layers(model: Any, group: dist.Group) -> set[str]:
    """Before the weights go in: replace the blocks other ranks run by `RemoteBlock`s; returns the
    names of the parameters they held, whose tensors the loader then leaves unread."""
    size, rank = group.size(), group.rank()
    if model.model_type not in PIPELINE_FAMILIES:
        raise ShardingError(f"pipeline parallelism does not support model type {model.model_type!r}; supported: "
                            f"{', '.join(PIPELINE_FAMILIES)}")
    layers = model.layers
    mine = layer_ranges(len(layers), size)[rank]
    before = set(model.parameters())
    for i in range(len(layers)):
        if i not in mine:
            layers[i].free()
            layers[i] = RemoteBlock(layers[i])
    return before - set(model.parameters())


def shard_pipeline(model: Any, group: dist.Group) -> range:
    """Split `model` (built and loaded) in place over `group` by layers; returns this rank's run."""
    size, rank = group.size(), group.rank()
    if model.model_type not in PIPELINE_FAMILIES:
        raise ShardingError(f"pipeline parallelism does not support model type {model.model_type!r}; supported: "
                            f"{', '.join(PIPELINE_FAMILIES)}")
    layers = model.layers
    ranges = layer_ranges(len(layers), size)
    mine = ranges[rank]
    if size == 1:
        return mine
    last = len(layers) - 1
    for i in range(len(layers)):
        owned = i in mine
        first_of_stage = owned and i == mine.start and rank > 0
        last_of_stage = owned and i == mine.stop - 1 and rank < size - 1
        if owned or i == last:
            if not owned:
                layers[i].free()
            layers[i] = StageBlock(layers[i] if owned else None, group, receive=first_of_stage,
                                   send=last_of_stage, gather=i == last, like=layers[i])
        else:
            layers[i].free()
            layers[i] = RemoteBlock(layers[i])
    return mine


__all__ = ["PIPELINE_FAMILIES", "RemoteBlock", "StageBlock", "drop_remote_layers", "layer_ranges", "shard_pipeline"]

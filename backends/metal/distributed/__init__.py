"""Models split over several processes (MLX's distributed backends): tensor parallelism
(`tensor.py`), pipeline parallelism (`pipeline.py`), and what every rank must agree on to stay in
step (`runtime.py`). The loader splits a safetensors model before its weights go in
(`shard_before_load`, then `partial.narrow_weights` reads each rank's part only, then
`finish_after_load`); `shard_loaded(loaded, mode)` splits a model loaded whole (GGUF)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pymlxc.core as mx
from pymlxc.core import distributed as dist

from .errors import PeerLostError, ShardingError
from .partial import Source, Sources, narrow_weights
from .pipeline import PIPELINE_FAMILIES, drop_remote_layers, layer_ranges, shard_pipeline
from .runtime import MODES, agree_options, join_group
from .tensor import TENSOR_FAMILIES, Layouts, shard_tensor_parallel


def shard_before_load(model: Any, mode: str) -> tuple[dist.Group, Callable[[str], bool], Layouts]:
    """Split `model`, built with placeholder parameters, by `mode` before its weights are read: the
    group, which checkpoint tensors belong to no parameter of this rank (pipeline: the blocks
    other ranks run), and the parameters split by sections (`tensor.Layouts`)."""
    group = join_group(mode)
    if mode == "tensor":
        layouts = shard_tensor_parallel(model, group, evaluate=False)
        return group, lambda name: False, layouts
    dropped = drop_remote_layers(model, group)
    return group, dropped.__contains__, {}


def finish_after_load(model: Any, mode: str, group: dist.Group) -> None:
    """What splitting needs once the weights are in: the pipeline's stage hand-overs."""
    if mode == "pipeline":
        shard_pipeline(model, group)


def _file_layout(model: Any) -> int:
    """GGUF block layers whose Q6_K weights were rearranged for the CUDA kernel back in the file's
    layout (`gguf_layers.file_layout`); how many (0 without block layers)."""
    if not any(getattr(m, "planes", False) for _, m in model.named_modules()):
        return 0
    from ..gguf_layers import file_layout  # noqa: PLC0415 - GGUF models only (the gguf package)

    return file_layout(model)


def shard_loaded(loaded: Any, mode: str) -> None:
    """Split the model of `loaded` (a loader.LoadedModel) over the group of the processes launched
    together, by `mode` ("tensor" or "pipeline"); the whole model is freed on failure."""
    group = join_group(mode)
    try:
        if mode == "tensor":
            planes = _file_layout(loaded.model)  # a split cuts rows and blocks of the file's layout
            shard_tensor_parallel(loaded.model, group)
            if planes:
                from ..gguf_layers import use_planes  # noqa: PLC0415 - GGUF models only (the gguf package)

                use_planes(loaded.model, loaded.model.compute_dtype)
        else:
            shard_pipeline(loaded.model, group)
        mx.clear_cache()  # the parts other ranks keep were read: give their memory back now
    except BaseException:
        loaded.free()
        raise


__all__ = ["MODES", "PIPELINE_FAMILIES", "TENSOR_FAMILIES", "PeerLostError", "ShardingError", "Source", "Sources",
           "agree_options", "finish_after_load", "join_group", "layer_ranges", "narrow_weights", "shard_before_load",
           "shard_loaded", "shard_pipeline", "shard_tensor_parallel"]

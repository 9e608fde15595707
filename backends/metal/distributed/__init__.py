"""Models split over several processes (MLX's distributed backends): tensor parallelism
(`tensor.py`), pipeline parallelism (`pipeline.py`), and what every rank must agree on to stay in
step (`runtime.py`). `shard_loaded(loaded, mode)` applies a mode to a model the loader built."""
from __future__ import annotations

from typing import Any

import pymlxc.core as mx

from .errors import PeerLostError, ShardingError
from .pipeline import PIPELINE_FAMILIES, layer_ranges, shard_pipeline
from .runtime import MODES, agree_options, join_group
from .tensor import TENSOR_FAMILIES, shard_tensor_parallel


def shard_loaded(loaded: Any, mode: str) -> None:
    """Split the model of `loaded` (a loader.LoadedModel) over the group of the processes launched
    together, by `mode` ("tensor" or "pipeline"); the whole model is freed on failure."""
    group = join_group(mode)
    try:
        if mode == "tensor":
            shard_tensor_parallel(loaded.model, group)
        else:
            shard_pipeline(loaded.model, group)
        mx.clear_cache()  # the parts other ranks keep were read: give their memory back now
    except BaseException:
        loaded.free()
        raise


__all__ = ["MODES", "PIPELINE_FAMILIES", "TENSOR_FAMILIES", "PeerLostError", "ShardingError", "agree_options",
           "join_group", "layer_ranges", "shard_loaded", "shard_pipeline", "shard_tensor_parallel"]

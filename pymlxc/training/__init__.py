"""Training: LoRA fine-tuning (`train`), its configuration, losses, AdamW, datasets and adapter files.

    import pymlxc
    model = pymlxc.load_model("path/to/model", backend="metal")
    result = pymlxc.train(model, "data/", "adapters/", lora=pymlxc.LoRAConfig(rank=8), iters=200)
    model.adapter.save("adapters-peft/", format="peft")
"""
from __future__ import annotations

from .adapters import AdapterError, AdapterWeights, read_adapter, write_mlx_adapter, write_peft_adapter
from .config import Encoder, LoRAAdapter, LoRAConfig, SupportsTraining, TrainableModel, TrainConfig
from .data import DatasetError, iterate_batches, load_records, make_batch, read_jsonl, tokenize, tokenize_all
from .losses import cross_entropy, masked_cross_entropy, mse
from .optim import AdamW, clip_grad_norm, cosine_schedule, global_norm
from .trainer import Trainer, TrainReport, TrainResult, train
from .trees import tree_flatten, tree_map, tree_unflatten

__all__ = [
    "AdamW", "AdapterError", "AdapterWeights", "DatasetError", "Encoder", "LoRAAdapter", "LoRAConfig",
    "SupportsTraining", "TrainConfig", "TrainReport", "TrainResult", "TrainableModel", "Trainer", "clip_grad_norm",
    "cosine_schedule", "cross_entropy", "global_norm", "iterate_batches", "load_records", "make_batch",
    "masked_cross_entropy", "mse", "read_adapter", "read_jsonl", "tokenize", "tokenize_all", "train", "tree_flatten",
    "tree_map", "tree_unflatten", "write_mlx_adapter", "write_peft_adapter",
]

"""pymlxc: MLX through mlx-c from Python, and LLM inference and LoRA on top.

`pymlxc.core` is the binding (in the shape of `mlx.core`); the rest is the inference API:
`load_model`, the backend registry, `TextModel`, options, result types, `discover`, memory controls.
"""
from __future__ import annotations

from . import core, training
from .core import MLXError
from .discover import DiscoveredModel, discover
from .memory import (
    clear_cache,
    get_active_memory,
    get_cache_memory,
    get_peak_memory,
    reset_peak_memory,
    set_cache_limit,
    set_memory_limit,
    set_wired_limit,
)
from .model import Backend, GenerationCancelled, ModelClosedError, TextModel
from .options import GenerateConfig, LoadConfig
from .registry import BackendUnavailableError, default_backend, get, list_backends, load_model, register
from .training import LoRAAdapter, LoRAConfig, TrainableModel, TrainConfig, train
from .types import (
    AttentionSnapshot,
    BatchResult,
    ClassifyResult,
    ContextLengthError,
    GenerateMetrics,
    Message,
    ModelInfo,
    TemplateError,
    Token,
)

__version__ = "0.1.0"


def _register_builtin_backends() -> None:
    import importlib

    for module in ("pymlxc.backends.metal", "pymlxc.backends.mlx_lm"):
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue
        register_backend = getattr(mod, "register_backend", None)
        if register_backend is not None:
            register_backend()


_register_builtin_backends()

__all__ = [
    "core", "MLXError", "discover", "DiscoveredModel", "Backend", "TextModel", "GenerationCancelled",
    "ModelClosedError", "GenerateConfig", "LoadConfig", "BackendUnavailableError", "default_backend", "get",
    "list_backends", "load_model", "register", "AttentionSnapshot", "BatchResult", "ClassifyResult", "GenerateMetrics",
    "Message", "TemplateError", "ContextLengthError",
    "ModelInfo", "Token", "clear_cache", "get_active_memory", "get_cache_memory", "get_peak_memory",
    "reset_peak_memory", "set_cache_limit", "set_memory_limit", "set_wired_limit",
    "training", "train", "LoRAConfig", "LoRAAdapter", "TrainConfig", "TrainableModel",
]

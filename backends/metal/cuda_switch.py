"""The two things every CUDA-only lever of the native backend asks: is this process on MLX's CUDA
device, and what does its `auto` / `0` / `1` environment switch say."""
from __future__ import annotations

import os

import pymlxc.core as mx

CHOICES = ("auto", "0", "1")


def setting(name: str) -> str:
    """The switch `name` (default `auto`); another value is a ValueError naming the variable."""
    value = os.environ.get(name, "auto").strip().lower()
    if value not in CHOICES:
        raise ValueError(f"{name} must be auto, 0 or 1, not {value!r}")
    return value


def on_cuda() -> bool:
    """Whether MLX runs on a CUDA GPU here (its CUDA build and the GPU as the default device)."""
    return mx.cuda_available() and mx.default_device().type == "gpu"


__all__ = ["setting", "on_cuda"]

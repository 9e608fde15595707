"""The errors a checkpoint's files raise: each message names the file and what is wrong."""
from __future__ import annotations


class ConfigError(ValueError):
    """config.json lacks a field the architecture needs, or holds an unusable value."""


class WeightsFileError(ValueError):
    """A safetensors file is missing, truncated or corrupt; the message names the file."""


__all__ = ["ConfigError", "WeightsFileError"]

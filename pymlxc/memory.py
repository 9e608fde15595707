"""Memory controls of the public API (MLX's allocator, whatever the device)."""
from __future__ import annotations

from .core.memory import (
    clear_cache,
    device_info,
    get_active_memory,
    get_cache_memory,
    get_memory_limit,
    get_peak_memory,
    reset_peak_memory,
    set_cache_limit,
    set_memory_limit,
    set_wired_limit,
)

__all__ = [
    "clear_cache", "device_info", "get_active_memory", "get_cache_memory", "get_memory_limit", "get_peak_memory",
    "reset_peak_memory", "set_cache_limit", "set_memory_limit", "set_wired_limit",
]

"""Memory controls and device facts."""
from __future__ import annotations

from typing import Any

from ._loader import check, ffi, lib
from .device import Device, default_device


def _size(fn: Any, *args: Any) -> int:
    out = ffi.new("size_t *")
    check(fn(out, *args))
    return int(out[0])


def get_active_memory() -> int:
    """Bytes held by live arrays."""
    return _size(lib.mlx_get_active_memory)


def get_peak_memory() -> int:
    return _size(lib.mlx_get_peak_memory)


def get_cache_memory() -> int:
    """Bytes kept by MLX's buffer cache for reuse."""
    return _size(lib.mlx_get_cache_memory)


def get_memory_limit() -> int:
    return _size(lib.mlx_get_memory_limit)


def reset_peak_memory() -> None:
    check(lib.mlx_reset_peak_memory())


def clear_cache() -> None:
    check(lib.mlx_clear_cache())


def set_cache_limit(limit: int) -> int:
    """Set the buffer cache limit in bytes; returns the previous limit."""
    return _size(lib.mlx_set_cache_limit, int(limit))


def set_memory_limit(limit: int) -> int:
    return _size(lib.mlx_set_memory_limit, int(limit))


def set_wired_limit(limit: int) -> int:
    return _size(lib.mlx_set_wired_limit, int(limit))


def metal_available() -> bool:
    out = ffi.new("bool *")
    check(lib.mlx_metal_is_available(out))
    return bool(out[0])


def cuda_available() -> bool:
    out = ffi.new("bool *")
    check(lib.mlx_cuda_is_available(out))
    return bool(out[0])


def device_info(device: Device | None = None) -> dict[str, str | int]:
    """MLX's facts about a device (name, memory sizes, architecture, ...)."""
    dev = (device or default_device())._new_c()
    info = ffi.new("mlx_device_info *")
    keys = ffi.new("mlx_vector_string *")
    try:
        check(lib.mlx_device_info_get(info, dev))
        check(lib.mlx_device_info_get_keys(keys, info[0]))
        out: dict[str, str | int] = {}
        for i in range(lib.mlx_vector_string_size(keys[0])):
            key_p = ffi.new("char **")
            check(lib.mlx_vector_string_get(key_p, keys[0], i))
            key = ffi.string(key_p[0])
            is_str = ffi.new("bool *")
            check(lib.mlx_device_info_is_string(is_str, info[0], key))
            if is_str[0]:
                val = ffi.new("const char **")
                check(lib.mlx_device_info_get_string(val, info[0], key))
                out[key.decode()] = ffi.string(val[0]).decode()
            else:
                size = ffi.new("size_t *")
                check(lib.mlx_device_info_get_size(size, info[0], key))
                out[key.decode()] = int(size[0])
        return out
    finally:
        if keys[0].ctx != ffi.NULL:
            lib.mlx_vector_string_free(keys[0])
        if info[0].ctx != ffi.NULL:
            lib.mlx_device_info_free(info[0])
        lib.mlx_device_free(dev)

"""Loading and saving arrays: safetensors (with metadata), .npy, and GGUF (through MLX's own readers)."""
from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..files import check_regular_file
from ._loader import MLXError, check, ffi, lib
from .array import Array, asarray, new_handle, wrap
from .device import cpu, default_stream


def _cpu_stream() -> Any:
    # MLX reads files on the CPU; arrays move to the GPU lazily when used there.
    return default_stream(cpu)._c


def _check_file(path: str | os.PathLike[str]) -> bytes:
    # MLX opens the file itself: a FIFO or a device there would block or never end.
    check_regular_file(path)
    return str(Path(path)).encode()


def _unpack_array_map(m: Any) -> dict[str, Array]:
    out: dict[str, Array] = {}
    it = lib.mlx_map_string_to_array_iterator_new(m)
    try:
        key = ffi.new("const char **")
        while True:
            p = new_handle()
            status = lib.mlx_map_string_to_array_iterator_next(key, p, it)
            if status == 2:
                break
            check(status)
            out[ffi.string(key[0]).decode()] = wrap(p)
    finally:
        lib.mlx_map_string_to_array_iterator_free(it)
    return out


def _unpack_string_map(m: Any) -> dict[str, str]:
    out: dict[str, str] = {}
    it = lib.mlx_map_string_to_string_iterator_new(m)
    try:
        key = ffi.new("const char **")
        value = ffi.new("const char **")
        while True:
            status = lib.mlx_map_string_to_string_iterator_next(key, value, it)
            if status == 2:
                break
            check(status)
            out[ffi.string(key[0]).decode()] = ffi.string(value[0]).decode()
    finally:
        lib.mlx_map_string_to_string_iterator_free(it)
    return out


def load_safetensors(path: str | os.PathLike[str]) -> tuple[dict[str, Array], dict[str, str]]:
    """(tensors, metadata) of a .safetensors file. Arrays are lazy: the file is read on first use."""
    name = _check_file(path)
    arrays = ffi.new("mlx_map_string_to_array *", lib.mlx_map_string_to_array_new())
    meta = ffi.new("mlx_map_string_to_string *", lib.mlx_map_string_to_string_new())
    try:
        if lib.mlx_load_safetensors(arrays, meta, name, _cpu_stream()):
            from ._loader import last_error

            raise MLXError(f"cannot load safetensors file {os.fspath(path)}: {last_error()}")
        return _unpack_array_map(arrays[0]), _unpack_string_map(meta[0])
    finally:
        lib.mlx_map_string_to_array_free(arrays[0])
        lib.mlx_map_string_to_string_free(meta[0])


def save_safetensors(path: str | os.PathLike[str], arrays: Mapping[str, Any], metadata: Mapping[str,
                     str] | None = None) -> None:
    amap = lib.mlx_map_string_to_array_new()
    smap = lib.mlx_map_string_to_string_new()
    keep = []
    try:
        for k, v in arrays.items():
            a = asarray(v)
            keep.append(a)
            check(lib.mlx_map_string_to_array_insert(amap, k.encode(), a.handle))
        for k, v in (metadata or {}).items():
            check(lib.mlx_map_string_to_string_insert(smap, k.encode(), str(v).encode()))
        check(lib.mlx_save_safetensors(os.fspath(path).encode(), amap, smap))
    finally:
        lib.mlx_map_string_to_array_free(amap)
        lib.mlx_map_string_to_string_free(smap)


_NOT_FOUND = 2  # mlx-c's GGUF accessors return 2 (without an error message) for a missing key


class GGUFFile:
    """A GGUF file read by MLX: tensors (quantized Q4_0/Q4_1/Q8_0 come as packed weight/scales/biases
    triples) and metadata (strings, string lists, numeric arrays). Owns its handle."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        name = _check_file(path)
        self.path = Path(path)
        self._h = ffi.new("mlx_io_gguf *", lib.mlx_io_gguf_new())
        if lib.mlx_load_gguf(self._h, name, _cpu_stream()):
            from ._loader import last_error

            lib.mlx_io_gguf_free(self._h[0])
            self._h = None
            raise MLXError(f"cannot load GGUF file {self.path}: {last_error()}")

    def _handle(self) -> Any:
        if self._h is None:
            raise MLXError("GGUF file used after close()")
        return self._h[0]

    def keys(self) -> list[str]:
        vec = ffi.new("mlx_vector_string *")
        check(lib.mlx_io_gguf_get_keys(vec, self._handle()))
        try:
            out = []
            s = ffi.new("char **")
            for i in range(lib.mlx_vector_string_size(vec[0])):
                check(lib.mlx_vector_string_get(s, vec[0], i))
                out.append(ffi.string(s[0]).decode())
            return out
        finally:
            lib.mlx_vector_string_free(vec[0])

    def tensor(self, key: str) -> Array:
        p = new_handle()
        status = lib.mlx_io_gguf_get_array(p, self._handle(), key.encode())
        if status == _NOT_FOUND:
            raise KeyError(f"no tensor {key!r} in {self.path}")
        check(status)
        return wrap(p)

    def metadata(self, key: str) -> str | list[str] | Array | None:
        """The value of metadata `key` (a string, a list of strings, or an Array for numbers and
        numeric lists), or None when the file has no such key."""
        h, k, flag = self._handle(), key.encode(), ffi.new("bool *")
        status = lib.mlx_io_gguf_has_metadata_string(flag, h, k)
        if status == _NOT_FOUND:
            return None
        check(status)
        if flag[0]:
            s = ffi.new("mlx_string *")
            check(lib.mlx_io_gguf_get_metadata_string(s, h, k))
            try:
                text: str = ffi.string(lib.mlx_string_data(s[0])).decode("utf-8", "replace")
                return text
            finally:
                lib.mlx_string_free(s[0])
        check(lib.mlx_io_gguf_has_metadata_vector_string(flag, h, k))
        if flag[0]:
            vec = ffi.new("mlx_vector_string *")
            check(lib.mlx_io_gguf_get_metadata_vector_string(vec, h, k))
            try:
                c = ffi.new("char **")
                out = []
                for i in range(lib.mlx_vector_string_size(vec[0])):
                    check(lib.mlx_vector_string_get(c, vec[0], i))
                    out.append(ffi.string(c[0]).decode("utf-8", "replace"))
                return out
            finally:
                lib.mlx_vector_string_free(vec[0])
        check(lib.mlx_io_gguf_has_metadata_array(flag, h, k))
        if flag[0]:
            p = new_handle()
            check(lib.mlx_io_gguf_get_metadata_array(p, h, k))
            return wrap(p)
        return None

    def close(self) -> None:
        if self._h is not None:
            lib.mlx_io_gguf_free(self._h[0])
            self._h = None

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_h", None) is not None and lib is not None:
            self.close()


def load_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    return GGUFFile(path)


def load(path: str | os.PathLike[str], return_metadata: bool = False) -> Any:
    """Load .safetensors (dict of arrays), .npy (one array) or .gguf (GGUFFile) by extension."""
    suffix = Path(path).suffix
    if suffix == ".safetensors":
        arrays, meta = load_safetensors(path)
        return (arrays, meta) if return_metadata else arrays
    if suffix == ".gguf":
        return load_gguf(path)
    if suffix == ".npy":
        name = _check_file(path)
        p = new_handle()
        check(lib.mlx_load(p, name, _cpu_stream()))
        return wrap(p)
    raise ValueError(f"cannot load {path}: unknown extension {suffix!r} (.safetensors, .npy, .gguf)")

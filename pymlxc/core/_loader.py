"""The one door to C: opens libmlx and libmlxc, declares the generated cdef, installs the error handler.

Every other module imports `ffi`, `lib`, `check` and `MLXError` from here.
"""
from __future__ import annotations

import contextlib
import ctypes
import importlib.metadata
import importlib.util
import json
import re
import sys
import tempfile
import threading
import types
from pathlib import Path
from typing import Any

import _cffi_backend
import cffi
from cffi.recompiler import make_py_source

from .. import ptx_cache, settings, user_cache

REBUILD_HINT = "python build_mlxc.py --force   (or reinstall: pip install -e '.[cpu]', or .[cuda13] on NVIDIA)"


class MLXError(RuntimeError):
    """An error raised by MLX (through mlx-c), carrying MLX's own message."""


class LibraryNotBuiltError(ImportError):
    """libmlxc is missing or was built for another MLX."""


def _lib_dir() -> Path:
    override = settings.current().lib_dir  # PYMLXC_LIB_DIR
    return override if override is not None else Path(__file__).resolve().parent.parent / "_lib"


def _read_stamp(lib_dir: Path) -> dict[str, Any]:
    stamp_path = lib_dir / "stamp.json"
    if not stamp_path.is_file():
        raise LibraryNotBuiltError(
            f"libmlxc has not been built ({stamp_path} is missing). Build it with: {REBUILD_HINT}"
        )
    stamp: dict[str, Any] = json.loads(stamp_path.read_text())
    try:
        installed = importlib.metadata.version("mlx")
    except importlib.metadata.PackageNotFoundError as exc:
        raise LibraryNotBuiltError(
            "MLX is not installed; install pymlxc with the extra for your machine (pip install 'pymlxc[cpu]' on "
            "Linux, 'pymlxc[cuda13]' on NVIDIA, plain 'pymlxc' on macOS), which pins the MLX it was built for, "
            f"and rebuild: {REBUILD_HINT}"
        ) from exc
    if installed != stamp["mlx_version"]:
        raise LibraryNotBuiltError(
            f"libmlxc in {lib_dir} was built for MLX {stamp['mlx_version']} but MLX {installed} "
            f"is installed. Rebuild with: {REBUILD_HINT}"
        )
    return stamp


def _preload_libmlx(stamp: dict[str, Any]) -> None:
    """Load the wheel's libmlx globally first so libmlxc resolves against that exact copy."""
    spec = importlib.util.find_spec("mlx")
    prefixes = [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []
    prefixes.append(Path(stamp["mlx_prefix"]))
    name = "libmlx.dylib" if sys.platform == "darwin" else "libmlx.so"
    for prefix in prefixes:
        candidate = prefix / "lib" / name
        if candidate.is_file():
            ctypes.CDLL(str(candidate), mode=ctypes.RTLD_GLOBAL)
            return
    raise LibraryNotBuiltError(f"{name} not found under {', '.join(map(str, prefixes))}")


def declared_ffi(cdef: str, name: str, store: user_cache.Store | None = None) -> Any:
    """An FFI with `cdef` declared, in cffi's out-of-line ABI mode: cffi writes the parsed
    declarations as a Python module, kept in the user cache (`user_cache.py`) under a key of the
    declarations, cffi's and Python's versions, so that later processes skip parsing them (about
    0.1 s for mlx-c's). A cache that is off, unwritable or holds a bad entry costs the parse, never
    an error; every process gets the same kind of FFI either way."""
    store = store if store is not None else user_cache.Store("cffi")
    key = {"name": name, "cdef_sha256": user_cache.digest(cdef), "cffi": cffi.__version__,
           "cffi_backend": _cffi_backend.__version__, "python": list(sys.version_info[:2])}
    module_name = f"_pymlxc_{name}_ffi"
    entry = store.get(key)
    if isinstance(entry, dict) and isinstance(entry.get("source"), str):
        try:
            return _exec_ffi_module(module_name, entry["source"])
        except Exception:  # noqa: BLE001 - a bad entry (checksum-valid but not loadable): rebuilt below
            pass
    builder = cffi.FFI()
    builder.cdef(cdef)
    with tempfile.TemporaryDirectory(prefix="pymlxc-cffi-") as tmp:
        out = Path(tmp) / f"{module_name}.py"
        # What `emit_python_code` runs, without its "generating ..." line on stdout (the bridge's
        # worker speaks JSON Lines there).
        make_py_source(builder, module_name, str(out), verbose=False)
        source = out.read_text()
    ffi = _exec_ffi_module(module_name, source)
    store.put(key, {"source": source})
    return ffi


def _exec_ffi_module(module_name: str, source: str) -> Any:
    module = types.ModuleType(module_name)
    exec(compile(source, f"<pymlxc cached {module_name}>", "exec"), module.__dict__)  # noqa: S102 - checksummed
    ffi = module.__dict__.get("ffi")
    if not isinstance(ffi, _cffi_backend.FFI):
        raise TypeError(f"{module_name} defines no FFI")
    return ffi


def _open() -> tuple[Any, Any, dict[str, Any], dict[str, Any], Path]:
    lib_dir = _lib_dir()
    stamp = _read_stamp(lib_dir)
    ptx_cache.configure()  # before MLX compiles anything: it reads the folder's name once
    _preload_libmlx(stamp)
    ffi = declared_ffi((lib_dir / "cdef.h").read_text(), "mlxc")
    lib_path = lib_dir / stamp["library"]
    try:
        lib = ffi.dlopen(str(lib_path))
    except OSError as exc:
        raise LibraryNotBuiltError(f"cannot open {lib_path}: {exc}. Rebuild with: {REBUILD_HINT}") from exc
    signatures = json.loads((lib_dir / "signatures.json").read_text())
    return ffi, lib, stamp, signatures, lib_path


ffi, lib, STAMP, SIGNATURES, _LIB_PATH = _open()

# ---------------------------------------------------------------------------- the fast view
# Every mlx-c handle is `struct { void *ctx; }`, and the C ABIs MLX runs on (x86-64 System V,
# AArch64/Apple arm64, Windows x64) pass and return such a struct exactly as they do a `void *`.
# cffi, though, marshals a struct argument through a slower path than a pointer (about 60 ns each
# here, a tenth of an op's cost). So the functions of the per-op paths are declared a second time,
# from the same build-time signatures, with their array and stream handles as `void *` (and array
# results as `void **`): `fast` calls the very same functions of the very same library. An Array
# keeps its handle as that `void *` (`mlx_array.ctx`); `Array.handle` gives the struct for `lib`.
_FAST_PARAM = {
    "mlx_array *": "void **", "const mlx_array": "void *", "mlx_array": "void *", "const mlx_stream": "void *",
    "mlx_vector_array *": "void **", "const mlx_vector_array": "void *", "mlx_dtype": "int", "mlx_fft_norm": "int",
}
_FAST_SAME = {
    "int", "bool", "float", "double", "size_t", "uint64_t", "const int *", "const int64_t *", "const char *",
    "const void *", "mlx_optional_int", "mlx_optional_float", "mlx_optional_dtype",
}
_FAST_RETURN = {
    "int": "int", "size_t": "size_t", "mlx_array": "void *", "mlx_dtype": "int", "const int *": "const int *",
}
_FAST_TYPEDEFS = """
typedef struct { int value; bool has_value; } mlx_optional_int;
typedef struct { float value; bool has_value; } mlx_optional_float;
typedef struct { int value; bool has_value; } mlx_optional_dtype;
"""


def _fast_cdef(signatures: dict[str, Any]) -> str:
    lines = [_FAST_TYPEDEFS]
    for name, sig in signatures.items():
        ret = _FAST_RETURN.get(sig["ret"])
        params = []
        for ctype, pname in sig["params"]:
            ctype = _FAST_PARAM.get(ctype, ctype if ctype in _FAST_SAME else "")
            if not ctype:
                break
            params.append(f"{ctype} {pname}")
        else:
            if ret is not None:
                lines.append(f"{ret} {name}({', '.join(params) or 'void'});")
    return "\n".join(lines)


fast_ffi = declared_ffi(_fast_cdef(SIGNATURES), "mlxc_fast")
fast = fast_ffi.dlopen(str(_LIB_PATH))

# In ABI mode cffi resolves `lib.<name>` lazily, under its own non-reentrant lock. A destructor run by
# the garbage collector while that lock is held (say, during `ffi.new` parsing a new type) and touching
# an unresolved name would deadlock; resolving every name once here (~40 ms) rules that out.
for _library in (lib, fast):
    for _name in dir(_library):
        getattr(_library, _name)
del _name, _library

# The per-op paths call these with a ctype object (`ffi.typeof(...)`), never a string. The
# out-of-line FFI's `new` and `gc` are builtins already (no Python frame, unlike in-line mode's).
new_cdata: Any = ffi.new
gc_cdata: Any = ffi.gc

# ---------------------------------------------------------------------------- errors
# mlx-c's default handler calls exit(); ours keeps the message for the calling thread, and the
# caller turns the non-zero status into MLXError. It must never raise into C.
error_state = threading.local()


def _keep_error(msg: Any, _data: Any) -> None:
    with contextlib.suppress(BaseException):  # never let anything cross into C
        error_state.message = ffi.string(msg).decode("utf-8", "replace") if msg != ffi.NULL else "unknown MLX error"


# Kept at module level: MLX calls it for the life of the process.
_error_handler: Any = ffi.callback("void(*)(const char *, void *)")(_keep_error)
lib.mlx_set_error_handler(_error_handler, ffi.NULL, ffi.NULL)


def last_error() -> str:
    """Return and clear this thread's last MLX error message."""
    message = getattr(error_state, "message", None) or "MLX call failed"
    error_state.message = None
    # mlx-c appends " at <its source file>:<line>": keep MLX's own words only.
    return _LOCATION.sub("", message)


_LOCATION = re.compile(r" at \S+/mlx/c/\w+\.cpp:\d+$")


def check(status: int) -> None:
    """Raise MLXError with MLX's message when an mlx-c call returned non-zero."""
    if status:
        raise MLXError(last_error())


def mlx_c_version() -> str:
    s = ffi.new("mlx_string *")
    check(lib.mlx_version(s))
    try:
        version: str = ffi.string(lib.mlx_string_data(s[0])).decode()
        return version
    finally:
        lib.mlx_string_free(s[0])

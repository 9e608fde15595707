"""Generate Python wrappers for mlx-c's regular functions from the build-time signatures.

A regular function fills one or more results (`mlx_array *` / `mlx_vector_array *`), takes arrays,
ints, int lists, optionals, strings and dtypes, and ends with a stream. Each wrapper converts its
arguments, checks the status and returns Arrays; its parameters carry mlx-c's names (which are
MLX's Python names) and the stream is the keyword `stream`.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from . import dtypes as _dt
from ._loader import SIGNATURES, MLXError, check, ffi, lib
from .array import Array, FreedArrayError, asarray, new_handle, release_failed, wrap
from .device import resolve_stream

# Defaults for parameters that MLX's Python API also defaults.
DEFAULTS: dict[str, str] = {"keepdims": "False", "stream": "None"}


def arr(x: Any) -> Array:
    return x if type(x) is Array else asarray(x)


def handle_of(a: Array) -> Any:
    p = a._p
    if p is None:
        raise FreedArrayError("array used after free()")
    return p[0]


_NULL_ARRAY = ffi.new("mlx_array *")


def opt_handle(x: Any) -> tuple[Any, Any]:
    """(keepalive, struct) for a nullable array argument: None gives mlx-c's null array."""
    if x is None:
        return None, _NULL_ARRAY[0]
    a = arr(x)
    return a, handle_of(a)


def int_list(values: Any) -> tuple[Any, int]:
    if isinstance(values, int):
        values = (values,)
    values = [int(v) for v in values]
    return ffi.new("int[]", values), len(values)


def int64_list(values: Sequence[int]) -> tuple[Any, int]:
    values = [int(v) for v in values]
    return ffi.new("int64_t[]", values), len(values)


def opt_int(v: int | None) -> Any:
    return (int(v), True) if v is not None else (0, False)


def opt_float(v: float | None) -> Any:
    return (float(v), True) if v is not None else (0.0, False)


def opt_dtype(v: Any) -> Any:
    return (_dt.as_dtype(v).value, True) if v is not None else (0, False)


def dtype_value(v: Any) -> int:
    return _dt.as_dtype(v).value


def vector_of(arrays: Sequence[Any]) -> tuple[list[Array], Any]:
    items = [arr(a) for a in arrays]
    handles = ffi.new("mlx_array[]", [handle_of(a) for a in items])
    vec = lib.mlx_vector_array_new_data(handles, len(items))
    return items, ffi.gc(ffi.new("mlx_vector_array *", vec), _free_vector)


def _free_vector(p: Any) -> None:
    lib.mlx_vector_array_free(p[0])


def new_vector() -> Any:
    return ffi.gc(ffi.new("mlx_vector_array *", lib.mlx_vector_array_new()), _free_vector)


def unpack_vector(vec: Any) -> list[Array]:
    out = []
    for i in range(lib.mlx_vector_array_size(vec)):
        p = new_handle()
        check(lib.mlx_vector_array_get(p, vec, i))
        out.append(wrap(p))
    return out


FFT_NORM = {"backward": "MLX_FFT_NORM_BACKWARD", "ortho": "MLX_FFT_NORM_ORTHO", "forward": "MLX_FFT_NORM_FORWARD"}


def fft_norm(v: str) -> int:
    try:
        return getattr(lib, FFT_NORM[v])
    except KeyError:
        raise ValueError(f"fft norm must be one of {sorted(FFT_NORM)}, not {v!r}") from None


def cstr(v: str) -> bytes:
    return v.encode()


def fail(p: Any) -> None:
    release_failed(p)
    from ._loader import last_error

    raise MLXError(last_error())


_ENV: dict[str, Any] = {
    "lib": lib, "ffi": ffi, "new_handle": new_handle, "wrap": wrap, "fail": fail, "arr": arr,
    "handle_of": handle_of, "opt_handle": opt_handle, "int_list": int_list, "int64_list": int64_list,
    "opt_int": opt_int, "opt_float": opt_float, "opt_dtype": opt_dtype, "dtype_value": dtype_value,
    "vector_of": vector_of, "new_vector": new_vector, "unpack_vector": unpack_vector,
    "resolve_stream": resolve_stream, "cstr": cstr, "fft_norm": fft_norm, "Array": Array,
    "FreedArrayError": FreedArrayError, "release_failed": release_failed, "MLXError": MLXError,
}


def _build(cname: str, sig: dict[str, Any]) -> Callable[..., Any] | None:
    params: list[list[str]] = sig["params"]
    if not params or params[-1][0] != "const mlx_stream":
        return None
    nullable = set(sig.get("nullable", ()))
    results: list[tuple[str, str]] = []
    i = 0
    while i < len(params) - 1 and params[i][0] in ("mlx_array *", "mlx_vector_array *"):
        results.append((params[i][0], params[i][1]))
        i += 1
    if not results:
        return None
    py_params: list[str] = []
    pre: list[str] = []
    call: list[str] = []
    body_params = params[i:-1]
    j = 0
    while j < len(body_params):
        ctype, name = body_params[j]
        nxt = body_params[j + 1] if j + 1 < len(body_params) else None
        if name in ("lambda", "from", "def", "class", "global"):
            name = name + "_"
        if ctype == "const mlx_array":
            if name in nullable:
                py_params.append(f"{name}=None")
                pre.append(f"_k_{name}, _h_{name} = opt_handle({name})")
                call.append(f"_h_{name}")
            else:
                py_params.append(name)
                pre.append(f"{name} = {name} if type({name}) is Array else arr({name})")
                call.append(f"handle_of({name})")
        elif ctype in ("const int *", "const int64_t *") and nxt and nxt[0] == "size_t":
            py_params.append(name)
            fn = "int_list" if ctype == "const int *" else "int64_list"
            pre.append(f"_c_{name}, _n_{name} = {fn}({name})")
            call += [f"_c_{name}", f"_n_{name}"]
            j += 1
        elif ctype == "const mlx_vector_array":
            py_params.append(name)
            pre.append(f"_k_{name}, _v_{name} = vector_of({name})")
            call.append(f"_v_{name}[0]")
        elif ctype in ("int", "bool", "float", "double", "uint64_t", "size_t"):
            py_params.append(name + (f"={DEFAULTS[name]}" if name in DEFAULTS else ""))
            call.append(name)
        elif ctype == "mlx_optional_int":
            py_params.append(f"{name}=None")
            call.append(f"opt_int({name})")
        elif ctype == "mlx_optional_float":
            py_params.append(f"{name}=None")
            call.append(f"opt_float({name})")
        elif ctype == "mlx_optional_dtype":
            py_params.append(f"{name}=None")
            call.append(f"opt_dtype({name})")
        elif ctype == "mlx_dtype":
            py_params.append(name)
            call.append(f"dtype_value({name})")
        elif ctype == "const char *":
            py_params.append(name)
            call.append(f"cstr({name})")
        elif ctype == "mlx_fft_norm":
            py_params.append(f"{name}='backward'")
            call.append(f"fft_norm({name})")
        else:
            return None  # kernels, distributed groups, readers: wrapped by hand where needed
        j += 1
    # Parameters with defaults must come after those without: keep mlx-c's order otherwise.
    required = [p for p in py_params if "=" not in p]
    optional = [p for p in py_params if "=" in p]
    if py_params != required + optional:
        optional = [p + "" for p in optional]
        py_params = required + [f"{p}" for p in optional]
    py_params.append("stream=None")
    res_decl: list[str] = []
    res_args: list[str] = []
    res_out: list[str] = []
    for k, (rtype, _) in enumerate(results):
        if rtype == "mlx_array *":
            res_decl.append(f"_r{k} = new_handle()")
            res_args.append(f"_r{k}")
            res_out.append(f"wrap(_r{k})")
        else:
            res_decl.append(f"_r{k} = new_vector()")
            res_args.append(f"_r{k}")
            res_out.append(f"unpack_vector(_r{k}[0])")
    failure = "; ".join(f"release_failed(_r{k})" for k, (t, _) in enumerate(results) if t == "mlx_array *")
    lines = [f"def {cname}({', '.join(py_params)}):"]
    lines += ["    " + line for line in pre + res_decl]
    lines.append(f"    if lib.{cname}({', '.join(res_args + call + ['resolve_stream(stream)'])}):")
    lines.append(f"        {failure or 'pass'}")
    lines.append("        raise MLXError(_last_error())")
    out = res_out[0] if len(res_out) == 1 else "(" + ", ".join(res_out) + ",)"
    lines.append(f"    return {out}")
    src = "\n".join(lines)
    env = dict(_ENV)
    from ._loader import last_error

    env["_last_error"] = last_error
    try:
        exec(compile(src, f"<pymlxc generated {cname}>", "exec"), env)
    except SyntaxError as exc:  # pragma: no cover - a signature we cannot express
        raise RuntimeError(f"cannot generate wrapper for {cname}: {exc}\n{src}") from exc
    fn = env[cname]
    fn.__doc__ = f"mlx-c `{cname}` ({', '.join(n for _, n in sig['params'])})."
    return fn


def generate() -> dict[str, Callable[..., Any]]:
    """All regular wrappers, keyed by mlx-c name without the `mlx_` prefix."""
    out: dict[str, Callable[..., Any]] = {}
    for cname, sig in SIGNATURES.items():
        fn = _build(cname, sig)
        if fn is not None:
            out[cname[4:]] = fn
    return out


RAW: dict[str, Callable[..., Any]] = generate()

"""Generate Python wrappers for mlx-c's regular functions from the build-time signatures.

A regular function fills one or more results (`mlx_array *` / `mlx_vector_array *`), takes arrays,
ints, int lists, optionals, strings and dtypes, and ends with a stream. Each wrapper converts its
arguments, checks the status and returns Arrays; its parameters carry mlx-c's names (which are
MLX's Python names) and the stream is the keyword `stream`.

These wrappers are the per-op hot path, so each is generated as one flat function (its source is
kept as `__source__`): it calls mlx-c through the `fast` view (handles as `void *`, see _loader),
reads the thread's stream from a cache, and adopts the result without further calls. A Python or
numpy scalar next to an array operand is weakly typed against it, as in mlx.core (`WEAK_FROM`).

Each wrapper also carries its parameters' types in `__annotations__` (strings): `_stubgen` writes
them into `_generated.pyi`, which is how type checkers see these functions.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from . import device as _device
from . import dtypes as _dt
from ._loader import SIGNATURES, MLXError, check, fast, ffi, gc_cdata, last_error, lib, new_cdata
from .array import (
    RESULT_SLOT,
    Array,
    FreedArrayError,
    asarray,
    freed,
    new_handle,
    release_failed,
    release_failed_result,
    weak_handle,
    wrap,
)
from .device import current_stream, resolve_stream

# Defaults for parameters that MLX's Python API also defaults.
DEFAULTS: dict[str, str] = {"keepdims": "False", "stream": "None"}


def arr(x: Any) -> Array:
    return x if type(x) is Array else asarray(x)


def handle_of(a: Array) -> Any:
    """The array's handle (`void *`, for `fast` calls); raises on a freed array."""
    h = a._h
    if h is None:
        raise FreedArrayError("array used after free()")
    return h


def opt_handle(x: Any, *others: Any) -> tuple[Any, Any]:
    """(keepalive, handle) for a nullable array argument: None gives mlx-c's null array."""
    if x is None:
        return None, ffi.NULL
    h = x._h if type(x) is Array else weak(x, *others)
    if h is None:
        freed()
    return h, h


# Array parameters that are weakly typed against others of the same call, as in mlx.core: a Python
# scalar next to an array takes its dtype where it can (mx.maximum(x_bf16, 0.0) stays bfloat16).
WEAK_FROM: dict[str, tuple[str, ...]] = {
    "a": ("b", "c"), "b": ("a", "c"), "c": ("a", "b"), "x": ("y",), "y": ("x",), "update": ("src",),
    "updates": ("a",), "values": ("a",), "vals": ("a",), "src": ("a",), "pad_value": ("a",),
    "a_min": ("a",), "a_max": ("a",), "low": ("high",), "high": ("low",), "lower": ("upper",),
    "upper": ("lower",),
}


def weak(value: Any, *others: Any) -> Any:
    """The handle of a non-Array operand, weakly typed against the first Array among `others`."""
    for other in others:
        if isinstance(other, Array):
            h = weak_handle(value, other.dtype)
            if h is NotImplemented:
                raise TypeError(f"cannot use a {type(value).__name__} as an array")
            return h
    return asarray(value)._h


_INT_ARRAY = ffi.typeof("int[]")
_INT64_ARRAY = ffi.typeof("int64_t[]")


# Shapes, axes and slice bounds repeat (the same reshape in every layer, every step): their C
# buffers are kept by value and reused. mlx-c only reads them (`const int *`).
_INT_LISTS: dict[tuple[int, ...], tuple[Any, int]] = {}
_INT_LISTS_MAX = 4096


def int_list(values: Any) -> tuple[Any, int]:
    """(`int[]` buffer, length) for a shape or axis list (or one int)."""
    t = type(values)
    key = values if t is tuple else tuple(values) if t is list else None
    if key is not None:
        hit = _INT_LISTS.get(key)
        if hit is not None:
            return hit
        try:  # plain ints: cffi converts (and range-checks) them itself
            made = new_cdata(_INT_ARRAY, key), len(key)
        except TypeError:
            made = None
        if made is not None:
            if len(_INT_LISTS) >= _INT_LISTS_MAX:
                _INT_LISTS.clear()
            _INT_LISTS[key] = made
            return made
    elif isinstance(values, int):
        values = (values,)
    values = [int(v) for v in values]
    return new_cdata(_INT_ARRAY, values), len(values)


def int64_list(values: Sequence[int]) -> tuple[Any, int]:
    values = [int(v) for v in values]
    return new_cdata(_INT64_ARRAY, values), len(values)


def opt_int(v: int | None) -> Any:
    return (int(v), True) if v is not None else (0, False)


def opt_float(v: float | None) -> Any:
    return (float(v), True) if v is not None else (0.0, False)


def opt_dtype(v: Any) -> Any:
    return (_dt.as_dtype(v).value, True) if v is not None else (0, False)


def dtype_value(v: Any) -> int:
    return v.value if type(v) is _dt.Dtype else _dt.as_dtype(v).value


ARRAY_ARRAY_TYPE = ffi.typeof("mlx_array[]")
_VECTOR_P = ffi.typeof("mlx_vector_array *")
_vector_new_data = lib.mlx_vector_array_new_data
_vector_new = lib.mlx_vector_array_new
_vector_free = lib.mlx_vector_array_free
_vector_size = lib.mlx_vector_array_size
_vector_get = lib.mlx_vector_array_get


def vector_of(arrays: Sequence[Any]) -> tuple[list[Array], Any]:
    items = [arr(a) for a in arrays]
    handles = new_cdata(ARRAY_ARRAY_TYPE, [[handle_of(a)] for a in items])
    vec = _vector_new_data(handles, len(items))
    return items, gc_cdata(new_cdata(_VECTOR_P, vec), _free_vector)


def _free_vector(p: Any) -> None:
    _vector_free(p[0])


def new_vector() -> Any:
    return gc_cdata(new_cdata(_VECTOR_P, _vector_new()), _free_vector)


def unpack_vector(vec: Any) -> list[Array]:
    out = []
    for i in range(_vector_size(vec)):
        p = new_handle()
        check(_vector_get(p, vec, i))
        out.append(wrap(p))
    return out


FFT_NORM = {"backward": "MLX_FFT_NORM_BACKWARD", "ortho": "MLX_FFT_NORM_ORTHO", "forward": "MLX_FFT_NORM_FORWARD"}


def fft_norm(v: str) -> int:
    try:
        value: int = getattr(lib, FFT_NORM[v])
    except KeyError:
        raise ValueError(f"fft norm must be one of {sorted(FFT_NORM)}, not {v!r}") from None
    return value


def cstr(v: str) -> bytes:
    return v.encode()


def fail(*slots: Any) -> None:
    """After a non-zero status of a `fast` call: free the half-made results (`void **` slots) and
    raise MLX's message."""
    for r in slots:
        release_failed_result(r)
    raise MLXError(last_error())


_VOID_PP = ffi.typeof("void **")


def vector_slot(vec: Any) -> Any:
    """A gc'd `mlx_vector_array *` seen as the `void **` that `fast` functions take."""
    return ffi.cast(_VOID_PP, vec)


# The globals of every generated wrapper (one dict, shared: `_tls` is rebound in place when the
# default device changes, see device._drop_cache).
GENERATED_ENV: dict[str, Any] = {
    "lib": lib, "ffi": ffi, "new_handle": new_handle, "wrap": wrap, "fail": fail, "arr": arr,
    "handle_of": handle_of, "opt_handle": opt_handle, "int_list": int_list, "int64_list": int64_list,
    "opt_int": opt_int, "opt_float": opt_float, "opt_dtype": opt_dtype, "dtype_value": dtype_value,
    "vector_of": vector_of, "new_vector": new_vector, "unpack_vector": unpack_vector,
    "resolve_stream": resolve_stream, "cstr": cstr, "fft_norm": fft_norm, "Array": Array,
    "FreedArrayError": FreedArrayError, "release_failed": release_failed, "MLXError": MLXError,
    "_freed": freed, "_current": current_stream, "_tls": _device._cache, "_new": new_cdata, "_AP": RESULT_SLOT,
    "_gc": gc_cdata, "_free": fast.mlx_array_free, "_vslot": vector_slot, "_anew": object.__new__, "_arr": arr,
    "_weak": weak,
}
_device._cache_listeners.append(lambda cache: GENERATED_ENV.__setitem__("_tls", cache))

# How a wrapper finds its stream: the thread's cached current stream unless one is given.
_STREAM_LINES = [
    "if stream is None:",
    "    try:",
    "        _s = _tls.c",
    "    except AttributeError:",
    "        _s = _current()",
    "else:",
    "    _s = resolve_stream(stream)",
]


def array_arg(name: str, weak_from: Sequence[str] = ()) -> list[str]:
    """Lines that turn parameter `name` into its handle `_h_<name>` (converting non-Arrays, weakly
    typed against the parameters `weak_from`)."""
    convert = f"_weak({name}, {', '.join(weak_from)})" if weak_from else f"_arr({name})._h"
    return [
        f"_h_{name} = {name}._h if type({name}) is Array else {convert}",
        f"if _h_{name} is None:",
        "    _freed()",
    ]


def result_lines(slot: str, out: str) -> list[str]:
    """Lines that adopt the filled result slot `slot` as the Array `out`."""
    return [f"{out} = _anew(Array)", f"{out}._h = _gc({slot}[0], _free)"]


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
    # The parameters' types, as the names of _generated.pyi spell them (see _stubgen).
    ann: dict[str, str] = {}
    pre: list[str] = []
    call: list[str] = []
    body_params = params[i:-1]
    array_names = {n for t, n in body_params if t == "const mlx_array"}
    j = 0
    while j < len(body_params):
        ctype, name = body_params[j]
        nxt = body_params[j + 1] if j + 1 < len(body_params) else None
        if name in ("lambda", "from", "def", "class", "global") or name in GENERATED_ENV:
            name = name + "_"
        if ctype == "const mlx_array":
            weak_from = [n for n in WEAK_FROM.get(name, ()) if n in array_names]
            if name in nullable:
                py_params.append(f"{name}=None")
                ann[name] = "ArrayLike | None"
                pre.append(f"_k_{name}, _h_{name} = opt_handle({', '.join([name, *weak_from])})")
            else:
                py_params.append(name)
                ann[name] = "ArrayLike"
                pre += array_arg(name, weak_from)
            call.append(f"_h_{name}")
        elif ctype in ("const int *", "const int64_t *") and nxt and nxt[0] == "size_t":
            py_params.append(name)
            to_list = "int_list" if ctype == "const int *" else "int64_list"
            ann[name] = "int | Sequence[int]" if ctype == "const int *" else "Sequence[int]"
            pre.append(f"_c_{name}, _n_{name} = {to_list}({name})")
            call += [f"_c_{name}", f"_n_{name}"]
            j += 1
        elif ctype == "const mlx_vector_array":
            py_params.append(name)
            ann[name] = "Sequence[ArrayLike]"
            pre.append(f"_k_{name}, _v_{name} = vector_of({name})")
            call.append(f"_v_{name}[0].ctx")
        elif ctype in ("int", "bool", "float", "double", "uint64_t", "size_t"):
            py_params.append(name + (f"={DEFAULTS[name]}" if name in DEFAULTS else ""))
            ann[name] = {"bool": "bool", "float": "float", "double": "float"}.get(ctype, "int")
            call.append(name)
        elif ctype == "mlx_optional_int":
            py_params.append(f"{name}=None")
            ann[name] = "int | None"
            call.append(f"opt_int({name})")
        elif ctype == "mlx_optional_float":
            py_params.append(f"{name}=None")
            ann[name] = "float | None"
            call.append(f"opt_float({name})")
        elif ctype == "mlx_optional_dtype":
            py_params.append(f"{name}=None")
            ann[name] = "DtypeLike | None"
            call.append(f"opt_dtype({name})")
        elif ctype == "mlx_dtype":
            py_params.append(name)
            ann[name] = "DtypeLike"
            call.append(f"dtype_value({name})")
        elif ctype == "const char *":
            py_params.append(name)
            ann[name] = "str"
            call.append(f"cstr({name})")
        elif ctype == "mlx_fft_norm":
            py_params.append(f"{name}='backward'")
            ann[name] = "str"
            call.append(f"fft_norm({name})")
        else:
            return None  # kernels, distributed groups, readers: wrapped by hand where needed
        j += 1
    # Parameters with defaults must come after those without: keep mlx-c's order otherwise.
    required = [p for p in py_params if "=" not in p]
    optional = [p for p in py_params if "=" in p]
    py_params = required + optional
    py_params.append("stream=None")
    ann["stream"] = "StreamLike"
    kinds = ["Array" if rtype == "mlx_array *" else "list[Array]" for rtype, _ in results]
    ann["return"] = kinds[0] if len(kinds) == 1 else f"tuple[{', '.join(kinds)}]"
    res_decl: list[str] = []
    res_args: list[str] = []
    res_out: list[str] = []
    adopt: list[str] = []
    for k, (rtype, _) in enumerate(results):
        if rtype == "mlx_array *":
            res_decl.append(f"_r{k} = _new(_AP)")
            adopt += result_lines(f"_r{k}", f"_o{k}")
            res_out.append(f"_o{k}")
        else:
            res_decl.append(f"_r{k} = new_vector()")
            res_out.append(f"unpack_vector(_r{k}[0])")
            res_args.append(f"_vslot(_r{k})")
            continue
        res_args.append(f"_r{k}")
    slots = ", ".join(f"_r{k}" for k, (t, _) in enumerate(results) if t == "mlx_array *")
    fn_global = "_c_" + cname
    lines = [f"def {cname}({', '.join(py_params)}):"]
    body = pre + _STREAM_LINES + res_decl
    body.append(f"if {fn_global}({', '.join(res_args + call + ['_s'])}):")
    body.append(f"    fail({slots})")
    body += adopt
    body.append("return " + (res_out[0] if len(res_out) == 1 else "(" + ", ".join(res_out) + ",)"))
    lines += ["    " + line for line in body]
    src = "\n".join(lines)
    GENERATED_ENV[fn_global] = getattr(fast, cname)
    try:
        exec(compile(src, f"<pymlxc generated {cname}>", "exec"), GENERATED_ENV)
    except SyntaxError as exc:  # pragma: no cover - a signature we cannot express
        raise RuntimeError(f"cannot generate wrapper for {cname}: {exc}\n{src}") from exc
    fn: Callable[..., Any] = GENERATED_ENV.pop(cname)
    fn.__doc__ = f"mlx-c `{cname}` ({', '.join(n for _, n in sig['params'])})."
    fn.__source__ = src  # type: ignore[attr-defined]  # a function attribute, for debugging: the generated code
    fn.__annotations__ = ann  # strings: the stub writer (_stubgen) and help() read them
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

"""Function transforms on Python functions: compile, value_and_grad, grad, vjp, jvp, checkpoint.

A Python function becomes an mlx-c closure whose payload is a handle to it; a destructor callback
releases the handle when MLX drops the closure. Exceptions never cross into C: the trampoline stores
the exception, returns non-zero, and the Python caller re-raises it.
"""
from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ._gen import ARRAY_ARRAY_TYPE, new_vector, unpack_vector, vector_of
from ._loader import MLXError, ffi, last_error, lib, new_cdata
from .array import Array, FreedArrayError, asarray

# ---------------------------------------------------------------------- trees of arrays

TreeDef = Any


# The walks are module functions taking their state as arguments: a nested closure that reaches
# itself would form a cycle keeping the caller's arrays alive until a garbage collection.
def _flatten_into(node: Any, leaves: list[Array]) -> TreeDef:
    if isinstance(node, Array):
        leaves.append(node)
        return None
    if isinstance(node, dict):
        return ("dict", tuple((k, _flatten_into(v, leaves)) for k, v in node.items()))
    if isinstance(node, (list, tuple)):
        return ("list" if isinstance(node, list) else "tuple", tuple(_flatten_into(v, leaves) for v in node))
    if isinstance(node, (bool, int, float)):
        leaves.append(asarray(node))
        return None
    raise TypeError(
        f"transforms take arrays and (nested) dicts, lists or tuples of arrays, not {type(node).__name__}")


def tree_flatten(tree: Any) -> tuple[list[Array], TreeDef]:
    """Arrays of a nested dict/list/tuple (leaves that are scalars become arrays), and its structure."""
    leaves: list[Array] = []
    treedef = _flatten_into(tree, leaves)
    return leaves, treedef


def _unflatten_from(d: TreeDef, it: Iterator[Array]) -> Any:
    if d is None:
        return next(it)
    kind, items = d
    if kind == "dict":
        return {k: _unflatten_from(v, it) for k, v in items}
    seq = [_unflatten_from(v, it) for v in items]
    return seq if kind == "list" else tuple(seq)


def tree_unflatten(leaves: Sequence[Array], treedef: TreeDef) -> Any:
    return _unflatten_from(treedef, iter(leaves))


# ---------------------------------------------------------------------- closures

_pending = threading.local()
# Payloads MLX may still call, by address. No lock: `_release` can run inside a garbage collection
# triggered anywhere (a lock held there would deadlock), and one dict store or pop is atomic.
_alive: dict[int, Any] = {}


def _call_host(res: Any, inputs: Any, payload: Any) -> int:
    """Run the Python function of a closure for MLX (through `_trampoline`)."""
    try:
        fn = ffi.from_handle(payload)
        outputs = fn(unpack_vector(inputs))
        _keep, vec = vector_of(outputs)
        if lib.mlx_vector_array_set(res, vec[0]):
            raise MLXError(last_error())
        return 0
    except BaseException as exc:  # noqa: BLE001 - stored, re-raised by the caller
        _pending.exc = exc
        return 1


def _forget(payload: Any) -> None:
    _alive.pop(int(ffi.cast("uintptr_t", payload)), None)


# The C callbacks, kept alive at module level for as long as MLX may call them (ffi.callback returns
# an untyped object, hence the calls rather than decorators).
_trampoline: Any = ffi.callback("int(*)(mlx_vector_array *, const mlx_vector_array, void *)")(_call_host)
_release: Any = ffi.callback("void(*)(void *)")(_forget)


def _raise_failure() -> None:
    exc = getattr(_pending, "exc", None)
    message = last_error()
    if exc is not None:
        _pending.exc = None
        raise exc
    raise MLXError(message)


def _call(status: int) -> None:
    if status:
        _raise_failure()


class _Closure:
    """Owns an mlx_closure made from `fn(list[Array]) -> list[Array]`."""

    def __init__(self, fn: Callable[[list[Array]], list[Array]] | None = None, handle: Any = None) -> None:
        if handle is None:
            payload = ffi.new_handle(fn)
            _alive[int(ffi.cast("uintptr_t", payload))] = payload
            handle = lib.mlx_closure_new_func_payload(_trampoline, payload, _release)
        self._h = ffi.new("mlx_closure *", handle)

    @property
    def c(self) -> Any:
        return self._h[0]

    def apply(self, inputs: Sequence[Array]) -> list[Array]:
        _keep, vec = vector_of(inputs)
        out = new_vector()
        _call(lib.mlx_closure_apply(out, self._h[0], vec[0]))
        return unpack_vector(out[0])

    def __del__(self) -> None:
        h = getattr(self, "_h", None)
        if h is not None and lib is not None:
            lib.mlx_closure_free(h[0])
            self._h = None


def _flat_fn(fn: Callable[..., Any], in_def: TreeDef, out_defs: list[TreeDef]) -> Callable[[list[Array]], list[Array]]:
    def flat(leaves: list[Array]) -> list[Array]:
        args = tree_unflatten(leaves, in_def)
        result = fn(*args)
        out_leaves, out_def = tree_flatten(result)
        out_defs[:] = [out_def]
        return out_leaves

    return flat


# ---------------------------------------------------------------------- compile

_fun_ids = itertools.count(1)


class Compiled:
    """`compile(fn)`: traced once per input shape (or once, if shapeless) and replayed as one graph."""

    def __init__(self, fn: Callable[..., Any], shapeless: bool = False) -> None:
        self.fn = fn
        self.shapeless = shapeless
        self._by_structure: dict[Any, tuple[_Closure, list[TreeDef], int]] = {}
        self._flat: dict[int, _Closure] = {}

    def _compiled_for(self, in_def: TreeDef) -> tuple[_Closure, list[TreeDef], int]:
        key = repr(in_def)
        entry = self._by_structure.get(key)
        if entry is None:
            out_defs: list[TreeDef] = []
            inner = _Closure(_flat_fn(self.fn, in_def, out_defs))
            fun_id = next(_fun_ids)
            res = ffi.new("mlx_closure *")
            _call(lib.mlx_detail_compile(res, inner.c, fun_id, self.shapeless, ffi.NULL, 0))
            entry = (_Closure(handle=res[0]), out_defs, fun_id)
            entry[0]._inner = inner  # type: ignore[attr-defined]  # the traced function lives as long as the graph
            self._by_structure[key] = entry
        return entry

    def __call__(self, *args: Any) -> Any:
        leaves, in_def = tree_flatten(args)
        closure, out_defs, _ = self._compiled_for(in_def)
        out = closure.apply(leaves)
        return tree_unflatten(out, out_defs[0])

    def call_flat(self, inputs: Sequence[Array], tail: FixedArrays | None = None) -> list[Array]:
        """Call with one flat list of arrays (the function takes and returns a list of arrays):
        no tree handling, for callers that replay a compiled step many times. `tail`: arrays
        passed after `inputs` in every call (weights, say), converted once instead of per call."""
        n = len(inputs) + (tail.size if tail is not None else 0)
        entry = self._flat.get(n)
        if entry is None:
            entry = self._flat[n] = self._compiled_for(("tuple", (("list", (None,) * n),)))[0]
        if tail is None:
            return entry.apply(inputs)
        if tail.handles is None:
            raise FreedArrayError("the FixedArrays was released")
        _keep, vec = vector_of(inputs)
        _call(lib.mlx_vector_array_append_data(vec[0], tail.handles, tail.size))
        out = new_vector()
        _call(lib.mlx_closure_apply(out, entry.c, vec[0]))
        return unpack_vector(out[0])

    def clear(self) -> None:
        """Drop the compiled graphs (MLX's cache entries included)."""
        for _, _, fun_id in self._by_structure.values():
            lib.mlx_detail_compile_erase(fun_id)
        self._by_structure.clear()
        self._flat.clear()

    def __del__(self) -> None:
        try:
            if lib is not None:
                self.clear()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


class FixedArrays:
    """Arrays handed to every call of `Compiled.call_flat` after its per-call inputs, as one C array
    of handles made once. It holds references of its own (new handles to the same arrays), so the
    call needs no per-call check: freeing a given Array afterwards frees only that Array's handle,
    and the arrays live until this object goes (or `release()`). A freed Array raises
    FreedArrayError when the FixedArrays is made."""

    def __init__(self, arrays: Sequence[Array]) -> None:
        items = [a if isinstance(a, Array) else asarray(a) for a in arrays]
        if any(a._h is None for a in items):
            raise FreedArrayError("array used after free()")
        given = new_cdata(ARRAY_ARRAY_TYPE, [[a._h] for a in items])
        self.size = len(items)
        self.handles = new_cdata(ARRAY_ARRAY_TYPE, self.size)
        for i in range(self.size):
            self.handles[i] = lib.mlx_array_new()
            _call(lib.mlx_array_set(self.handles + i, given[i]))
        del items

    def release(self) -> None:
        handles, self.handles = self.handles, None
        if handles is not None and lib is not None:
            for i in range(self.size):
                lib.mlx_array_free(handles[i])

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown
            self.release()


def compile(fn: Callable[..., Any], shapeless: bool = False) -> Compiled:  # noqa: A001
    """Compile `fn(*arrays_or_trees) -> arrays_or_trees`. With `shapeless`, shapes may change between
    calls without a retrace (only for graphs whose ops allow it)."""
    return Compiled(fn, shapeless)


COMPILE_MODES = {"disabled": "MLX_COMPILE_MODE_DISABLED", "no_simplify": "MLX_COMPILE_MODE_NO_SIMPLIFY",
                 "no_fuse": "MLX_COMPILE_MODE_NO_FUSE", "enabled": "MLX_COMPILE_MODE_ENABLED"}


def set_compile_mode(mode: str) -> None:
    """MLX's process-wide compile mode, read when a function is traced: "enabled" (the default),
    "no_fuse" (traced and simplified, elementwise operations left unfused), "no_simplify", or
    "disabled" (functions run uncompiled)."""
    try:
        value = getattr(lib, COMPILE_MODES[mode])
    except KeyError:
        raise ValueError(f"compile mode must be one of {', '.join(COMPILE_MODES)}, not {mode!r}") from None
    _call(lib.mlx_set_compile_mode(value))


def disable_compile() -> None:
    _call(lib.mlx_disable_compile())


def enable_compile() -> None:
    _call(lib.mlx_enable_compile())


# ---------------------------------------------------------------------- differentiation

def _argnum_leaves(args: tuple[Any, ...], argnums: Sequence[int]) -> tuple[list[Array], TreeDef, list[tuple[int, int]]]:
    leaves, in_def = tree_flatten(args)
    spans: list[tuple[int, int]] = []
    start = 0
    for arg in args:
        n = len(tree_flatten(arg)[0])
        spans.append((start, start + n))
        start += n
    for a in argnums:
        if not -len(args) <= a < len(args):
            raise ValueError(f"argnum {a} is out of range for {len(args)} arguments")
    return leaves, in_def, spans


def value_and_grad(fn: Callable[..., Any], argnums: int | Sequence[int] = 0) -> Callable[..., tuple[Any, Any]]:
    """`fn(*args)` must return a scalar loss, or a tuple whose first item is the loss. The result
    returns (value, grads); grads match the structure of the selected argument(s)."""
    nums = [argnums] if isinstance(argnums, int) else list(argnums)

    def wrapped(*args: Any) -> tuple[Any, Any]:
        leaves, in_def, spans = _argnum_leaves(args, nums)
        picked = [i for a in nums for i in range(*spans[a % len(args)])]
        out_defs: list[TreeDef] = []
        closure = _Closure(_flat_fn(fn, in_def, out_defs))
        vag = ffi.new("mlx_closure_value_and_grad *")
        idx = ffi.new("int[]", picked)
        _call(lib.mlx_value_and_grad(vag, closure.c, idx, len(picked)))
        try:
            _keep, vec = vector_of(leaves)
            values, grads = new_vector(), new_vector()
            _call(lib.mlx_closure_value_and_grad_apply(values, grads, vag[0], vec[0]))
        finally:
            lib.mlx_closure_value_and_grad_free(vag[0])
        value = tree_unflatten(unpack_vector(values[0]), out_defs[0])
        flat_grads = unpack_vector(grads[0])
        trees, pos = [], 0
        for a in nums:
            start, stop = spans[a % len(args)]
            n = stop - start
            sub_def = in_def[1][a % len(args)]
            trees.append(tree_unflatten(flat_grads[pos:pos + n], sub_def))
            pos += n
        return value, trees[0] if isinstance(argnums, int) else tuple(trees)

    return wrapped


def grad(fn: Callable[..., Any], argnums: int | Sequence[int] = 0) -> Callable[..., Any]:
    vg = value_and_grad(fn, argnums)
    return lambda *args: vg(*args)[1]


def vjp(fn: Callable[..., Any], primals: Sequence[Array], cotangents: Sequence[Array]) -> tuple[list[Array],
        list[Array]]:
    """(outputs, vector-Jacobian products) of `fn(*primals)` for the given output cotangents."""
    closure = _Closure(lambda xs: _as_list(fn(*xs)))
    _k1, p = vector_of(primals)
    _k2, c = vector_of(cotangents)
    outs, vjps = new_vector(), new_vector()
    _call(lib.mlx_vjp(outs, vjps, closure.c, p[0], c[0]))
    return unpack_vector(outs[0]), unpack_vector(vjps[0])


def jvp(fn: Callable[..., Any], primals: Sequence[Array], tangents: Sequence[Array]) -> tuple[list[Array], list[Array]]:
    """(outputs, Jacobian-vector products) of `fn(*primals)` along the given input tangents."""
    closure = _Closure(lambda xs: _as_list(fn(*xs)))
    _k1, p = vector_of(primals)
    _k2, t = vector_of(tangents)
    outs, jvps = new_vector(), new_vector()
    _call(lib.mlx_jvp(outs, jvps, closure.c, p[0], t[0]))
    return unpack_vector(outs[0]), unpack_vector(jvps[0])


def _as_list(result: Any) -> list[Array]:
    if isinstance(result, Array):
        return [result]
    return list(result)


class _Checkpointed:
    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, *args: Any) -> Any:
        leaves, in_def = tree_flatten(args)
        out_defs: list[TreeDef] = []
        inner = _Closure(_flat_fn(self.fn, in_def, out_defs))
        res = ffi.new("mlx_closure *")
        _call(lib.mlx_checkpoint(res, inner.c))
        outer = _Closure(handle=res[0])
        out = outer.apply(leaves)
        return tree_unflatten(out, out_defs[0])


def checkpoint(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Recompute `fn`'s intermediates in the backward pass instead of keeping them (saves memory)."""
    return _Checkpointed(fn)

"""What the compiled decode's traced functions share: the spec a trace reads, the copy of the
model's modules on the traced inputs, and the error that sends a generation to the uncompiled loop.

A compiled function is a module-level function (a closure over a decoder would make a reference
cycle through the compiled function); what it needs to build the step (the modules, their arrays,
flags) is handed to it by `call_traced` for the duration of the call, and read with `spec()` when
MLX traces it.
"""
from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from pymlxc.core import Array
from pymlxc.core.transforms import FixedArrays

from ..nn import Cloner, Module


class CompileUnavailable(RuntimeError):
    """The model's forward could not be traced; the caller falls back to the uncompiled path."""


_state = threading.local()


def call_traced(fn: Any, spec: Any, inputs: list[Array], fixed: FixedArrays) -> list[Array]:
    """`fn.call_flat(inputs, fixed)` with `spec` readable by the traced function (if MLX traces now)."""
    _state.spec = spec
    try:
        return list(fn.call_flat(inputs, fixed))
    finally:
        _state.spec = None


def spec() -> Any:
    """The spec handed to the call being traced on this thread."""
    return _state.spec


def clone_modules(modules: Sequence[Module | None], arrays: Sequence[Array], tracers: Sequence[Array]) -> list[Any]:
    """Copies of `modules` whose `arrays` are the traced inputs `tracers` (None stays None)."""
    cloner = Cloner({id(a): t for a, t in zip(arrays, tracers, strict=True)})
    return [cloner.clone(m) if m is not None else None for m in modules]


__all__ = ["CompileUnavailable", "call_traced", "spec", "clone_modules"]

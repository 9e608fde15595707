"""Write `_generated.pyi`: the typed declarations of the wrappers that `_gen` generates at import.

The types come from the wrappers themselves (`_gen._build` annotates each from its mlx-c signature),
so the stub and the functions are made from one source. `__all__` lists the wrappers that `ops`
re-exports unchanged (those it redefines by hand or leaves to `fft`, `linalg`, ... are not in it),
which is what `from ._generated import *` gives `ops` under TYPE_CHECKING.

    python -m pymlxc.core._stubgen          # rewrite pymlxc/core/_generated.pyi
    python -m pymlxc.core._stubgen --check  # exit 1 when the committed stub differs
"""
from __future__ import annotations

import argparse
import inspect
import sys
from pathlib import Path

from . import ops
from ._gen import RAW

STUB = Path(__file__).with_name("_generated.pyi")
WIDTH = 120

HEADER = '''"""Typed declarations of the wrappers generated at import from pymlxc/_lib/signatures.json (see _gen.py).

Written by `python -m pymlxc.core._stubgen`; do not edit.
"""
from collections.abc import Sequence

from .array import Array, ArrayLike
from .device import StreamLike
from .dtypes import DtypeLike
'''


def reexported() -> list[str]:
    """The wrappers that `ops` exports as they are."""
    return sorted(name for name, fn in RAW.items() if getattr(ops, name, None) is fn)


def declaration(name: str) -> str:
    """`def name(...) -> ...: ...` for one wrapper, wrapped to WIDTH columns."""
    fn = RAW[name]
    annotations = fn.__annotations__
    params = []
    for p in inspect.signature(fn).parameters.values():
        text = f"{p.name}: {annotations[p.name]}"
        params.append(text if p.default is inspect.Parameter.empty else text + " = ...")
    tail = f") -> {annotations['return']}: ..."
    one_line = f"def {name}({', '.join(params)}{tail}"
    if len(one_line) <= WIDTH:
        return one_line
    lines = [f"def {name}("]
    current = "   "
    for text in params:
        if len(current) + 1 + len(text) + 1 > WIDTH:
            lines.append(current)
            current = "   "
        current += f" {text},"
    lines.append(current)
    lines.append(tail)
    return "\n".join(lines)


def render() -> str:
    names = reexported()
    all_lines = ["__all__ = ["]
    current = "   "
    for name in names:
        item = f' "{name}",'
        if len(current) + len(item) > WIDTH:
            all_lines.append(current)
            current = "   "
        current += item
    all_lines += [current, "]"]
    body = "\n\n".join(declaration(name) for name in sorted(RAW))
    exported = "\n".join(all_lines)
    return f"{HEADER}\n# The wrappers that pymlxc.core.ops re-exports unchanged.\n{exported}\n\n{body}\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pymlxc.core._stubgen",
                                     description="Write the typed declarations of the generated wrappers.")
    parser.add_argument("--check", action="store_true", help="exit 1 when the committed stub differs")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = STUB.read_text() if STUB.exists() else ""
        if current != text:
            print(f"{STUB} is out of date: run python -m pymlxc.core._stubgen", file=sys.stderr)
            return 1
        return 0
    STUB.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Run the tests from a checkout: the folders `backends/` and `bridge/` install as `pymlxc.backends`
and `pymlxc.bridge`; a meta path finder gives them those names here, before anything imports pymlxc."""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ALIASES = {"pymlxc.backends": ROOT / "backends", "pymlxc.bridge": ROOT / "bridge"}


class _CheckoutFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        folder = ALIASES.get(fullname)
        if folder is None:
            return None  # submodules are then found through the package's __path__ as usual
        return importlib.util.spec_from_file_location(fullname, folder / "__init__.py", submodule_search_locations=[str(folder)])


# MLX's CUDA backend runs float32 matmuls in TF32 by default (10-bit mantissa, about 1e-3 relative).
# The parity tests compare float32 models to mlx-lm and to numpy at float32 tolerances, and in tiny
# mixture-of-experts models a 1e-3 change can flip a router's choice, so they run in full float32.
# MLX reads the variable once, at the first matmul; set before anything imports mlx. No effect on CPU.
os.environ.setdefault("MLX_ENABLE_TF32", "0")

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
if not any(isinstance(f, _CheckoutFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _CheckoutFinder())

"""Make a checkout importable as installed: the repo root on sys.path, and `backends/` and `bridge/`
under their installed names `pymlxc.backends` and `pymlxc.bridge` (as tests/conftest.py does).

Import it first in a benchmark (`import _path` from benchmarks/, or `import benchmarks._path`) on a
machine where pymlxc is not pip-installed, e.g. the GPU machine. Harmless where it is installed.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ALIASES = {"pymlxc.backends": ROOT / "backends", "pymlxc.bridge": ROOT / "bridge"}


class _CheckoutFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: object = None,
                  target: object = None) -> importlib.machinery.ModuleSpec | None:
        folder = ALIASES.get(fullname)
        if folder is None:
            return None
        return importlib.util.spec_from_file_location(fullname, folder / "__init__.py",
                                                      submodule_search_locations=[str(folder)])


if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
if not any(type(f).__name__ == "_CheckoutFinder" for f in sys.meta_path):
    sys.meta_path.insert(0, _CheckoutFinder())

"""For the probes in benchmarks/profile/: put benchmarks/ on sys.path (for `compare_mlx_lm`), then run benchmarks/_path.py, which makes the checkout importable as installed.

A probe imports it first (`import _path`), as the scripts in benchmarks/ import theirs.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1]
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(1, str(BENCHMARKS))
_spec = importlib.util.spec_from_file_location("_benchmarks_path", BENCHMARKS / "_path.py")
assert _spec is not None and _spec.loader is not None
_spec.loader.exec_module(importlib.util.module_from_spec(_spec))

"""What the two 4-bit matvec probes share (`probe_matvec.py` through MLX, `probe_matvec_variants.py`
through CuPy): the decode step's weight shapes, and `kernels/matvec.py` loaded by its path, since
importing the package would load pymlxc's own library, which neither probe needs."""
from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

MATVEC = Path(__file__).resolve().parents[2] / "backends" / "metal" / "kernels" / "matvec.py"

SHAPES = {  # name: (K, N)
    "1b.qkv": (2048, 3072), "1b.o": (2048, 2048), "1b.gate_up": (2048, 16384), "1b.down": (8192, 2048),
    "8b.qkv": (4096, 6144), "8b.o": (4096, 4096), "8b.gate_up": (4096, 28672), "8b.down": (14336, 4096),
    "8b.head": (4096, 128256),
}


def load_matvec(path: Path = MATVEC, name: str = "cuda_matvec") -> ModuleType:
    """The matvec module at `path`: this checkout's, or another version of it (a probe's baseline,
    e.g. `git show REV:backends/metal/kernels/matvec.py`)."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

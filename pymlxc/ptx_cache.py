"""Where MLX keeps the GPU code it compiles on NVIDIA machines: a folder of the user cache, keyed on
the GPUs, the NVIDIA driver and the MLX build, instead of MLX's default `/tmp/mlx/<version>/ptx`.

MLX's CUDA backend compiles many of its kernels at first use (NVRTC: the quantized matmuls among
them, seconds to minutes for the first prefill on a fresh machine) and keeps their PTX in the
folder named by `MLX_PTX_CACHE_DIR`, else under the system's temporary folder, which is emptied at
boot on many systems and keyed on MLX's version alone. `configure()` sets `MLX_PTX_CACHE_DIR` (when
the user has not) to `<user cache>/mlx-ptx/<key>`, so compiled code outlives reboots and is never
read back by another driver, GPU model or MLX build. It runs before the binding's library is loaded.

MLX reads and writes that folder itself, and writes an entry (`<name>.ptx`, the compiled code,
and `<name>.txt`, its kernels' names) without a rename, so a process stopped while writing leaves
half an entry that MLX would load and fail on. `configure()` therefore removes every entry of the
folder that is not whole (`whole()`) before MLX sees it. MLX 0.32 writes no entries for
`fast.cuda_kernel`s (pymlxc's own CUDA kernels), so those are still compiled once per process
(`docs/performance.md`).

Like `user_cache`, this module imports nothing from pymlxc but `settings` and `user_cache`.
"""
from __future__ import annotations

import contextlib
import importlib.metadata
import os
from collections.abc import MutableMapping
from pathlib import Path

from . import settings as _settings
from . import user_cache

VARIABLE = "MLX_PTX_CACHE_DIR"
_MAX_BYTES = 1 << 16  # the driver's /proc files are a few hundred bytes
_BUILDS = ("mlx", "mlx-cuda", "mlx-cuda-12", "mlx-cuda-13", "mlx-metal")


def _read(path: Path) -> str | None:
    """A small regular file's text, else None (missing, not a regular file, unreadable)."""
    try:
        if not path.is_file():
            return None
        with path.open("rb") as f:
            return f.read(_MAX_BYTES).decode("utf-8", "replace")
    except OSError:
        return None


def nvidia_driver(proc: Path = Path("/proc/driver/nvidia")) -> str | None:
    """The NVIDIA driver's version line, or None where there is no NVIDIA driver."""
    version = _read(proc / "version")
    return version.strip().splitlines()[0] if version and version.strip() else None


def device_key(proc: Path = Path("/proc/driver/nvidia")) -> dict[str, object] | None:
    """The NVIDIA driver's version line and the model of each GPU, from the driver's /proc files
    (without starting CUDA), or None where there is no NVIDIA driver."""
    driver = nvidia_driver(proc)
    if driver is None:
        return None
    models = []
    gpus = proc / "gpus"
    with contextlib.suppress(OSError):
        for info in sorted(gpus.iterdir()) if gpus.is_dir() else []:
            text = _read(info / "information") or ""
            models += [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Model:")]
    return {"driver": driver, "gpus": models}


def whole(ptx: Path) -> bool:
    """Whether the entry `<name>.ptx` + `<name>.txt` was written to the end: a non-empty .txt of
    `name<TAB>mangled` lines each ended by a newline, and a .ptx that is PTX text ending with the
    closing brace of its last function, or an ELF image (cubin) as long as its section headers say."""
    names = _read(ptx.with_suffix(".txt"))
    if not names or not names.endswith("\n") or any("\t" not in line for line in names.splitlines()):
        return False
    # The head and the tail only: this runs over the whole folder at every start.
    try:
        if not ptx.is_file():
            return False
        with ptx.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(64)
            f.seek(max(0, size - 64))
            tail = f.read(64)
    except OSError:
        return False
    if head.startswith(b"\x7fELF"):
        if len(head) < 64 or head[4] != 2:  # ELF64 header
            return False
        shoff = int.from_bytes(head[0x28:0x30], "little")
        shentsize = int.from_bytes(head[0x3A:0x3C], "little")
        shnum = int.from_bytes(head[0x3C:0x3E], "little")
        return shoff > 0 and shoff + shentsize * shnum <= size
    return tail.rstrip().endswith(b"}")


def _remove_partial(folder: Path) -> None:
    """Delete the entries of `folder` that are not whole (and their .txt and .cu beside them)."""
    with contextlib.suppress(OSError):
        for ptx in folder.rglob("*.ptx"):
            if not whole(ptx):
                for suffix in (".ptx", ".txt", ".cu"):
                    with contextlib.suppress(OSError):
                        ptx.with_suffix(suffix).unlink()


def mlx_builds() -> dict[str, str]:
    """The installed MLX distributions (the Python package and its CUDA or Metal companion) and
    their versions: what compiled code and kernel verdicts were made with."""
    found = {}
    for dist in _BUILDS:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found[dist] = importlib.metadata.version(dist)
    return found


def configure(environ: MutableMapping[str, str] | None = None, *, proc: Path = Path("/proc/driver/nvidia"),
              chosen: _settings.Settings | None = None) -> Path | None:
    """Point MLX's compiled-code cache at the user cache (see the module doc) and return the folder;
    None (and nothing changed) where the user named one already, the user cache is off, there is
    no NVIDIA driver, or the folder cannot be made."""
    env = os.environ if environ is None else environ
    if env.get(VARIABLE):
        return None
    root = user_cache.directory(chosen)
    device = device_key(proc)
    if root is None or device is None:
        return None
    builds = mlx_builds()
    key = user_cache.digest(user_cache.canonical({"device": device, "builds": builds}))
    folder = root / "mlx-ptx" / f"mlx-{builds.get('mlx', 'unknown')}-{key[:16]}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    if not os.access(folder, os.W_OK):
        return None
    _remove_partial(folder)
    env[VARIABLE] = str(folder)
    return folder


__all__ = ["VARIABLE", "configure", "device_key", "mlx_builds", "nvidia_driver", "whole"]

"""`discover(root)`: find model directories (safetensors or GGUF) under a folder."""
from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .files import check_regular_file, read_json


@dataclass(frozen=True)
class DiscoveredModel:
    path: Path
    model_type: str | None
    quant_bits: int
    quant_group: int
    num_files: int
    format: str  # "safetensors" or "gguf"


def _safetensors_model(path: Path, files: list[str]) -> DiscoveredModel | None:
    weights = [f for f in files if f.endswith(".safetensors") and not f.startswith("adapter")]
    if "config.json" not in files or not weights:
        return None
    # Bounded, regular files only: a FIFO or a link to /dev/zero named config.json is skipped.
    config = read_json(path / "config.json", what="config file")
    quant = config.get("quantization") or config.get("quantization_config") or {}
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    model_type = config.get("model_type") or text.get("model_type")
    return DiscoveredModel(
        path=path,
        model_type=model_type if isinstance(model_type, str) else None,
        quant_bits=int(quant.get("bits", 0) or 0) if isinstance(quant, dict) else 0,
        quant_group=int(quant.get("group_size", 0) or 0) if isinstance(quant, dict) else 0,
        num_files=len(weights),
        format="safetensors",
    )


def _gguf_model(path: Path, files: list[str]) -> DiscoveredModel | None:
    ggufs = sorted(f for f in files if f.endswith(".gguf") and not f.lower().startswith("mmproj"))  # not projectors
    if not ggufs:
        return None
    check_regular_file(path / ggufs[0], what="GGUF file")  # its reader opens it by name
    try:
        from .backends.metal.gguf import describe_gguf  # type: ignore[import-not-found]

        model_type, bits, group = describe_gguf(path / ggufs[0])
    except ImportError:
        model_type, bits, group = None, 0, 0
    return DiscoveredModel(path, model_type, bits, group, len(ggufs), "gguf")


def discover(root: str | os.PathLike[str]) -> Iterator[DiscoveredModel]:
    """Yield each model directory under `root` (itself included). Unreadable entries are skipped:
    files that cannot be read, are not regular files (FIFOs, devices) or are too large to be what
    they are named, and malformed ones."""
    root = Path(root)
    for dirpath, dirnames, filenames in os.walk(root, onerror=lambda _e: None):
        dirnames.sort()
        path = Path(dirpath)
        for probe in (_safetensors_model, _gguf_model):
            try:
                found = probe(path, filenames)
            except (OSError, ValueError, TypeError, KeyError, OverflowError):
                continue  # unreadable or malformed: not fatal
            if found is not None:
                yield found
                break

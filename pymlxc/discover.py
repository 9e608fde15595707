"""`discover(root)`: find model directories (safetensors or GGUF) under a folder."""
from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


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
    config = json.loads((path / "config.json").read_text())
    if not isinstance(config, dict):
        return None
    quant = config.get("quantization") or config.get("quantization_config") or {}
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    return DiscoveredModel(
        path=path,
        model_type=config.get("model_type") or text.get("model_type"),
        quant_bits=int(quant.get("bits", 0) or 0) if isinstance(quant, dict) else 0,
        quant_group=int(quant.get("group_size", 0) or 0) if isinstance(quant, dict) else 0,
        num_files=len(weights),
        format="safetensors",
    )


def _gguf_model(path: Path, files: list[str]) -> DiscoveredModel | None:
    ggufs = sorted(f for f in files if f.endswith(".gguf") and not f.lower().startswith("mmproj"))  # not projectors
    if not ggufs:
        return None
    try:
        from .backends.metal.gguf import describe_gguf  # type: ignore[import-not-found]

        model_type, bits, group = describe_gguf(path / ggufs[0])
    except ImportError:
        model_type, bits, group = None, 0, 0
    return DiscoveredModel(path, model_type, bits, group, len(ggufs), "gguf")


def discover(root: str | os.PathLike[str]) -> Iterator[DiscoveredModel]:
    """Yield each model directory under `root` (itself included). Unreadable entries are skipped."""
    root = Path(root)
    for dirpath, dirnames, filenames in os.walk(root, onerror=lambda _e: None):
        dirnames.sort()
        path = Path(dirpath)
        for probe in (_safetensors_model, _gguf_model):
            try:
                found = probe(path, filenames)
            except (OSError, ValueError, TypeError, KeyError):
                continue  # unreadable or malformed: not fatal
            if found is not None:
                yield found
                break

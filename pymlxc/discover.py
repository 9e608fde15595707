"""`discover(root)`: find model directories (safetensors or GGUF) under a folder; `discover_hub()`:
the models in the Hugging Face hub cache, each with the reference that loads it."""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .files import check_regular_file, read_bytes, read_json
from .hub import DEFAULT_REVISION, gguf_group, hub_cache_dir, is_model_gguf, quant_label


@dataclass(frozen=True)
class DiscoveredModel:
    path: Path
    model_type: str | None
    quant_bits: int
    quant_group: int
    num_files: int
    format: str  # "safetensors" or "gguf"
    reference: str | None = None  # discover_hub: the repo id to load it by (org/name[@commit][:QUANT])


def _safetensors_model(path: Path, files: list[str]) -> DiscoveredModel | None:
    weights = [f for f in files if f.endswith(".safetensors") and not f.startswith("adapter")]
    if "config.json" not in files or not weights:
        return None
    # Bounded, regular files only: a FIFO or a link to /dev/zero named config.json is skipped.
    config = read_json(path / "config.json", what="config file")
    quant = config.get("quantization") or config.get("quantization_config") or {}
    text = config.get("text_config")
    text = text if isinstance(text, dict) else {}
    model_type = config.get("model_type") or text.get("model_type")
    return DiscoveredModel(
        path=path,
        model_type=model_type if isinstance(model_type, str) else None,
        quant_bits=int(quant.get("bits", 0) or 0) if isinstance(quant, dict) else 0,
        quant_group=int(quant.get("group_size", 0) or 0) if isinstance(quant, dict) else 0,
        num_files=len(weights),
        format="safetensors",
    )


def _describe_gguf(file: Path) -> tuple[str | None, int, int]:
    check_regular_file(file, what="GGUF file")  # its reader opens it by name
    try:
        from .backends.metal.formats.gguf import describe_gguf

        return describe_gguf(file)
    except ImportError:
        return None, 0, 0


def _gguf_models(path: Path, files: list[str]) -> list[DiscoveredModel]:
    """The folder where it holds one GGUF file (it loads by the folder's name), else each file: a
    folder of several is refused by `load_model`, which takes one of them by its own path."""
    ggufs = sorted(f for f in files if f.endswith(".gguf") and not f.lower().startswith("mmproj"))  # not projectors
    found = []
    for name in ggufs:
        try:
            model_type, bits, group = _describe_gguf(path / name)
        except (OSError, ValueError, TypeError, KeyError, OverflowError):
            continue  # unreadable or malformed: not fatal
        found.append(DiscoveredModel(path if len(ggufs) == 1 else path / name, model_type, bits, group, 1, "gguf"))
    return found


def _safetensors_models(path: Path, files: list[str]) -> list[DiscoveredModel]:
    found = _safetensors_model(path, files)
    return [] if found is None else [found]


def discover(root: str | os.PathLike[str]) -> Iterator[DiscoveredModel]:
    """Yield each model directory under `root` (itself included). Unreadable entries are skipped:
    files that cannot be read, are not regular files (FIFOs, devices) or are too large to be what
    they are named, and malformed ones."""
    root = Path(root)
    for dirpath, dirnames, filenames in os.walk(root, onerror=lambda _e: None):
        dirnames.sort()
        path = Path(dirpath)
        for probe in (_safetensors_models, _gguf_models):
            try:
                found = probe(path, filenames)
            except (OSError, ValueError, TypeError, KeyError, OverflowError):
                continue  # unreadable or malformed: not fatal
            if found:
                yield from found
                break


def discover_hub(cache_dir: str | os.PathLike[str] | None = None) -> Iterator[DiscoveredModel]:
    """Yield each loadable model in the Hugging Face hub cache (`cache_dir`, else the one
    `pymlxc.hub.hub_cache_dir()` names): a safetensors snapshot as `org/name` (the default
    branch's commit) or `org/name@<commit>`, and each quantization of a GGUF snapshot as
    `...:QUANT` with `path` the .gguf file. Unreadable or malformed entries are skipped."""
    cache = Path(cache_dir) if cache_dir is not None else hub_cache_dir()
    for storage in sorted(cache.glob("models--*--*")):
        repo_id = storage.name[len("models--"):].replace("--", "/", 1)  # org names cannot hold "--"
        try:
            ref = read_bytes(storage / "refs" / DEFAULT_REVISION, what="cache ref file", max_bytes=4096)
            default = ref.decode("ascii", "replace").strip()
        except OSError:
            default = ""  # no default branch cached: every snapshot is named by its commit
        for snapshot in sorted(p for p in (storage / "snapshots").glob("*") if p.is_dir()):
            name = repo_id if snapshot.name == default else f"{repo_id}@{snapshot.name}"
            try:
                files = sorted(p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file())
                found = _safetensors_model(snapshot, [f for f in files if "/" not in f])
                if found is not None:
                    yield dataclasses.replace(found, reference=name)
                    continue
                groups: dict[str, list[str]] = {}
                for f in files:
                    if is_model_gguf(f):
                        groups.setdefault(gguf_group(f), []).append(f)
                for group, parts in sorted(groups.items()):
                    first = snapshot / sorted(parts)[0]
                    model_type, bits, qgroup = _describe_gguf(first)
                    yield DiscoveredModel(first, model_type, bits, qgroup, len(parts), "gguf",
                                          reference=f"{name}:{quant_label(group)}")
            except (OSError, ValueError, TypeError, KeyError, OverflowError):
                continue  # unreadable or malformed: not fatal

"""Small persistent entries in the user cache directory, for work a process would otherwise repeat
at every start (the binding's parsed C declarations, the verdicts of the kernels' checks).

The directory is `Settings.cache_dir` (`PYMLXC_CACHE_DIR`; `off` turns the cache off), else
`$XDG_CACHE_HOME/pymlxc`, else `~/.cache/pymlxc`. An entry is one JSON file holding its format
version, its whole key, its value and a SHA-256 of key and value. It is read only when all of these
check out: a corrupt, truncated, stale (another key, another format) or foreign file reads as a
miss, and the next `put` replaces it. Writes go to a temporary file in the same folder, then
`os.replace`: readers see the old entry or the new one, never half of one, and two processes
writing at once leave one whole entry. A folder that cannot be made or written (read-only, full)
leaves the cache empty: nothing is raised, the work is done as if no cache existed.

Like `settings`, this module imports nothing from pymlxc but `settings`: the binding's loader
uses it before anything else is loaded.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from . import settings as _settings

FORMAT = 1  # bump when the file layout changes: older files then read as misses
OFF = ("off", "0", "false", "no", "none")

log = logging.getLogger(__name__)


def directory(chosen: _settings.Settings | None = None) -> Path | None:
    """The cache root (not created here), or None when the cache is turned off."""
    value = (chosen if chosen is not None else _settings.current()).cache_dir
    if value is not None:
        if str(value).strip().lower() in OFF:
            return None
        return Path(value).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".cache"
    return base / "pymlxc"


def canonical(obj: Any) -> str:
    """The one JSON text of `obj` that keys and checksums are computed on (TypeError: not JSON)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


class Store:
    """The entries of one kind (a subfolder of the cache root), each named by a hash of its key."""

    def __init__(self, kind: str, root: Path | str | None = "default") -> None:
        """`root`: the cache root; "default" resolves it from the settings at each use (so that
        `settings.override(cache_dir=...)` applies), None means no cache."""
        if not kind or "/" in kind or kind.startswith("."):
            raise ValueError(f"a cache kind is a plain folder name, not {kind!r}")
        self.kind = kind
        self._root = root

    @property
    def folder(self) -> Path | None:
        root = directory() if isinstance(self._root, str) else self._root
        return None if root is None else Path(root) / self.kind

    def path_for(self, key: Any) -> Path | None:
        """Where the entry of `key` lives (None: no cache, or a key that is not JSON)."""
        folder = self.folder
        if folder is None:
            return None
        try:
            text = canonical(key)
        except (TypeError, ValueError):
            return None
        return folder / f"{digest(text)[:40]}.json"

    def get(self, key: Any) -> Any | None:
        """The value stored under `key`, or None (no entry, or one that does not check out)."""
        path = self.path_for(key)
        if path is None:
            return None
        try:
            raw = path.read_bytes()
        except OSError:
            return None
        try:
            entry = json.loads(raw)
            ok = (isinstance(entry, dict) and entry.get("format") == FORMAT
                  and canonical(entry.get("key")) == canonical(key)
                  and entry.get("checksum") == digest(canonical({"key": entry["key"], "value": entry["value"]})))
        except (ValueError, TypeError, KeyError, RecursionError):
            ok = False
        if not ok:
            log.debug("ignoring the cache entry %s (corrupt, stale or foreign); it will be rebuilt", path)
            return None
        return entry["value"]

    def put(self, key: Any, value: Any) -> bool:
        """Store `value` under `key` atomically; False where the cache is off or cannot be written."""
        path = self.path_for(key)
        if path is None:
            return False
        try:
            body = canonical({"format": FORMAT, "key": key, "value": value,
                              "checksum": digest(canonical({"key": key, "value": value}))})
        except (TypeError, ValueError):
            return False
        tmp: str | None = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
            with os.fdopen(fd, "w", encoding="ascii") as f:
                f.write(body)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            tmp = None
            return True
        except OSError as exc:
            log.debug("cannot write the cache entry %s: %s", path, exc)
            return False
        finally:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)

    def entries(self) -> Iterator[Path]:
        folder = self.folder
        if folder is None or not folder.is_dir():
            return iter(())
        return iter(sorted(folder.glob("*.json")))

    def clear(self) -> None:
        """Remove every entry of this kind (best effort)."""
        for path in self.entries():
            with contextlib.suppress(OSError):
                path.unlink()


__all__ = ["FORMAT", "Store", "canonical", "digest", "directory"]

"""Reading the files a user points at (model directories, adapters, prompt caches) without hanging
or exhausting memory.

Only regular files are read: a FIFO would block `open()` or `read()` forever, a character device
such as `/dev/zero` never ends. Links are followed (the Hugging Face cache is made of them), and
what they lead to is checked. Files are opened with `O_NONBLOCK`, so a path swapped for a FIFO
between the check and the open cannot block either, and the check is repeated on the open
descriptor. Every read is bounded: a file larger than its limit is refused before it is read.

Files that MLX writes by name go through `write_replacing`: a temporary file replaces the target,
so a FIFO there cannot block the write, and the file is named exactly as asked.

Errors are `FileNotFoundError` (nothing there), `UnsafeFileError` (something there that is not a
regular file, or is too large; an `OSError`) and `FileFormatError` (not UTF-8 / JSON; a
`ValueError`), or the caller's own class passed as `error`; each names the file.
"""
from __future__ import annotations

import contextlib
import json
import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, overload

MiB = 1 << 20
JSON_LIMIT = 64 * MiB  # config.json & co. are kilobytes; an index of a huge checkpoint a few MB
TEXT_LIMIT = 16 * MiB  # chat templates and other small text files
TOKENIZER_LIMIT = 512 * MiB  # the largest real tokenizer.json files are tens of MB

_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)


class UnsafeFileError(OSError):
    """The path is not a regular file (a FIFO, a device, a socket, a directory) or is larger than
    the limit for what it should be; the message names the path and what it is."""


class FileFormatError(ValueError):
    """The file is not the text or JSON it should be; the message names the file."""


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "FIFO (named pipe)"),
                       (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"),
                       (stat.S_ISSOCK, "socket")):
        if test(mode):
            return name
    return "special file"


def _check(path: Path, st: os.stat_result, what: str, max_bytes: int | None) -> int:
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeFileError(f"{what} {path} is a {_kind(st.st_mode)}, not a regular file")
    if max_bytes is not None and st.st_size > max_bytes:
        raise UnsafeFileError(f"{what} {path} is {st.st_size} bytes, more than the {max_bytes} bytes "
                              f"such a file may have")
    return st.st_size


def check_regular_file(path: str | os.PathLike[str], *, what: str = "file", max_bytes: int | None = None) -> int:
    """The size of the regular file at `path` (links followed); raises `FileNotFoundError` when
    nothing is there and `UnsafeFileError` for anything else, or a file over `max_bytes`. For files
    that another library opens by name (safetensors, GGUF)."""
    p = Path(path)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} not found: {p}") from None
    return _check(p, st, what, max_bytes)


def check_directory(path: str | os.PathLike[str], *, what: str = "directory") -> Path:
    """`path` when it is a directory (links followed); `FileNotFoundError` (`{what} not found`)
    when nothing is there, `NotADirectoryError` naming what is there otherwise (a FIFO or a stray
    file is not "not found")."""
    p = Path(path)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} not found: {p}") from None
    if not stat.S_ISDIR(st.st_mode):
        kind = "regular file" if stat.S_ISREG(st.st_mode) else _kind(st.st_mode)
        raise NotADirectoryError(f"{what} {p} is a {kind}, not a directory")
    return p


def write_replacing(path: str | os.PathLike[str], write: Callable[[str], object], *, what: str = "file",
                    suffix: str = "") -> Path:
    """Have `write(tmp)` write a new file, which then replaces the one at `path` (a link followed
    to its file): for writers that open a name themselves (MLX's savers, which append their own
    extension to a name without it and would block on a FIFO). `tmp` ends with `suffix` and lies
    in a fresh private folder beside `path`, so nothing can be planted there; a reader of `path`
    never sees half a file. A directory, FIFO or device at `path` is refused (`UnsafeFileError`),
    a missing folder is a `FileNotFoundError`. Returns the path written."""
    target = Path(os.path.realpath(path))
    if os.path.lexists(target):
        check_regular_file(target, what=what)
    if not target.parent.is_dir():
        raise FileNotFoundError(f"cannot write {what} {path}: no directory {target.parent}")
    scratch = tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent)
    tmp = os.path.join(scratch, "new" + suffix)
    try:
        write(tmp)
        os.replace(tmp, target)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        with contextlib.suppress(OSError):
            os.rmdir(scratch)
    return target


def read_bytes(path: str | os.PathLike[str], *, what: str = "file", max_bytes: int = JSON_LIMIT) -> bytes:
    """The content of the regular file at `path`, refused (unread) when larger than `max_bytes`."""
    p = Path(path)
    check_regular_file(p, what=what, max_bytes=max_bytes)
    fd = os.open(p, _OPEN_FLAGS)
    try:
        _check(p, os.fstat(fd), what, max_bytes)  # the same file as checked, not a swapped-in FIFO
        chunks: list[bytes] = []
        left = max_bytes + 1  # one byte more tells a file that grew past the limit
        while left > 0:
            chunk = os.read(fd, min(left, 8 * MiB))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > max_bytes:
        raise UnsafeFileError(f"{what} {p} grew past {max_bytes} bytes while it was read")
    return data


def read_text(path: str | os.PathLike[str], *, what: str = "file", max_bytes: int = TEXT_LIMIT,
              error: type[Exception] = FileFormatError) -> str:
    """The UTF-8 text of the regular file at `path`; undecodable bytes raise `error`."""
    data = read_bytes(path, what=what, max_bytes=max_bytes)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{path}: not UTF-8 text: {exc}") from exc


@overload
def read_json(path: str | os.PathLike[str], *, what: str = ..., max_bytes: int = ...,
              error: type[Exception] = ..., expect_object: Literal[True] = ...) -> dict[str, Any]: ...
@overload
def read_json(path: str | os.PathLike[str], *, what: str = ..., max_bytes: int = ...,
              error: type[Exception] = ..., expect_object: bool) -> Any: ...
def read_json(path: str | os.PathLike[str], *, what: str = "file", max_bytes: int = JSON_LIMIT,
              error: type[Exception] = FileFormatError, expect_object: bool = True) -> Any:
    """The JSON value of the regular file at `path` (an object unless `expect_object` is False).
    Invalid JSON, nesting deeper than the parser's recursion limit, and (with `expect_object`) a
    value that is not an object raise `error` naming the file."""
    data = read_bytes(path, what=what, max_bytes=max_bytes)
    try:
        value = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise error(f"{path}: not valid JSON (not UTF-8): {exc}") from exc
    except json.JSONDecodeError as exc:
        raise error(f"{path}: not valid JSON: {exc}") from exc
    except RecursionError:
        raise error(f"{path}: not valid JSON: nested too deeply") from None
    if expect_object and not isinstance(value, dict):
        raise error(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


__all__ = ["UnsafeFileError", "FileFormatError", "check_directory", "check_regular_file", "read_bytes", "read_text",
           "read_json", "write_replacing", "JSON_LIMIT", "TEXT_LIMIT", "TOKENIZER_LIMIT"]

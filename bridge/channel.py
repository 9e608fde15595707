"""The worker's pipes: stdout kept private for protocol lines, and stdin read by a thread into a queue.

Reading stdin on its own thread is what lets `cancel` reach a generation that is busy on the main
thread; the reader looks at each line as it arrives and may handle it at once (`intercept`).
"""
from __future__ import annotations

import os
import queue
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO

from .protocol import ProtocolError, encode

_SKIP_CHUNK = 1 << 16


def claim_stdout() -> BinaryIO:
    """Take the real stdout for protocol lines; afterwards anything that prints, from Python or C, goes to stderr."""
    sys.stdout.flush()
    private = os.dup(1)
    os.dup2(2, 1)  # fd 1 now writes to stderr too, so stray prints of native code cannot corrupt the stream
    sys.stdout = sys.stderr
    return os.fdopen(private, "wb")


def claim_stdin() -> BinaryIO:
    """Take the real stdin for protocol lines; afterwards stdin (fd 0, `sys.stdin`, `input()`) reads
    /dev/null. A library that asks a question on stdin (transformers: "run the custom code? [y/N]")
    then reads end of input at once instead of waiting on, or eating, the protocol pipe."""
    private = os.dup(0)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    sys.stdin = open(os.devnull, encoding="utf-8")  # noqa: SIM115 - lives as long as the process
    return os.fdopen(private, "rb")


class LineWriter:
    """Writes one message per line, whole and flushed, from any thread."""

    def __init__(self, stream: BinaryIO) -> None:
        self._stream = stream
        self._lock = threading.Lock()

    def send(self, message: Mapping[str, Any]) -> None:
        data = encode(message)  # encode before taking the lock: a bad message raises without writing
        with self._lock:
            self._stream.write(data)
            self._stream.flush()


@dataclass(frozen=True)
class Line:
    """One line from stdin, numbered in arrival order, or the reason it could not be read."""

    seq: int
    data: bytes = b""
    problem: ProtocolError | None = None


EOF = None  # what the queue yields when stdin closes


class LineReader(threading.Thread):
    """Reads lines of at most `max_bytes`; an `intercept(line)` returning True keeps it out of the queue."""

    def __init__(
        self, stream: BinaryIO, max_bytes: int, inbox: queue.Queue[Line | None], intercept: Callable[[Line], bool]
    ) -> None:
        super().__init__(name="bridge-stdin", daemon=True)
        self._stream, self._max, self._inbox, self._intercept = stream, max_bytes, inbox, intercept

    def run(self) -> None:
        seq = 0
        try:
            while True:
                data = self._stream.readline(self._max + 1)
                if not data:
                    break
                seq += 1
                if len(data) > self._max and not data.endswith(b"\n"):
                    size = len(data) + self._skip_rest()
                    problem = ProtocolError(
                        "line_too_long", f"line of {size}+ bytes is longer than the limit of {self._max}"
                    )
                    self._inbox.put(Line(seq, problem=problem))
                    continue
                line = Line(seq, data)
                if not self._intercept(line):
                    self._inbox.put(line)
        except (OSError, ValueError):  # stdin closed under us: same as end of input
            pass
        finally:
            self._inbox.put(EOF)

    def _skip_rest(self) -> int:
        skipped = 0
        while True:
            chunk = self._stream.readline(_SKIP_CHUNK)
            skipped += len(chunk)
            if not chunk or chunk.endswith(b"\n"):
                return skipped

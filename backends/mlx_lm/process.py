"""One worker process seen from the client: start it, handshake, send lines, receive lines with
timeouts, keep the tail of its stderr for error messages, and end it without leaving a zombie."""
from __future__ import annotations

import collections
import contextlib
import logging
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from pymlxc.bridge import protocol as P

from .errors import WorkerDied, WorkerError, WorkerTimeout

log = logging.getLogger("pymlxc.mlx_lm.worker")

BRIDGE_DIR = Path(P.__file__).resolve().parent  # run as `python <dir>`: works where pymlxc is not installed
STDERR_LINES = 40


class WorkerProcess:
    """A running `pymlxc.bridge` worker. Not thread-safe: one caller at a time (the model's slots)."""

    def __init__(self, python: str, *, startup_timeout: float = 60.0, extra_args: Sequence[str] = ()) -> None:
        env = dict(os.environ)
        env.setdefault("HF_HUB_OFFLINE", "1")  # never let a typo in a path turn into a download
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        self.python = python
        self._stderr: collections.deque[str] = collections.deque(maxlen=STDERR_LINES)
        # Reply lines, a WorkerError per line outside the protocol, and None once stdout closes.
        self._lines: queue.Queue[dict[str, Any] | WorkerError | None] = queue.Queue()
        try:
            self._proc = subprocess.Popen(
                [python, str(BRIDGE_DIR), *extra_args],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=env,
                start_new_session=True,  # a Ctrl-C in the terminal is for us; we end the worker ourselves
            )
        except OSError as e:
            raise WorkerError(f"cannot start the mlx_lm worker with {python!r}: {e}") from e
        assert self._proc.stdin and self._proc.stdout and self._proc.stderr
        self._stdin: IO[bytes] = self._proc.stdin
        self._threads = [
            threading.Thread(target=self._read_stdout, args=(self._proc.stdout,), daemon=True, name="mlx_lm-stdout"),
            threading.Thread(target=self._read_stderr, args=(self._proc.stderr,), daemon=True, name="mlx_lm-stderr"),
        ]
        for t in self._threads:
            t.start()
        try:
            hello = self.receive(startup_timeout, doing="starting")
            if hello.get("type") != "hello" or hello.get("protocol") not in P.COMPATIBLE_VERSIONS:
                raise WorkerError(
                    f"the worker speaks protocol {hello.get('protocol')!r}, this client speaks "
                    f"{' or '.join(map(str, P.COMPATIBLE_VERSIONS))} (first line: {str(hello)[:200]})"
                )
            self.protocol: int = hello["protocol"]
            # The longest request line the worker reads: a longer one is skipped unread and answered
            # with an id-less `line_too_long`, which no caller waiting on its own id would ever see.
            limit = hello.get("max_line_bytes")
            self.max_line_bytes: int | None = (
                limit if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0 else None
            )
        except BaseException:
            self.kill()
            raise

    @property
    def pid(self) -> int:
        return self._proc.pid

    def alive(self) -> bool:
        return self._proc.poll() is None

    # ---- reader threads ---------------------------------------------------------------------------

    def _read_stdout(self, stream: IO[bytes]) -> None:
        try:
            for raw in stream:
                try:
                    message = P.decode(raw)
                    P.check_reply(message)
                    self._lines.put(message)
                except P.ProtocolError as e:
                    self._lines.put(WorkerError(f"the worker wrote a line outside the protocol ({e}): {raw[:200]!r}"))
        except (OSError, ValueError):
            pass
        finally:
            self._lines.put(None)

    def _read_stderr(self, stream: IO[bytes]) -> None:
        try:
            for raw in stream:
                line = raw.decode("utf-8", "replace").rstrip()
                self._stderr.append(line)
                log.debug("[worker %d] %s", self._proc.pid, line)
        except (OSError, ValueError):
            pass

    def stderr_tail(self) -> str:
        return "\n".join(self._stderr)

    # ---- traffic ----------------------------------------------------------------------------------

    def send(self, message: Mapping[str, Any], *, doing: str = "sending") -> None:
        """Write one request line. A message JSON cannot carry (NaN) raises ValueError and sends nothing;
        only a failed write (the worker's stdin closed) means the worker is gone."""
        data = P.encode(message)  # outside the try: a bad value is the caller's, not a dead pipe
        try:
            self._stdin.write(data)
            self._stdin.flush()
        except (BrokenPipeError, ValueError, OSError):  # ValueError: our end of the pipe is closed
            raise self._died(doing) from None

    def poll(self, timeout: float, *, doing: str = "waiting") -> dict[str, Any] | None:
        """The next reply line, or None after `timeout` seconds without one. A dead worker raises WorkerDied."""
        try:
            item = self._lines.get(timeout=timeout)
        except queue.Empty:
            return None
        if item is None:
            self._lines.put(None)  # later calls see the same death
            raise self._died(doing)
        if isinstance(item, WorkerError):
            raise item
        return item

    def receive(self, timeout: float, *, doing: str = "waiting") -> dict[str, Any]:
        """The next reply line; silence for `timeout` seconds kills the worker and raises WorkerTimeout."""
        item = self.poll(timeout, doing=doing)
        if item is None:
            raise self.stalled(timeout, doing)
        return item

    def stalled(self, seconds: float, doing: str) -> WorkerTimeout:
        """Kill a worker that stopped answering; the error to raise for it."""
        self.kill()
        return WorkerTimeout(
            f"the mlx_lm worker (pid {self.pid}) sent nothing for {seconds:g}s while {doing}, and was killed"
            + self._tail_note()
        )

    def _died(self, doing: str) -> WorkerDied:
        try:
            code = self._proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:  # stdout closed but the process lingers: end it
            self.kill()
            code = self._proc.returncode
        self._threads[1].join(timeout=2.0)  # let the last stderr lines arrive
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
        return WorkerDied(f"the mlx_lm worker (pid {self.pid}) {how} while {doing}" + self._tail_note())

    def _tail_note(self) -> str:
        tail = self.stderr_tail()
        return f"; its last stderr lines:\n{tail}" if tail else "; it wrote nothing to stderr"

    # ---- ending -----------------------------------------------------------------------------------

    def kill(self) -> None:
        """End the process now and reap it."""
        if self._proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.kill()
        self._proc.wait()
        self._cleanup()

    def close(self, grace: float = 2.0) -> None:
        """Ask the worker to quit, wait up to `grace` seconds, then kill; always reaps it."""
        if self._proc.poll() is None:
            try:
                self._stdin.write(P.encode({"cmd": "cancel"}) + P.encode({"cmd": "quit"}))
                self._stdin.flush()
                self._stdin.close()  # end of input also ends the worker, once it is idle
            except (OSError, ValueError):
                pass
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=grace)
        self.kill()

    def _cleanup(self) -> None:
        # The process is reaped, so its pipes are at end of file: let the readers finish, then close.
        # At interpreter shutdown the daemon readers never run again (and may be frozen inside a
        # read, holding the stream's lock, while is_alive() already says False): closing their
        # streams then aborts the process ("Fatal Python error: _enter_buffered_busy"), so they are
        # left to the process's exit, as is a stream whose reader has not finished yet.
        finalizing = sys.is_finalizing()
        deadline = time.monotonic() + (0.0 if finalizing else 2.0)
        for t in self._threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        readers = {id(self._proc.stdout): self._threads[0], id(self._proc.stderr): self._threads[1]}
        for stream in (self._proc.stdin, self._proc.stdout, self._proc.stderr):
            reader = readers.get(id(stream))
            if stream is None or (reader is not None and (finalizing or reader.is_alive())):
                continue
            with contextlib.suppress(OSError):
                stream.close()

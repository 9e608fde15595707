"""The worker seen as any program would see it: a process, bytes in, JSON lines out."""
from __future__ import annotations

import collections
import json
import queue
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

BRIDGE_DIR = Path(__file__).resolve().parents[2] / "bridge"
TERMINAL = ("done", "result", "error")


class RawWorker:
    """`python bridge/` with pipes; every stdout line must parse as a JSON object (asserted on read)."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(BRIDGE_DIR), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        self.stderr: collections.deque[str] = collections.deque(maxlen=50)
        self._lines: queue.Queue[bytes] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        threading.Thread(target=self._drain, daemon=True).start()
        self.hello = self.read()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self._lines.put(raw)
        self._lines.put(b"")

    def _drain(self) -> None:
        assert self.proc.stderr is not None
        for raw in self.proc.stderr:
            self.stderr.append(raw.decode("utf-8", "replace"))

    def send_raw(self, data: bytes) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(data)
        self.proc.stdin.flush()

    def send(self, **message: Any) -> None:
        self.send_raw(json.dumps(message).encode() + b"\n")

    def read(self, timeout: float = 30.0) -> dict[str, Any]:
        try:
            raw = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no reply in {timeout}s; stderr: {''.join(self.stderr)[-2000:]}") from None
        assert raw, f"worker stdout closed (rc={self.proc.poll()}); stderr: {''.join(self.stderr)[-2000:]}"
        assert raw.endswith(b"\n")
        message = json.loads(raw)  # stdout carries nothing but protocol lines
        assert isinstance(message, dict) and message.get("type") in (
            "hello",
            "progress",
            "token",
            "done",
            "result",
            "error",
        )
        return message

    def until_terminal(self, rid: Any = None, timeout: float = 30.0) -> list[dict[str, Any]]:
        """Lines up to the terminal reply for `rid`; other requests' lines (cancel acks) are kept too."""
        out = []
        while True:
            line = self.read(timeout)
            out.append(line)
            if line["type"] in TERMINAL and line.get("id") == rid:
                return out

    def request(self, **message: Any) -> dict[str, Any]:
        self.send(**message)
        return self.until_terminal(message.get("id"))[-1]

    def close(self) -> int:
        if self.proc.poll() is None:
            try:
                self.send(cmd="quit")
                self.proc.stdin.close()  # type: ignore[union-attr]
            except OSError:
                pass
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()



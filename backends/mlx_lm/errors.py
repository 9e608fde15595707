"""What can go wrong between the client and its worker, as exception classes."""
from __future__ import annotations


class WorkerError(RuntimeError):
    """The worker failed as a process: it could not start, died, stopped answering, or broke the protocol."""


class WorkerDied(WorkerError):
    """The worker exited (killed, crashed, out of memory) while a reply was awaited."""


class WorkerTimeout(WorkerError):
    """The worker sent nothing for longer than allowed, and was killed."""


class WorkerReplyError(RuntimeError):
    """The worker answered a request with an `error` line; `code` is the protocol's error code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{message} [{code}]")
        self.code = code

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


class WorkerBadRequest(WorkerReplyError, ValueError):
    """The worker refused the request's content (`bad_field`): a caller's mistake, as a ValueError
    (e.g. a token id outside the embedding, an option out of range)."""


def reply_error(code: str, message: str) -> WorkerReplyError:
    """The exception for an `error` reply: WorkerBadRequest for a refused field, else WorkerReplyError."""
    return (WorkerBadRequest if code == "bad_field" else WorkerReplyError)(code, message)

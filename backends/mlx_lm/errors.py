"""What can go wrong between the client and its worker, as exception classes."""
from __future__ import annotations

from pymlxc.types import TemplateError


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


class WorkerTemplateError(WorkerReplyError, TemplateError):
    """The model's chat template could not render the messages (it raised, e.g. on a role it does
    not take, or it is broken or missing): a ValueError, as the metal backend's ChatTemplateError."""


# How the worker names (`f"{type(e).__name__}: {e}"`) what jinja2 raises inside mlx-lm's
# apply_chat_template: the template's own raise_exception() gives a TemplateError.
_JINJA_ERRORS = ("TemplateError", "TemplateSyntaxError", "TemplateAssertionError", "TemplateRuntimeError",
                 "TemplateNotFound", "UndefinedError", "SecurityError")


def reply_error(code: str, message: str, cmd: str | None = None, *, rendering_only: bool = False) -> WorkerReplyError:
    """The exception for an `error` reply to `cmd`: WorkerBadRequest for a refused field,
    WorkerTemplateError for a chat template that failed, else WorkerReplyError. `rendering_only`:
    the request did nothing but render and encode (a chat of no tokens), so any failure is the
    template's."""
    if code == "bad_field":
        return WorkerBadRequest(code, message)
    if cmd == "chat" and (code == "no_chat_template" or (code == "failed" and (
            rendering_only or message.partition(":")[0] in _JINJA_ERRORS))):
        return WorkerTemplateError(code, message)
    return WorkerReplyError(code, message)

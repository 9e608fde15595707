"""What can go wrong between the client and its worker, as exception classes."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pymlxc.bridge.protocol import CONTEXT_EXCEEDED
from pymlxc.types import ContextLengthError, TemplateError


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


class WorkerContextLengthError(WorkerReplyError, ContextLengthError):
    """The worker refused a prompt past the context (`context_length_exceeded`): the metal
    backend's ContextLengthError, in its words (made from the error's counts, not the worker's
    message)."""

    code = CONTEXT_EXCEEDED

    def __init__(self, message: str, prompt_tokens: int = 0, context_len: int = 0) -> None:
        ContextLengthError.__init__(self, message, prompt_tokens, context_len)


def _context_error(reply: Mapping[str, Any]) -> WorkerContextLengthError | None:
    """The ContextLengthError a `context_length_exceeded` reply stands for, or None where it lacks the counts."""
    tokens, limit, item = reply.get("prompt_tokens"), reply.get("context_len"), reply.get("item")
    if type(tokens) is not int or type(limit) is not int or not (item is None or type(item) is int):
        return None
    made = ContextLengthError.for_prompt(tokens, limit, item)
    return WorkerContextLengthError(str(made), tokens, limit)


# How the worker names (`f"{type(e).__name__}: {e}"`) what jinja2 raises inside mlx-lm's
# apply_chat_template: the template's own raise_exception() gives a TemplateError.
_JINJA_ERRORS = ("TemplateError", "TemplateSyntaxError", "TemplateAssertionError", "TemplateRuntimeError",
                 "TemplateNotFound", "UndefinedError", "SecurityError")


def reply_error(code: str, message: str, cmd: str | None = None, *, rendering_only: bool = False,
                reply: Mapping[str, Any] | None = None) -> WorkerReplyError:
    """The exception for an `error` reply to `cmd` (`reply`, the whole line): WorkerContextLengthError
    for a prompt past the context, WorkerBadRequest for a refused field, WorkerTemplateError for a
    chat template that failed, else WorkerReplyError. `rendering_only`: the request did nothing
    but render and encode (a chat of no tokens), so any other failure is the template's."""
    if code == CONTEXT_EXCEEDED and (context := _context_error(reply or {})) is not None:
        return context
    if code in ("bad_field", CONTEXT_EXCEEDED):
        return WorkerBadRequest(code, message)
    if cmd == "chat" and (code == "no_chat_template" or (code == "failed" and (
            rendering_only or message.partition(":")[0] in _JINJA_ERRORS))):
        return WorkerTemplateError(code, message)
    return WorkerReplyError(code, message)

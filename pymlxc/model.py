"""The `TextModel` and `Backend` protocols that every backend implements."""
from __future__ import annotations

import copy
import numbers
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from .bridge.protocol import surrogate_problem
from .options import LoadConfig
from .types import BatchResult, ClassifyResult, GenerateMetrics, Message, ModelInfo, Token


class ModelClosedError(RuntimeError):
    """The model was used after close()."""


class GenerationCancelled(RuntimeError):
    """Generation stopped early: the cancel event was set or the timeout passed."""


def detached_error(exc: BaseException, depth: int = 0) -> BaseException:
    """A copy of `exc` for err() that keeps no traceback (whose frames would keep the failed
    call's KV cache and inputs alive), nor do its chained exceptions: what every backend keeps."""
    try:
        kept = copy.copy(exc)
    except Exception:  # noqa: BLE001 - an exception type that cannot be copied: keep it, stripped
        kept = exc
    kept.__traceback__ = None
    for name in ("__cause__", "__context__"):
        chained = getattr(exc, name)
        setattr(kept, name, detached_error(chained, depth + 1) if chained is not None and depth < 8 else None)
    kept.__suppress_context__ = exc.__suppress_context__
    return kept


def check_text(text: str, what: str) -> None:
    """Raise ValueError naming the position of a lone surrogate in `text`: no tokenizer can encode
    it, and each backend (and the worker's wire check) says so alike."""
    problem = surrogate_problem(text)
    if problem is not None:
        raise ValueError(f"{what} {problem}")


def check_flag(name: str, value: Any) -> None:
    """TypeError naming `name` unless `value` is a bool: each backend would otherwise fail on it in
    its own words (tokenizers' "not an instance of 'bool'", the worker's bad_field)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, not {type(value).__name__} {value!r}")


def check_decode_ids(ids: Any) -> list[int]:
    """`ids` (what `decode` takes) as a list of ints: a sequence or iterable of ints, not a str,
    bytes or mapping (whose items are no token ids), each an int (not a bool, not a float or a
    numeric string, which int() would silently turn into another id). The vocabulary bound is the
    backend's check."""
    if isinstance(ids, (str, bytes, bytearray, Mapping)) or not isinstance(ids, Iterable):
        raise TypeError(f"ids must be a sequence of token ids (ints), not {type(ids).__name__}")
    checked: list[int] = []
    for n, token in enumerate(ids):
        if isinstance(token, bool) or not isinstance(token, numbers.Integral):
            raise TypeError(f"token {n} must be an int, not {type(token).__name__} {token!r}")
        checked.append(int(token))
    return checked


@runtime_checkable
class TextModel(Protocol):
    """A loaded text model.

    Errors: invalid arguments raise at once (a prompt with a lone surrogate, a token id outside the
    vocabulary: ValueError naming the position). Streams (`generate`, `chat`):
    - A stop (cancel event, timeout: GenerationCancelled; `close()` from another thread:
      ModelClosedError) ends the iterator quietly; the reason is kept in `err()`.
    - Any other error during a stream (out of memory, a failed kernel) is raised from the iterator
      and also kept in `err()`, so that a `for` loop cannot mistake it for the end of the text.
    - `err()` answers for the calling thread and is reset at each of its calls. What it keeps
      holds no traceback (no frame of the failed generation, so none of its arrays).
    Tokens: each `Token` is yielded as soon as its id is sampled; its text is "" while a character
    is unfinished, and bytes that can never be valid UTF-8 come out as U+FFFD at once. The texts
    add up to the decode of the ids, except that a character left unfinished by a stop id,
    a stop or an error is dropped.
    Lifetime: `close()` frees the weights; a stream running on another thread stops at its next
    token and `close()` waits for it first; a paused stream ends (ModelClosedError in `err()`)
    when resumed. Later calls raise ModelClosedError. A stream holds one of the model's
    `parallel_slots` from its first token to its end: a call on a thread whose own unfinished
    streams hold every slot raises RuntimeError instead of waiting forever.
    """

    @property
    def model_type(self) -> str: ...

    def generate(self, prompt: str, **config: Any) -> Iterator[Token]: ...

    def chat(self, messages: Sequence[Message | dict[str, str]], *,
             chat_template_kwargs: Mapping[str, Any] | None = None, **config: Any) -> Iterator[Token]: ...

    def classify(self, prompts: Sequence[str], **config: Any) -> list[ClassifyResult]: ...

    def batch_generate(self, prompts: Sequence[str], **config: Any) -> list[BatchResult]: ...

    def metrics(self) -> GenerateMetrics: ...

    def info(self) -> ModelInfo: ...

    def err(self) -> BaseException | None: ...

    def close(self) -> None: ...

    def __enter__(self) -> TextModel: ...

    def __exit__(self, *exc: object) -> None: ...


@runtime_checkable
class Backend(Protocol):
    """A way to run models. `available()` says whether it can run here, and `unavailable_reason()` why not."""

    name: str

    def available(self) -> bool: ...

    def unavailable_reason(self) -> str | None: ...

    def load(self, path: str, config: LoadConfig) -> TextModel: ...

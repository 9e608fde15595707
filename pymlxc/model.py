"""The `TextModel` and `Backend` protocols that every backend implements."""
from __future__ import annotations

import copy
import numbers
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from .bridge.protocol import surrogate_problem
from .options import LoadConfig, json_data_problem, key_problem
from .types import BatchResult, ClassifyResult, ContextLengthError, GenerateMetrics, Message, ModelInfo, Token


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


def check_context(prompt_tokens: int, context_len: int | None, item: int | None = None) -> None:
    """ContextLengthError for a prompt (a batch's `prompts` item `item`) of more tokens than
    `context_len`: every backend refuses it before running it, in the same words."""
    if context_len is not None and prompt_tokens > context_len:
        raise ContextLengthError.for_prompt(prompt_tokens, context_len, item)


def check_messages(messages: Any) -> list[dict[str, Any]]:
    """`messages` (what `chat` takes) as the template receives them, on every backend alike, as
    transformers' apply_chat_template passes them: a non-empty sequence of `Message`s or mappings
    with str keys, a str `role` and `content`, and any other keys (`name`, `tool_calls`,
    `reasoning_content`...) as they are, less those that are None. Values must be JSON data (what
    the mlx_lm backend's worker can receive; transformers too renders nothing else), their text
    valid Unicode. Else TypeError (ValueError for a wrong value) naming the message and the key."""
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise TypeError("messages must be a sequence of Message or {'role', 'content'} dicts, "
                        f"not {type(messages).__name__}")
    if not messages:  # a wrong value, not a wrong type
        raise ValueError("chat needs at least one message")
    out = []
    for n, message in enumerate(messages):
        fields = message.to_dict() if isinstance(message, Message) else message
        if not isinstance(fields, Mapping) or "role" not in fields or "content" not in fields:
            raise TypeError(f"message {n} must be a Message or a dict with 'role' and 'content'")
        if not isinstance(fields["role"], str) or not isinstance(fields["content"], str):
            raise TypeError(f"message {n}: role and content must be strings")
        for key, value in fields.items():
            # A template reads a message's fields by name; the worker's JSON has no other keys.
            wrong = key_problem(key, f"message {n}") or json_data_problem(value, f"message {n}'s {key}")
            if wrong is not None:
                raise wrong
        out.append({key: value for key, value in fields.items() if value is not None})
    return out


@runtime_checkable
class TextModel(Protocol):
    """A loaded text model.

    Errors: invalid arguments raise at once (a prompt with a lone surrogate, a token id outside the
    vocabulary: ValueError naming the position; chat messages as `check_messages` takes them). A
    prompt of more tokens than the load's `context_len` raises ContextLengthError before it runs
    (where the prompt is tokenized in another process, the mlx_lm backend's worker, a stream raises
    it before its first token); `prompt_length` counts it. Streams (`generate`, `chat`):
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

    def chat(self, messages: Sequence[Message | Mapping[str, Any]], *,
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

"""The `TextModel` and `Backend` protocols that every backend implements."""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

from .options import LoadConfig
from .types import BatchResult, ClassifyResult, GenerateMetrics, Message, ModelInfo, Token


class ModelClosedError(RuntimeError):
    """The model was used after close()."""


class GenerationCancelled(RuntimeError):
    """Generation stopped early: the cancel event was set or the timeout passed."""


@runtime_checkable
class TextModel(Protocol):
    """A loaded text model.

    Errors: invalid arguments raise at once. An error during a stream (including cancellation and
    timeout) ends the iterator quietly and is kept in `err()`; `err()` is reset at each new call.
    """

    @property
    def model_type(self) -> str: ...

    def generate(self, prompt: str, **config: Any) -> Iterator[Token]: ...

    def chat(self, messages: Sequence[Message | dict[str, str]], **config: Any) -> Iterator[Token]: ...

    def classify(self, prompts: Sequence[str], **config: Any) -> list[ClassifyResult]: ...

    def batch_generate(self, prompts: Sequence[str], **config: Any) -> list[BatchResult]: ...

    def metrics(self) -> GenerateMetrics: ...

    def info(self) -> ModelInfo: ...

    def err(self) -> BaseException | None: ...

    def close(self) -> None: ...

    def __enter__(self) -> "TextModel": ...

    def __exit__(self, *exc: object) -> None: ...


@runtime_checkable
class Backend(Protocol):
    """A way to run models. `available()` says whether it can run here, and `unavailable_reason()` why not."""

    name: str

    def available(self) -> bool: ...

    def unavailable_reason(self) -> str | None: ...

    def load(self, path: str, config: LoadConfig) -> TextModel: ...

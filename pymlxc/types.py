"""Plain data types of the public API (mirroring go-inference)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class TemplateError(ValueError):
    """A model's chat template could not render the messages (it raised, e.g. on a role it does not
    take, or it is broken, missing, or went past its bounds): the same class on every backend."""


class ContextLengthError(ValueError):
    """A prompt of more tokens than the model's `context_len` (the load option), refused before it
    runs by every call that runs a prompt, on every backend, in the same words. Past the context
    the caches would keep only the prompt's first and latest tokens, and which of its middle the
    model saw would depend on how each backend cuts its prefill into chunks. `prompt_tokens` and
    `context_len` are the counts; `prompt_length` counts a prompt without refusing it."""

    def __init__(self, message: str, prompt_tokens: int = 0, context_len: int = 0) -> None:
        # One positional argument: copy.copy (err() keeps copies) rebuilds it from args, then its attributes.
        super().__init__(message)
        self.prompt_tokens = prompt_tokens
        self.context_len = context_len

    @classmethod
    def for_prompt(cls, prompt_tokens: int, context_len: int, item: int | None = None) -> ContextLengthError:
        """The error for a prompt (a batch's `prompts` item `item`) of `prompt_tokens` tokens."""
        what = "the prompt" if item is None else f"prompts item {item}"
        return cls(f"{what} has {prompt_tokens} tokens, more than the context length of {context_len}: "
                   "shorten it, or load the model with a larger context_len", prompt_tokens, context_len)


@dataclass(frozen=True)
class Token:
    """One generated token: its id and its text piece (pieces concatenate to the full decode)."""

    id: int
    text: str


@dataclass(frozen=True)
class Message:
    """One chat turn."""

    role: str
    content: str

    def to_dict(self) -> dict[str, str]:
        return {"role": self.role, "content": self.content}


@dataclass(frozen=True)
class ClassifyResult:
    """The next token sampled after a prompt, and its logits when `return_logits` was asked."""

    token: Token
    logits: list[float] | None = None


@dataclass(frozen=True)
class BatchResult:
    """The tokens generated for one prompt of a batch, or the error that stopped it."""

    tokens: list[Token] = field(default_factory=list)
    error: str | None = None

    @property
    def text(self) -> str:
        return "".join(t.text for t in self.tokens)


@dataclass
class GenerateMetrics:
    """Counts, durations (seconds) and memory (bytes) of the last call on a model."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_duration: float = 0.0
    decode_duration: float = 0.0
    total_duration: float = 0.0
    prefill_tokens_per_sec: float = 0.0
    decode_tokens_per_sec: float = 0.0
    peak_memory_bytes: int = 0
    active_memory_bytes: int = 0
    prompt_cache_hits: int = 0
    prompt_cache_misses: int = 0
    prompt_cache_hit_tokens: int = 0
    prompt_cache_restore_duration: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class AttentionSnapshot:
    """What a model's attention saw for one prompt, by `inspect_attention`.

    `keys[layer][kv_head]` is a float32 numpy array (seq_len, head_dim) of that head's keys after
    RoPE (and after any per-head norm), exactly what the KV cache holds; `queries[layer][head]` the
    same for each query head (after RoPE, before the attention scale), when they were asked for.
    The head counts and `head_dim` are layer 0's; an architecture that varies them by layer shows
    it in the arrays' shapes.
    """

    architecture: str
    num_layers: int
    num_kv_heads: int
    num_query_heads: int
    seq_len: int
    head_dim: int
    keys: list[list[Any]]
    queries: list[list[Any]] | None = None
    token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class ModelInfo:
    """What a loaded model is."""

    architecture: str
    vocab_size: int
    num_layers: int
    hidden_size: int
    quant_bits: int = 0
    quant_group: int = 0

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

"""Generation and load options: frozen dataclasses with go-inference's fields and defaults."""
from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class GenerateConfig:
    """How to generate. temperature 0 means greedy; 0 for top_k/top_p/min_p means off."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 0.0
    min_p: float = 0.0
    repeat_penalty: float = 1.0
    stop_tokens: tuple[int, ...] = ()
    return_logits: bool = False
    seed: int | None = None
    timeout: float | None = None  # seconds for the whole call; stops between tokens
    cancel: threading.Event | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, not {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, not {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, not {self.top_k}")
        if not 0.0 <= self.top_p <= 1.0:
            raise ValueError(f"top_p must be in [0, 1], not {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], not {self.min_p}")
        if self.repeat_penalty <= 0:
            raise ValueError(f"repeat_penalty must be > 0, not {self.repeat_penalty}")
        if self.timeout is not None and self.timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, not {self.timeout}")
        object.__setattr__(self, "stop_tokens", tuple(int(t) for t in self.stop_tokens))


@dataclass(frozen=True)
class LoadConfig:
    """How to load. gpu_layers=-1 offloads everything (MLX's only mode); 0 runs on the CPU."""

    backend: str | None = None
    context_len: int = 131072
    parallel_slots: int = 1
    adapter_path: str | None = None
    gpu_layers: int = -1
    # The metal backend's prompt cache (KV caches of earlier calls reused for a shared prompt
    # prefix): at most this many entries and bytes, least recently used dropped first; 0 turns it off.
    prompt_cache_entries: int = 8
    prompt_cache_bytes: int = 2 << 30

    def __post_init__(self) -> None:
        if self.context_len <= 0:
            raise ValueError(f"context_len must be > 0, not {self.context_len}")
        if self.parallel_slots < 1:
            raise ValueError(f"parallel_slots must be >= 1, not {self.parallel_slots}")
        if self.prompt_cache_entries < 0 or self.prompt_cache_bytes < 0:
            raise ValueError(f"prompt_cache_entries and prompt_cache_bytes must be >= 0, not "
                             f"{self.prompt_cache_entries} and {self.prompt_cache_bytes}")


def make_config(cls: type[T], base: T | None = None, **options: Any) -> T:
    """Build `cls` from keyword options, naming any unknown option."""
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(options) - names)
    if unknown:
        raise TypeError(f"unknown option(s) {', '.join(unknown)} for {cls.__name__}; known: {', '.join(sorted(names))}")
    if base is not None:
        return dataclasses.replace(base, **options)  # type: ignore[type-var]
    return cls(**options)

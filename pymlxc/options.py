"""Generation and load options: frozen dataclasses with go-inference's fields and defaults.

Every option is checked when the config is made, so that a bad value raises `TypeError` (wrong
type) or `ValueError` (wrong value) naming the option at the call, on every backend, instead of
failing mid-stream or giving garbage. Numbers must be real numbers of the right kind: an int option
takes an int (not a bool, not a float such as 2.5), a float option an int or float that is finite
and not subnormal (sampling runs in float32, where such values overflow or vanish).
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import os
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, runtime_checkable

from .bridge.protocol import FLOAT32_TINY as _FLOAT32_TINY
from .bridge.protocol import (
    MAX_REPEAT_PENALTY,
    MAX_TEMPERATURE,
    MIN_REPEAT_PENALTY,
    MIN_TEMPERATURE,
    surrogate_problem,
    template_name_problem,
    template_value_problem,
)
from .bridge.protocol import REPEAT_PENALTY_CONTEXT as REPEAT_PENALTY_CONTEXT
from .settings import Settings, current

T = TypeVar("T")

# The sampling bounds (MIN_TEMPERATURE ...) live in bridge/protocol.py, which the worker also checks
# its JSON with and which may import only the standard library.
SEED_LIMIT = 2**64  # MLX seeds are uint64
DISTRIBUTED_MODES = ("tensor", "pipeline")
DTYPES = ("auto", "float32", "float16", "bfloat16")


@runtime_checkable
class CancelEvent(Protocol):
    """What `cancel` must be: a `threading.Event`, or anything with an `is_set()` method."""

    def is_set(self) -> bool: ...


def checked_int(name: str, value: Any, *, low: int | None = None, high: int | None = None) -> int:
    """`value` as an int when it is an integer (not a bool) within [low, high)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, not {type(value).__name__} {value!r}")
    number = int(value)
    if (low is not None and number < low) or (high is not None and number >= high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high})"
        raise ValueError(f"{name} must be {bounds}, not {number}")
    return number


def checked_real(name: str, value: Any) -> float:
    """`value` as a float when it is a finite, non-subnormal real number (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, not {type(value).__name__} {value!r}")
    try:
        number = float(value)
    except OverflowError:  # an int (or Fraction, Decimal) beyond float's range
        raise ValueError(f"{name} must be finite, not {type(value).__name__} too large for a float") from None
    if not math.isfinite(number):
        raise ValueError(f"{name} must be finite, not {number}")
    if number != 0.0 and abs(number) < _FLOAT32_TINY:
        raise ValueError(f"{name} must be 0 or at least {_FLOAT32_TINY:g} in size (a subnormal float), not {number!r}")
    return number


def _in_range(name: str, value: float, low: float, high: float, extra: str = "") -> None:
    if not low <= value <= high:
        raise ValueError(f"{name} must be {extra}in [{low:g}, {high:g}], not {value!r}")


def checked_token_ids(name: str, value: Any) -> tuple[int, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise TypeError(f"{name} must be a sequence of token ids, not {type(value).__name__} {value!r}")
    return tuple(checked_int(f"{name}[{i}]", t, low=0) for i, t in enumerate(value))


def check_stop_tokens(stop_tokens: Iterable[int], vocab_size: int) -> None:
    """Refuse `stop_tokens` (checked ints >= 0, GenerateConfig's) that a model of `vocab_size`
    tokens never samples: such an id never ends a generation, so it would run on to max_tokens."""
    for i, token in enumerate(stop_tokens):
        if not 0 <= token < vocab_size:
            raise ValueError(f"stop_tokens[{i}] is {token}, outside the model's vocabulary of {vocab_size} tokens "
                             f"(ids 0 to {vocab_size - 1})")


def check_sampling(options: Any, penalty: str) -> dict[str, Any]:
    """The sampling options of `options` (its max_tokens, temperature, top_k, top_p, min_p, seed and
    its repeat penalty, the attribute named `penalty`) checked and normalized, by name: what
    `GenerateConfig` and the batching scheduler's `SamplingParams` both take."""
    checked: dict[str, Any] = {
        "max_tokens": checked_int("max_tokens", options.max_tokens, low=0),
        "top_k": checked_int("top_k", options.top_k, low=0),
    }
    temperature = checked_real("temperature", options.temperature)
    if temperature != 0.0:
        _in_range("temperature", temperature, MIN_TEMPERATURE, MAX_TEMPERATURE, "0 (greedy) or ")
    checked["temperature"] = temperature
    for name in ("top_p", "min_p"):
        checked[name] = checked_real(name, getattr(options, name))
        _in_range(name, checked[name], 0.0, 1.0)
    checked[penalty] = checked_real(penalty, getattr(options, penalty))
    _in_range(penalty, checked[penalty], MIN_REPEAT_PENALTY, MAX_REPEAT_PENALTY)
    if options.seed is not None:
        checked["seed"] = checked_int("seed", options.seed, low=0, high=SEED_LIMIT)
    return checked


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
        put = object.__setattr__
        for name, value in check_sampling(self, penalty="repeat_penalty").items():
            put(self, name, value)
        put(self, "stop_tokens", checked_token_ids("stop_tokens", self.stop_tokens))
        if not isinstance(self.return_logits, bool):
            raise TypeError(f"return_logits must be a bool, not {type(self.return_logits).__name__}")
        if self.timeout is not None:
            timeout = checked_real("timeout", self.timeout)
            # threading's waits refuse longer timeouts; a timeout that never fires is None.
            if not 0.0 < timeout <= threading.TIMEOUT_MAX:
                raise ValueError(f"timeout must be > 0 and at most {threading.TIMEOUT_MAX:g} seconds "
                                 f"(None for no timeout), not {timeout!r}")
            put(self, "timeout", timeout)
        if self.cancel is not None and not (isinstance(self.cancel, CancelEvent) and callable(self.cancel.is_set)):
            raise TypeError(f"cancel must be a threading.Event (or have an is_set() method), "
                            f"not {type(self.cancel).__name__} {self.cancel!r}")


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
    # The PYMLXC_* switches the model decodes with (pymlxc/settings.py): the process's by default.
    settings: Settings = field(default_factory=current)
    # Split the model over the processes launched together (`pymlxc launch` / `mlx.launch`):
    # "tensor" (heads and MLP columns per rank) or "pipeline" (layers per rank); docs/distributed.md.
    distributed: str | None = None
    # The dtype the model computes in (the metal backend): "auto" keeps a checkpoint's own (a
    # quantized GGUF file: float16 where its architecture is safe in it, docs/gguf.md), or every
    # floating tensor is cast to the one named (half-precision quantization scales stay so under float32).
    dtype: str = "auto"

    def __post_init__(self) -> None:
        put = object.__setattr__
        if not isinstance(self.dtype, str) or self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(map(repr, DTYPES))}, not {self.dtype!r}")
        if not isinstance(self.settings, Settings):
            raise TypeError(f"settings must be a pymlxc.settings.Settings, not {type(self.settings).__name__}")
        if self.distributed is not None:
            if not isinstance(self.distributed, str) or self.distributed not in DISTRIBUTED_MODES:
                raise ValueError(f"distributed must be one of {', '.join(map(repr, DISTRIBUTED_MODES))} or None, "
                                 f"not {self.distributed!r}")
            # Each rank's steps must pair their collectives one to one: the uncompiled loop only.
            put(self, "settings", dataclasses.replace(self.settings, compile=False))
        if self.backend is not None and not isinstance(self.backend, str):
            raise TypeError(f"backend must be a str or None, not {type(self.backend).__name__}")
        if self.adapter_path is not None:
            if not isinstance(self.adapter_path, (str, os.PathLike)):
                raise TypeError(f"adapter_path must be a path or None, not {type(self.adapter_path).__name__}")
            put(self, "adapter_path", os.fspath(self.adapter_path))
        put(self, "context_len", checked_int("context_len", self.context_len, low=1))
        put(self, "parallel_slots", checked_int("parallel_slots", self.parallel_slots, low=1))
        put(self, "gpu_layers", checked_int("gpu_layers", self.gpu_layers, low=-1))
        put(self, "prompt_cache_entries", checked_int("prompt_cache_entries", self.prompt_cache_entries, low=0))
        put(self, "prompt_cache_bytes", checked_int("prompt_cache_bytes", self.prompt_cache_bytes, low=0))


def make_config(cls: type[T], base: T | None = None, **options: Any) -> T:
    """Build `cls` from keyword options, naming any unknown option."""
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(options) - names)
    if unknown:
        raise TypeError(f"unknown option(s) {', '.join(unknown)} for {cls.__name__}; known: {', '.join(sorted(names))}")
    if base is not None:
        return dataclasses.replace(base, **options)  # type: ignore[type-var]
    return cls(**options)


def key_problem(key: Any, at: str) -> Exception | None:
    """Why `key` of a mapping at `at` is not a JSON object's key with valid text, or None."""
    if not isinstance(key, str):
        return TypeError(f"{at} has a key that is not a str: {key!r}")
    problem = surrogate_problem(key)
    return None if problem is None else ValueError(f"{at} has a key that {problem}")


def json_data_problem(value: Any, where: str) -> Exception | None:
    """Why `value` (at `where`) is not JSON data with valid text, or None. Iterative, and each
    container visited once: a value may nest deeply, or hold itself."""
    stack, seen = [(value, where)], set()
    while stack:
        v, at = stack.pop()
        if v is None or isinstance(v, (bool, int)):
            continue
        if isinstance(v, float):
            if not math.isfinite(v):
                return ValueError(f"{at} is {v!r}, not a finite number")
        elif isinstance(v, str):
            problem = surrogate_problem(v)
            if problem is not None:
                return ValueError(f"{at} {problem}")
        elif isinstance(v, (list, tuple, Mapping)):
            if id(v) in seen:
                continue
            seen.add(id(v))
            if isinstance(v, Mapping):
                for k in v:
                    wrong = key_problem(k, at)
                    if wrong is not None:
                        return wrong
                stack.extend((item, f"{at}[{k!r}]") for k, item in reversed(list(v.items())))
            else:
                stack.extend((item, f"{at}[{i}]") for i, item in reversed(list(enumerate(v))))
        else:
            return TypeError(f"{at} is {type(v).__name__}, not JSON data (str, number, bool, None, list or dict)")
    return None


def check_template_kwargs(value: Mapping[str, Any] | None) -> dict[str, Any]:
    """`chat_template_kwargs` as a dict: identifier keys not starting with "_" nor named as the
    chat call's own arguments, `tools` and `documents` None or a list of dicts (the rules of the
    worker's wire check, `bridge/protocol.py`, which applies them to JSON it receives), and values
    JSON data with valid text (`json_data_problem`), on both backends alike."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise TypeError(f"chat_template_kwargs must be a mapping of template variables, not {type(value).__name__}")
    for key in value:
        problem = template_name_problem(key)
        if problem is not None:
            raise ValueError(f"chat_template_kwargs: {problem}")
        problem = template_value_problem(key, value[key], lambda v: type(v).__name__)
        if problem is not None:
            raise ValueError(f"chat_template_kwargs.{key} {problem}")
        # JSON data, as check_messages' other keys: what the mlx_lm backend's worker can receive.
        wrong = json_data_problem(value[key], f"chat_template_kwargs.{key}")
        if wrong is not None:
            raise wrong
    return dict(value)

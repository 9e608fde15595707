"""Token samplers and logits processors: closures made once per call, run on device each step.

A sampler maps logits [B, V] to token ids [B] (int32). The filters (top-k, then top-p, then min-p,
llama.cpp's order) only mask logits to -inf; temperature is applied afterwards, when sampling,
so the filters see the model's own distribution whatever the temperature.

Nothing here reads a value back to the host: the decode loop builds step n+1 before it reads the
token of step n, so the sampler and processors must stay lazy MLX graphs.
"""
from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
from typing import Protocol

import pymlxc.core as mx
from pymlxc.options import REPEAT_PENALTY_CONTEXT

_NEG_INF = float("-inf")
DEFAULT_PENALTY_CONTEXT = REPEAT_PENALTY_CONTEXT  # llama.cpp's repeat_last_n, the mlx_lm worker's too


class Sampler(Protocol):
    """logits [B, V] -> token ids [B] (int32)."""

    def __call__(self, logits: mx.Array) -> mx.Array: ...


class LogitsProcessor(Protocol):
    """(recent token ids [B, T] int32, logits [B, V]) -> logits [B, V]."""

    def __call__(self, history: mx.Array, logits: mx.Array) -> mx.Array: ...


def greedy(logits: mx.Array) -> mx.Array:
    return mx.argmax(logits, axis=-1).astype(mx.int32)


def apply_top_k(logits: mx.Array, k: int) -> mx.Array:
    """Keep exactly the k largest logits of each row (ties broken by MLX's partition)."""
    vocab = logits.shape[-1]
    if k <= 0 or k >= vocab:
        return logits
    # argpartition puts the k largest first (in any order); everything after them is dropped.
    dropped = mx.argpartition(-logits, k - 1, axis=-1)[..., k:]
    return mx.put_along_axis(logits, dropped, mx.array(_NEG_INF, logits.dtype), axis=-1)


def apply_top_p(logits: mx.Array, top_p: float) -> mx.Array:
    """Nucleus: keep the most likely tokens until their mass reaches top_p (the first always stays).

    The cut is turned into a logit threshold instead of a scatter, so tokens with equal logits are
    kept or dropped together and the argmax can never be lost to a tie.
    """
    if top_p <= 0.0 or top_p >= 1.0:
        return logits
    ascending = mx.sort(logits, axis=-1)
    probs = mx.softmax(ascending, axis=-1)
    # Mass of the strictly more likely tokens: 0 for the most likely one, so it is always kept.
    mass_above = mx.cumsum(probs, axis=-1, reverse=True, inclusive=False)
    # At least one: a top_p below float32's smallest value rounds to 0 and would keep nothing.
    kept = mx.maximum(mx.sum(mass_above < top_p, axis=-1, keepdims=True), 1)
    vocab = logits.shape[-1]
    threshold = mx.take_along_axis(ascending, vocab - kept, axis=-1)
    return mx.where(logits >= threshold, logits, _NEG_INF)


def apply_min_p(logits: mx.Array, min_p: float) -> mx.Array:
    """Keep tokens whose probability is at least min_p times the top token's probability."""
    if min_p <= 0.0:
        return logits
    # p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p): no softmax needed.
    threshold = mx.max(logits, axis=-1, keepdims=True) + math.log(min_p)
    return mx.where(logits >= threshold, logits, _NEG_INF)


def make_key(seed: int | None) -> mx.Array:
    """A PRNG key: from `seed` when given (reproducible), else from the OS's entropy.

    Every sampler owns its key instead of using MLX's global generator, so concurrent generations
    neither share nor disturb one another's random state.
    """
    return mx.random.key(secrets.randbits(63) if seed is None else seed)


def make_sampler(temperature: float = 0.0, top_k: int = 0, top_p: float = 0.0, min_p: float = 0.0,
                 key: mx.Array | int | None = None) -> Sampler:
    """A sampler for these settings. temperature 0 is greedy (the filters then change nothing).

    `key` is an MLX key, a seed, or None for a fresh random key; the sampler splits it at every
    call, so the same key gives the same tokens for the same logits.
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, not {temperature}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0, not {top_k}")
    if not 0.0 <= top_p <= 1.0:
        raise ValueError(f"top_p must be in [0, 1], not {top_p}")
    if not 0.0 <= min_p <= 1.0:
        raise ValueError(f"min_p must be in [0, 1], not {min_p}")
    if temperature == 0:
        return greedy

    state = [key if isinstance(key, mx.Array) else make_key(key)]
    inv_temp = 1.0 / temperature

    def sample(logits: mx.Array) -> mx.Array:
        logits = logits.astype(mx.float32)
        if top_k:
            logits = apply_top_k(logits, top_k)
        if top_p:
            logits = apply_top_p(logits, top_p)
        if min_p:
            logits = apply_min_p(logits, min_p)
        keys = mx.random.split(state[0])
        state[0] = keys[0]
        return mx.random.categorical(logits * inv_temp, key=keys[1]).astype(mx.int32)

    return sample


def make_repeat_penalty(penalty: float, context: int = DEFAULT_PENALTY_CONTEXT) -> LogitsProcessor:
    """llama.cpp's repeat penalty: for each token among the last `context` ones, divide a positive
    logit by `penalty` and multiply a negative one (so a penalty > 1 always makes it less likely)."""
    if penalty <= 0:
        raise ValueError(f"repeat_penalty must be > 0, not {penalty}")
    if context <= 0:
        raise ValueError(f"repeat penalty context must be > 0, not {context}")

    def process(history: mx.Array, logits: mx.Array) -> mx.Array:
        if history.shape[-1] > context:
            history = history[:, -context:]
        seen = mx.take_along_axis(logits, history, axis=-1)
        seen = mx.where(seen < 0, seen * penalty, seen / penalty)
        # A token seen twice is written twice with the same value: duplicates are harmless.
        return mx.put_along_axis(logits, history, seen, axis=-1)

    return process


def make_logits_processors(repeat_penalty: float = 1.0,
                           context: int = DEFAULT_PENALTY_CONTEXT) -> list[LogitsProcessor]:
    """The processors for these settings (none when the penalty is 1)."""
    if repeat_penalty <= 0:
        raise ValueError(f"repeat_penalty must be > 0, not {repeat_penalty}")
    if repeat_penalty == 1.0:
        return []
    return [make_repeat_penalty(repeat_penalty, context)]


def apply_processors(processors: Sequence[LogitsProcessor], history: mx.Array, logits: mx.Array) -> mx.Array:
    for process in processors:
        logits = process(history, logits)
    return logits

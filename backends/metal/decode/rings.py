"""The fixed-size buffers of the compiled decode: how many slots each layer's keys and values get,
how they grow, and how they leave and return to the layer's cache.

Shapes must not change from token to token for one trace to serve, so decoding runs on fixed-size
buffers instead of growing caches:

* every layer's keys and values live in a ring of `R` slots, position `p` in slot `p % R`; a
  full-attention layer has `R` > every position written so far (it never wraps: slot = position),
  a sliding-window layer keeps `R = window` slots (mlx-lm's rotating cache holds the same tokens);
  a recurrent layer's fixed-size state is passed whole (ring 0);
* a full-attention layer's buffer starts with room for the prompt and the first token and grows
  as tokens arrive (`Rings`): to the next multiple of BUFFER_STEP at least, doubling, never past
  what `prompt + max_tokens` needs. So the memory of a short generation does not depend on
  `max_tokens`, and a long one traces once per buffer size (log2 of its length in 256-token steps).

The caches lay their tokens out as rings and take them back themselves (`decode_buffers`,
`release_buffers`, `take_back` in cache.py and recurrent_cache.py); this module only plans sizes.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pymlxc.core as mx
from pymlxc.core import Array

from ..cache import KVCache, RotatingKVCache
from ..recurrent_cache import RecurrentCache

BUFFER_STEP = 256  # decode buffers are sized in steps of this many tokens (mlx-lm's cache step)
# ...plus a few slots, so that a buffer's length is never a multiple of 256. MLX's CUDA backend
# sends one-token attention over a prefix of a buffer whose length is such a multiple to cuDNN
# (`use_cudnn_for_decoding`), which measured 20.8 against 6.7 us per call for its own kernel at 300
# keys, and 36.7 against 23.3 at 2048 (H100; docs/performance.md, "Measurements behind these choices").
BUFFER_PAD = 8


def decode_capacity(prompt_len: int, max_tokens: int) -> int:
    """Slots a full-attention layer needs for a generation: rounded up to BUFFER_STEP, plus BUFFER_PAD."""
    need = max(prompt_len + max_tokens, 1)
    return -(-need // BUFFER_STEP) * BUFFER_STEP + BUFFER_PAD


def first_capacity(prompt_len: int, max_tokens: int) -> int:
    """Slots a full-attention layer starts a generation with: the prompt's (its last token is the
    first step's input; BUFFER_PAD leaves room for the tokens after it), all of the generation's
    where that is less. Room for one more token here cost a whole BUFFER_STEP more whenever
    `prompt_len` was a multiple of it."""
    return min(decode_capacity(prompt_len, 0), decode_capacity(prompt_len, max_tokens))


def grown_capacity(capacity: int, needed: int, full: int) -> int:
    """The next buffer size after `capacity` slots, for `needed` slots: twice the size (in
    BUFFER_STEP steps), at least `needed`, at most `full` (what the whole generation needs)."""
    doubled = 2 * (capacity - BUFFER_PAD) + BUFFER_PAD
    return min(full, max(decode_capacity(needed, 0), doubled))


def reserve(cache: Sequence[Any], capacity: int) -> None:
    """Make each empty cache allocate `capacity` slots at its first update (a rotating cache: at
    most its size), so that prefill writes straight into the buffer that decoding starts with (no
    copy). `unreserve` undoes it (`CompiledDecoder.decode` when the generation ends) when the generation ends."""
    for c in cache:
        if type(c) in (KVCache, RotatingKVCache):
            c.reserve(capacity)


def unreserve(cache: Sequence[Any]) -> None:
    for c in cache:
        if type(c) in (KVCache, RotatingKVCache):
            c.unreserve()


# ---------------------------------------------------------------------- rings from and back to caches

@dataclass
class RingLayer:
    """How one layer's cache maps to its ring."""

    cache: Any
    ring: int
    window: int | None


def plan_rings(cache: Sequence[Any], capacity: int, last_position: int) -> list[RingLayer] | None:
    """The ring of each layer, or None when a cache is of a kind this path does not handle (or
    would have to evict tokens it must keep)."""
    layers = []
    for c in cache:
        if type(c) is KVCache:
            layers.append(RingLayer(c, capacity, None))
        elif type(c) is RotatingKVCache:
            if c.keep and last_position >= c.max_size:
                return None  # a context-bounded cache would evict with sinks kept: not a ring
            ring = min(c.max_size, capacity)
            layers.append(RingLayer(c, ring, c.max_size if ring == c.max_size else None))
        elif type(c) is RecurrentCache and c.left_padding is None:
            layers.append(RingLayer(c, 0, None))  # ring 0: a fixed-size state, passed whole from step to step
        else:
            return None
    return layers


def ring_buffers(layer: RingLayer) -> tuple[Array, Array]:
    """The layer's keys and values laid out as its ring (slot = position % ring)."""
    buffers: tuple[Array, Array] = (layer.cache.decode_buffers() if layer.ring == 0
                                    else layer.cache.decode_buffers(layer.ring))
    return buffers


def take_buffers(layers: Sequence[RingLayer]) -> list[Array]:
    """[k0, v0, k1, v1, ...]: every layer's ring, which the decode session owns from now on (a
    cache still holding its buffers would make every buffer's first write a copy: MLX writes in
    place only into an array nothing else holds, so a second KV cache at the peak)."""
    buffers = [a for layer in layers for a in ring_buffers(layer)]
    for layer in layers:
        layer.cache.release_buffers()
    return buffers


def give_back(layers: Sequence[RingLayer], buffers: Sequence[Array], offset: int) -> None:
    """Put the rings `buffers` ([k0, v0, ...]) back into the layers' caches, in their own layouts,
    at `offset` tokens."""
    for i, layer in enumerate(layers):
        layer.cache.take_back(buffers[2 * i], buffers[2 * i + 1], offset)


class Rings:
    """The rings of one decode session, grown as positions arrive (see the module doc). `layers` is
    one list for the session's life: growing replaces its items."""

    def __init__(self, layers: list[RingLayer], capacity: int, full: int, last_position: int) -> None:
        self.layers = layers
        self.capacity = capacity  # slots of the layers that grow (full attention)
        self.full = full
        self.last_position = last_position

    def key(self) -> tuple[tuple[int, int | None], ...]:
        return tuple((layer.ring, layer.window) for layer in self.layers)

    def grow_for(self, position: int, buffers: list[Array]) -> list[Array] | None:
        """Where a step at `position` does not fit the growing layers: their buffers grown (a new
        list; zeros after the positions held, which stay at their slots) and `layers` updated.
        None where it fits."""
        if position < self.capacity:
            return None
        capacity = grown_capacity(self.capacity, position + 1, self.full)
        if capacity <= position:
            raise RuntimeError(f"decode position {position} is past the {self.full} slots planned for this generation")
        layers = plan_rings([layer.cache for layer in self.layers], capacity, self.last_position)
        if layers is None:  # the same caches planned before: cannot happen unless they changed type
            raise RuntimeError("the decode caches changed during the generation")
        out = list(buffers)
        for i, (old, new) in enumerate(zip(self.layers, layers, strict=True)):
            extra = new.ring - old.ring
            for j in (2 * i, 2 * i + 1) if extra > 0 else ():
                a = out[j]
                b, h, _, d = a.shape
                out[j] = mx.concatenate([a, mx.zeros((b, h, extra, d), a.dtype)], axis=2)
        self.layers[:] = layers
        self.capacity = capacity
        return out


__all__ = ["BUFFER_STEP", "BUFFER_PAD", "RingLayer", "Rings", "plan_rings", "ring_buffers", "take_buffers", "give_back",
           "decode_capacity", "first_capacity", "grown_capacity", "reserve", "unreserve"]

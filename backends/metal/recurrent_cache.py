"""The cache of a linear-attention layer (Gated DeltaNet): a short-convolution window and a
recurrent state, both of fixed size whatever the number of tokens seen.

`conv` [B, K-1, conv_dim] holds the last K-1 inputs of the layer's causal convolution, `recurrent`
[B, Hv, Dv, Dk] (float32) the delta-rule state. Unlike a KV cache the state after n tokens cannot
be cut out of a later state, so the prompt cache can only restore a prefix where the state was
kept: the cache keeps a copy (a reference: arrays are immutable) of its state at the end of each
multi-token update, that is at the prefill's chunk boundaries and at the end of each prompt
(`snapshots`, the latest MAX_SNAPSHOTS of them), and `restorable(n)` says the longest of those
within n tokens. One-token decode steps keep none (a state per token would cost the state's size
per token).

Left-padded batches: `left_padding` [B] (set through `set_left_padding`) marks each row's first
real position; `token_mask(n)` is then the [B, n] mask of real tokens among the next n, which the
layer uses to leave the state untouched by padding.

The class follows `cache.Cache` (offset, state, trim, nbytes, make_mask) so that the generation
loops treat it as any layer cache, and the prompt cache's `prefix`/`restorable` and file
`layout`/`arrays`/`from_file`.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import pymlxc.core as mx
from pymlxc.core import Array

from .cache import Mask

MAX_SNAPSHOTS = 4
KIND = "RecurrentCache"


class RecurrentCacheError(ValueError):
    """A recurrent cache given arrays that do not fit it (a prompt cache file of another model)."""


class RecurrentCache:
    """Conv window and delta-rule state of one Gated DeltaNet layer (see the module doc)."""

    def __init__(self) -> None:
        self.offset = 0
        self.conv: Array | None = None
        self.recurrent: Array | None = None
        self.left_padding: Array | None = None
        self._snapshots: OrderedDict[int, tuple[Array, Array]] = OrderedDict()

    # ------------------------------------------------------------------ the layer's side
    def token_mask(self, n: int) -> Array | None:
        """[B, n] bool, True where the next n positions hold real tokens (None: all do)."""
        if self.left_padding is None:
            return None
        positions = mx.arange(self.offset, self.offset + n, dtype=mx.int32)
        return positions[None, :] >= self.left_padding[:, None]

    def update(self, conv: Array, recurrent: Array, n: int) -> None:
        """The layer's new conv window and state after `n` more tokens."""
        self.conv, self.recurrent = conv, recurrent
        self.offset += n
        if n > 1:
            self._snapshots[self.offset] = (conv, recurrent)
            self._snapshots.move_to_end(self.offset)
            while len(self._snapshots) > MAX_SNAPSHOTS:
                self._snapshots.popitem(last=False)

    # ------------------------------------------------------------------ Cache protocol
    def update_and_fetch(self, keys: Array, values: Array) -> tuple[Array, Array]:
        raise TypeError("a RecurrentCache belongs to a linear-attention layer: it holds no keys and values")

    def make_mask(self, n: int, window_size: int | None = None) -> Mask:
        return None  # linear attention takes no attention mask (padding: `token_mask`)

    @property
    def state(self) -> tuple[Array, ...]:
        arrays: list[Array] = [] if self.conv is None or self.recurrent is None else [self.conv, self.recurrent]
        for conv, rec in self._snapshots.values():
            arrays += [conv, rec]
        return tuple(arrays)

    @property
    def nbytes(self) -> int:
        seen = {id(a): a.nbytes for a in self.state}
        return sum(seen.values())

    def is_trimmable(self) -> bool:
        return False  # a state cannot forget its last tokens

    def trim(self, n: int) -> int:
        return 0

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.conv is None

    def free(self) -> None:
        for a in self.state:
            a.free()
        self.conv = self.recurrent = None
        self._snapshots.clear()
        self.offset = 0

    # ------------------------------------------------------------------ copies and prefixes
    def copy(self) -> RecurrentCache:
        c = RecurrentCache()
        c.offset, c.conv, c.recurrent, c.left_padding = self.offset, self.conv, self.recurrent, self.left_padding
        c._snapshots = OrderedDict(self._snapshots)
        return c

    def restorable(self, n: int) -> int:
        """The most tokens m <= n whose state this cache can give back (0: none)."""
        if self.conv is not None and self.offset <= n:
            return self.offset
        return max((m for m in self._snapshots if m <= n), default=0)

    def prefix(self, n: int) -> RecurrentCache | None:
        """A cache in this one's state after its first `n` tokens, or None where that state was
        not kept. Arrays are shared; later updates of either write new arrays."""
        if self.conv is None or self.left_padding is not None or not 0 < n <= self.offset:
            return None
        if n == self.offset:
            conv, rec = self.conv, self.recurrent
        elif n in self._snapshots:
            conv, rec = self._snapshots[n]
        else:
            return None
        c = RecurrentCache()
        c.offset, c.conv, c.recurrent = n, conv, rec
        c._snapshots = OrderedDict((m, s) for m, s in self._snapshots.items() if m <= n)
        return c

    # ------------------------------------------------------------------ prompt cache files
    @property
    def meta_state(self) -> tuple[int, ...]:
        return (self.offset,)

    def file_state(self) -> tuple[tuple[int, ...], Array, Array]:
        """What a prompt cache file stores for this layer: the meta (tokens seen, then the token
        counts of the kept states) and the conv windows and states, current first, stacked on a
        new first axis (so the file restores the prefixes the cache could)."""
        if self.conv is None:
            raise RecurrentCacheError("an empty recurrent cache has nothing to save")
        kept = [(m, s) for m, s in self._snapshots.items() if m < self.offset]
        meta = (self.offset, *(m for m, _ in kept))
        convs = mx.stack([self.conv, *(s[0] for _, s in kept)])
        states = mx.stack([self.recurrent, *(s[1] for _, s in kept)])
        return meta, convs, states

    @classmethod
    def from_file(cls, convs: Array, states: Array, meta: Sequence[int], tokens: int,
                  like: RecurrentCache) -> RecurrentCache:
        """A cache from a prompt cache file's arrays (see `file_state`), checked against `like` (a
        cache the model has written one token into): the same batch, window, channels, heads and
        dtypes, one array per kept state, the kept states before the tokens seen, in order."""
        meta = tuple(meta)
        if not meta or meta[0] != tokens:
            raise RecurrentCacheError(f"recurrent cache state {meta} for {tokens} tokens")
        kept = meta[1:]
        if any(not 0 < m < tokens for m in kept) or list(kept) != sorted(set(kept)):
            raise RecurrentCacheError(f"kept states at {list(kept)} tokens do not precede {tokens} in order")
        assert like.conv is not None and like.recurrent is not None
        for name, got, want in (("conv window", convs, like.conv), ("state", states, like.recurrent)):
            shape = (len(meta), *want.shape)
            if tuple(got.shape) != shape or got.dtype != want.dtype:
                raise RecurrentCacheError(f"the {name} has shape {tuple(got.shape)} {got.dtype}; this model's are "
                                          f"{shape} {want.dtype} (one per kept state)")
        c = cls()
        c.offset, c.conv, c.recurrent = tokens, convs[0], states[0]
        for i, m in enumerate(kept, start=1):
            c._snapshots[m] = (convs[i], states[i])
        return c

    # ------------------------------------------------------------------ compiled decode
    def decode_buffers(self) -> tuple[Array, Array]:
        """The arrays a compiled decode step takes and returns in place of keys and values."""
        if self.conv is None or self.recurrent is None:
            raise RecurrentCacheError("the compiled decode needs a prefilled recurrent cache")
        return self.conv, self.recurrent

    def release_buffers(self) -> None:
        """Drop the references while a decode session owns the arrays (so MLX may write in place)."""
        self.conv = self.recurrent = None

    def take_back(self, conv: Array, recurrent: Array, offset: int) -> None:
        """The arrays after a compiled decode of `offset - self.offset` tokens (one-token steps:
        no snapshots)."""
        self.conv, self.recurrent, self.offset = conv, recurrent, offset


class StepRecurrentCache:
    """A recurrent cache inside a traced one-token step: `offset` is the position array, the
    arrays are the step's inputs and, after the forward, its outputs."""

    left_padding = None

    def __init__(self, conv: Array, recurrent: Array, pos: Array) -> None:
        self.conv, self.recurrent, self.offset = conv, recurrent, pos

    def token_mask(self, n: int) -> None:
        return None

    def update(self, conv: Array, recurrent: Array, n: int) -> None:
        self.conv, self.recurrent = conv, recurrent

    def make_mask(self, n: int, window_size: int | None = None) -> Mask:
        return None

    @property
    def state(self) -> tuple[Array, Array]:
        return self.conv, self.recurrent


def set_left_padding(caches: Sequence[Any], pads: Array) -> None:
    """Tell the recurrent caches of a left-padded batch how many pad tokens lead each row ([B]
    int32), before its prefill; attention layers get the padding through their masks."""
    for c in caches:
        if isinstance(c, RecurrentCache):
            c.left_padding = pads


__all__ = ["RecurrentCache", "RecurrentCacheError", "StepRecurrentCache", "set_left_padding", "MAX_SNAPSHOTS",
           "KIND"]

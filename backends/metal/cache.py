"""Key/value caches for incremental decoding, and the causal (+ sliding window) masks that go with them.

Every cache follows `Cache`: `offset` (tokens seen), `update_and_fetch(keys, values)` (append a chunk
of shape [B, kv_heads, S, head_dim], return the keys and values to attend to), `make_mask(n, window)`
(the mask for the next chunk of `n` queries, matching what `update_and_fetch` will return), `state`
(the arrays, for `mx.eval`), `trim(n)`, `is_trimmable()`, `nbytes`.

`KVCache` grows its buffers in steps of 256 tokens and writes chunks with slice updates (no
reallocation per token). `RotatingKVCache` keeps at most `max_size` tokens (plus the incoming chunk),
for sliding-window layers and for a `context_len` bound; its results and masks are those of mlx-lm's
RotatingKVCache, including multi-token chunks that overflow the window, so outputs match mlx-lm.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

import pymlxc.core as mx
from pymlxc.core import Array

_slice = mx.slice
_slice_update = mx.slice_update
_concat = mx.concatenate

Mask = Array | str | None
STEP = 256
# Tokens at the start of the context that a context-bounded cache never evicts (attention sinks).
CONTEXT_KEEP = 4


@runtime_checkable
class Cache(Protocol):
    offset: int

    def update_and_fetch(self, keys: Array, values: Array) -> tuple[Array, Array]: ...

    def make_mask(self, n: int, window_size: int | None = None) -> Mask: ...

    @property
    def state(self) -> tuple[Array, ...]: ...

    def is_trimmable(self) -> bool: ...

    def trim(self, n: int) -> int: ...

    @property
    def nbytes(self) -> int: ...


# ---------------------------------------------------------------------- masks

class LeftPaddedMask(Array):
    """The boolean mask [B, 1, L, S] of left-padded rows (`generate.left_padded_mask`, no window): causal,
    each row's keys from `starts[b]` on (int32 [B]), and each query itself. An Array for every consumer
    of masks; the CUDA prefill attention takes `starts` instead (its padded form). An operation on it
    gives a plain Array, which no longer claims that meaning."""

    __slots__ = ("starts",)

    def __init__(self, mask: Array, starts: Array) -> None:
        super().__init__(mask)  # a new handle to the same MLX array
        self.starts = starts


def create_causal_mask(n: int, offset: int = 0, window_size: int | None = None) -> Array:
    """Boolean [n, offset + n]: query i (at position offset + i) sees key j when j <= offset + i and,
    with a window, offset + i - j < window_size."""
    rinds = mx.arange(offset + n)
    linds = mx.arange(offset, offset + n) if offset else rinds
    linds = mx.expand_dims(linds, 1)
    rinds = mx.expand_dims(rinds, 0)
    mask = linds >= rinds
    if window_size is not None:
        mask = mask & (linds < rinds + window_size)
    return mask


def make_prompt_mask(n: int, cache: Cache | None = None, window_size: int | None = None) -> Mask:
    """The attention mask for a chunk of `n` tokens: None (one token, nothing to hide), "causal"
    (the fused kernel's own causal mask), or a boolean array when a sliding window cuts in."""
    if cache is not None:
        return cache.make_mask(n, window_size)
    if n == 1:
        return None
    if window_size is not None and n > window_size:
        return create_causal_mask(n, 0, window_size)
    return "causal"


# ---------------------------------------------------------------------- caches

def _first_slots(a: Array, length: int) -> Array:
    b, h, _, d = a.shape
    return _slice(a, [0, 0, 0, 0], [b, h, length, d], [1, 1, 1, 1])


def _filling(update: Array, at: int, length: int) -> Array:
    """`update` as written at slot `at` of a buffer of `length` slots. Where it fills the buffer, MLX
    hands the update itself back as the new buffer: a chunk arrives as a view of the model's
    [B, n, H, D] projection, so it is laid out head by head first (later writes keep a buffer's
    layout, and the attention reads each head's keys in a row)."""
    return mx.contiguous(update) if at == 0 and update.shape[2] == length else update


def _pad_slots(a: Array, length: int) -> Array:
    b, h, have, d = a.shape
    return _concat([a, mx.zeros((b, h, length - have, d), a.dtype)], axis=2)


class _KeyValueBuffers:
    """The key/value buffers both caches hold, and their release."""

    keys: Array | None
    values: Array | None

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None or self.values is None else self.keys.nbytes + self.values.nbytes

    def _held(self) -> tuple[Array, Array]:
        """The keys and values, which are set and released together: both exist past the first update."""
        if self.keys is None or self.values is None:
            raise RuntimeError(f"the {type(self).__name__} holds no keys and values (empty, or its buffers released)")
        return self.keys, self.values

    def snapshot(self) -> dict[str, object]:
        """The cache's state now (arrays are immutable: nothing is copied), for `restore`."""
        return dict(vars(self))

    def restore(self, snapshot: dict[str, object]) -> None:
        """Back to the state `snapshot` took (a step that failed half-way leaves no trace)."""
        vars(self).clear()
        vars(self).update(snapshot)

    def _free_buffers(self) -> None:
        for a in (self.keys, self.values):
            if a is not None:
                a.free()
        self.keys = self.values = None


class KVCache(_KeyValueBuffers):
    """An unbounded cache: buffers grow by `step` tokens, chunks are written in place."""

    step = STEP

    def __init__(self) -> None:
        self.keys: Array | None = None
        self.values: Array | None = None
        self.offset = 0
        self._capacity = 0

    def update_and_fetch(self, keys: Array, values: Array) -> tuple[Array, Array]:
        prev = self.offset
        b, h, s, dk = keys.shape
        end = prev + s
        if end > self._capacity:
            dv = values.shape[3]
            n_steps = (self.step + s - 1) // self.step
            new_k = mx.zeros((b, h, n_steps * self.step, dk), keys.dtype)
            new_v = mx.zeros((b, h, n_steps * self.step, dv), values.dtype)
            if self.keys is not None and self.values is not None:
                if prev < self._capacity:  # drop the unused tail before growing
                    self.keys = _slice(self.keys, [0, 0, 0, 0], [b, h, prev, dk], [1, 1, 1, 1])
                    self.values = _slice(self.values, [0, 0, 0, 0], [b, h, prev, dv], [1, 1, 1, 1])
                self.keys = _concat([self.keys, new_k], axis=2)
                self.values = _concat([self.values, new_v], axis=2)
            else:
                self.keys, self.values = new_k, new_v
            self._capacity = prev + n_steps * self.step
            self._dims = (b, h, dk, dv)
        _, _, dk, dv = self._dims
        held_k, held_v = self._held()
        keys, values = _filling(keys, prev, self._capacity), _filling(values, prev, self._capacity)
        self.keys = _slice_update(held_k, keys, [0, 0, prev, 0], [b, h, end, dk], [1, 1, 1, 1])
        self.values = _slice_update(held_v, values, [0, 0, prev, 0], [b, h, end, dv], [1, 1, 1, 1])
        self.offset = end
        if end < self._capacity:
            return (_slice(self.keys, [0, 0, 0, 0], [b, h, end, dk], [1, 1, 1, 1]),
                    _slice(self.values, [0, 0, 0, 0], [b, h, end, dv], [1, 1, 1, 1]))
        return self.keys, self.values

    def make_mask(self, n: int, window_size: int | None = None) -> Mask:
        if window_size is not None:
            return create_causal_mask(n, self.offset, window_size)
        return None if n == 1 else "causal"

    def key_positions(self, n: int) -> np.ndarray:
        """Positions of the keys the next `update_and_fetch` of `n` tokens returns, in order."""
        return np.arange(self.offset + n)

    @property
    def state(self) -> tuple[Array, ...]:
        return () if self.keys is None or self.values is None else (self.keys, self.values)

    @property
    def meta_state(self) -> tuple[int, ...]:
        return (self.offset,)

    @classmethod
    def from_state(cls, state: tuple[Array, ...], meta_state: tuple[int, ...]) -> KVCache:
        c = cls()
        (c.offset,) = meta_state
        if state:
            c.keys, c.values = state
            b, h, cap, dk = c.keys.shape
            c._capacity = cap
            c._dims = (b, h, dk, c.values.shape[3])
        return c

    def copy(self) -> KVCache:
        """An independent cache with the same contents (arrays are immutable: no data is copied)."""
        c = KVCache()
        c.__dict__.update(self.__dict__)
        return c

    def prefix(self, n: int) -> KVCache | None:
        """A copy holding only the first `n` tokens (for the prompt cache), or None when this cache
        holds fewer. Arrays are shared: updates of the copy write new arrays, never this cache's."""
        if self.keys is None or not 0 < n <= self.offset:
            return None
        c = self.copy()
        c.offset = n
        return c

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        self.offset -= n
        return n

    def size(self) -> int:
        return self.offset

    def free(self) -> None:
        """Release the buffers now; the cache is empty afterwards."""
        self._free_buffers()
        self.offset = self._capacity = 0

    # ------------------------------------------------------------------ the compiled decode's buffers
    def reserve(self, capacity: int) -> None:
        """Allocate `capacity` slots at the first update (when still empty), so that prefill writes
        straight into the buffer the compiled decode starts with (no copy); `unreserve` undoes it."""
        if self.keys is None:
            self.step = max(capacity, type(self).step)

    def unreserve(self) -> None:
        """Back to the class's growth step."""
        self.__dict__.pop("step", None)

    def decode_buffers(self, ring: int) -> tuple[Array, Array]:
        """The keys and values as a decode buffer of `ring` slots (slot = position; `ring` covers
        every position written), zeros past the tokens held."""
        k, v = self._held()
        length = k.shape[2]
        if length == ring:
            return k, v
        if length > ring:  # a restored cache with room to spare: keep the filled part
            return _first_slots(k, ring), _first_slots(v, ring)
        return _pad_slots(k, ring), _pad_slots(v, ring)

    def release_buffers(self) -> None:
        """Let go of the buffers while a decode session owns them (MLX writes in place only into an
        array nothing else holds); `take_back` returns them."""
        self.keys = self.values = None

    def take_back(self, keys: Array, values: Array, offset: int) -> None:
        """Hold the decode buffers `keys`, `values` (slot = position) with `offset` tokens."""
        self.keys, self.values, self.offset = keys, values, offset
        b, h, capacity, dk = keys.shape
        self._capacity = capacity
        self._dims = (b, h, dk, values.shape[3])


class RotatingKVCache(_KeyValueBuffers):
    """At most `max_size` tokens: once full, new tokens overwrite the oldest, except the first `keep`.

    One-token updates write in place into a ring buffer. A multi-token chunk that still fits (nothing
    evicted yet) is written in place too; otherwise the cache is put in temporal order, cut to its
    last `max_size - 1` tokens (plus `keep`) and the chunk appended, so every query of the chunk sees
    at least `max_size` tokens. This is mlx-lm's algorithm: results and masks agree with it.
    """

    step = STEP

    def __init__(self, max_size: int, keep: int = 0) -> None:
        if max_size < 1 or not 0 <= keep < max_size:
            raise ValueError(f"RotatingKVCache needs max_size >= 1 and 0 <= keep < max_size, got {max_size}, {keep}")
        self.max_size = max_size
        self.keep = keep
        self.keys: Array | None = None
        self.values: Array | None = None
        self.offset = 0
        self._idx = 0  # write position in the buffer / count of valid entries before it
        self._len = 0  # buffer length

    # ------------------------------------------------------------------ helpers
    # Shapes are kept as ints (batch, heads, key dim, value dim), so that no step asks an Array.
    def _cut(self, v: Array, start: int, stop: int, d: int) -> Array:
        return _slice(v, [0, 0, start, 0], [self._b, self._h, stop, d], [1, 1, 1, 1])

    def _trim_front(self, trim_size: int, v: Array, d: int, append: Array | None = None) -> Array:
        keep = self.keep
        parts = [self._cut(v, 0, keep, d), self._cut(v, trim_size + keep, self._len, d)] if trim_size > 0 else [v]
        if append is not None:
            parts.append(append)
        return _concat(parts, axis=2) if len(parts) > 1 else parts[0]

    def _temporal_order(self, v: Array, d: int) -> Array:
        if self._idx == self._len:
            return v
        if self._idx < self.offset:  # wrapped: [keep][oldest ... end][keep ... newest]
            return _concat([self._cut(v, 0, self.keep, d), self._cut(v, self._idx, self._len, d),
                            self._cut(v, self.keep, self._idx, d)], axis=2)
        return self._cut(v, 0, self._idx, d)

    def _set_dims(self, keys: Array, values: Array) -> None:
        self._b, self._h, _, self._dk = keys.shape
        self._dv = values.shape[3]

    # ------------------------------------------------------------------ updates
    def update_and_fetch(self, keys: Array, values: Array) -> tuple[Array, Array]:
        if self.keys is None:
            self._set_dims(keys, values)
        s = keys.shape[2]
        if s == 1:
            return self._update_in_place(keys, values)
        if self._idx == self.offset and self.offset + s <= self.max_size:
            return self._append_in_place(keys, values, s)
        return self._update_concat(keys, values, s)

    def _grow(self, keys: Array, values: Array, new_len: int) -> None:
        b, h, dk, dv = self._b, self._h, self._dk, self._dv
        if self.keys is not None and self.values is not None and self._idx < self._len:
            # Unwrapped buffer with an unused tail: keep the valid part only.
            self.keys = self._cut(self.keys, 0, self._idx, dk)
            self.values = self._cut(self.values, 0, self._idx, dv)
            self._len = self._idx
        extra = new_len - self._len
        new_k = mx.zeros((b, h, extra, dk), keys.dtype)
        new_v = mx.zeros((b, h, extra, dv), values.dtype)
        if self.keys is None or self.values is None:
            self.keys, self.values = new_k, new_v
        else:
            self.keys = _concat([self.keys, new_k], axis=2)
            self.values = _concat([self.values, new_v], axis=2)
        self._len = new_len

    def _write(self, keys: Array, values: Array, at: int, s: int) -> None:
        b, h = self._b, self._h
        held_k, held_v = self._held()
        keys, values = _filling(keys, at, self._len), _filling(values, at, self._len)
        self.keys = _slice_update(held_k, keys, [0, 0, at, 0], [b, h, at + s, self._dk], [1, 1, 1, 1])
        self.values = _slice_update(held_v, values, [0, 0, at, 0], [b, h, at + s, self._dv], [1, 1, 1, 1])

    def _valid(self) -> tuple[Array, Array]:
        k, v = self._held()
        if self.offset < self._len:
            return self._cut(k, 0, self.offset, self._dk), self._cut(v, 0, self.offset, self._dv)
        return k, v

    def _append_in_place(self, keys: Array, values: Array, s: int) -> tuple[Array, Array]:
        # Nothing evicted yet and the chunk fits: same contents as mlx-lm's concatenation, no copy.
        end = self.offset + s
        if end > self._len:
            self._grow(keys, values, min(self.max_size, (end + self.step - 1) // self.step * self.step))
        self._write(keys, values, self.offset, s)
        self.offset = self._idx = end
        return self._valid()

    def _update_concat(self, keys: Array, values: Array, s: int) -> tuple[Array, Array]:
        if self.keys is None or self.values is None:
            self.keys, self.values = _filling(keys, 0, s), _filling(values, 0, s)
            self._len = s
        else:
            self.keys = self._temporal_order(self.keys, self._dk)
            self.values = self._temporal_order(self.values, self._dv)
            if self._idx != self._len and self._idx >= self.offset:
                self._len = self._idx  # the unused tail was cut off
            self._idx = self._len
            # Keep max_size - 1 old tokens so that every query of the chunk sees max_size tokens.
            trim_size = self._idx - self.max_size + 1
            self.keys = self._trim_front(trim_size, self.keys, self._dk, keys)
            self.values = self._trim_front(trim_size, self.values, self._dv, values)
            self._len += s - max(trim_size, 0)
        self.offset += s
        self._idx = self._len
        return self.keys, self.values

    def _update_in_place(self, keys: Array, values: Array) -> tuple[Array, Array]:
        prev = self.offset
        if self.keys is None or (prev >= self._len and self._len < self.max_size):
            self._grow(keys, values, self._len + min(self.step, self.max_size - prev))
            self._idx = prev
        trim_size = self._len - self.max_size
        if trim_size > 0:  # after an overflowing chunk: drop the oldest, back to max_size
            held_k, held_v = self._held()
            self.keys = self._trim_front(trim_size, held_k, self._dk)
            self.values = self._trim_front(trim_size, held_v, self._dv)
            self._len = self.max_size
            self._idx = self.max_size
        if self._idx == self.max_size:
            self._idx = self.keep
        self._write(keys, values, self._idx, 1)
        self.offset += 1
        self._idx += 1
        return self._valid()

    # ------------------------------------------------------------------ masks
    def make_mask(self, n: int, window_size: int | None = None) -> Mask:
        if n > 1:
            # The cache bounds attention as a window does: a chunk never sees more than max_size.
            window_size = min(window_size, self.max_size) if window_size else self.max_size
            offset = min(self.max_size - 1, self.offset)
            if offset + n > window_size:
                return create_causal_mask(n, offset, window_size)
            return "causal"
        if window_size is None:
            return None
        # A one-token step sees the whole buffer; hide what is older than the window when the
        # buffer is longer than the window.
        if self.offset >= window_size and self.max_size > window_size:
            idx = self._idx
            if idx >= self.max_size:
                idx = 0
            mask_size = self.offset + 1 if self.offset < self.max_size else self.max_size
            mask = mx.arange(mask_size) >= (mask_size - window_size)
            return mx.roll(mask, idx + 1)
        return None

    def in_order(self) -> bool:
        """Whether the next update returns the keys of positions 0, 1, ... in order (nothing evicted,
        nothing rotated): then a caller's mask over all positions applies as it is."""
        return self.keys is None or (self._idx == self.offset and self.offset < self.max_size)

    def _slot_positions(self) -> np.ndarray:
        """The position held by each buffer slot now (-1: unused)."""
        out = np.full(self._len, -1, dtype=np.int64)
        off, idx, keep = self.offset, self._idx, self.keep
        if idx == off:  # nothing evicted: slots 0..off-1 in order
            out[:off] = np.arange(off)
            return out
        # Evicted: [keep head][newest up to idx][oldest from idx to the end]
        newest = off - (idx - keep)
        out[:keep] = np.arange(keep)
        out[keep:idx] = np.arange(newest, off)
        out[idx:] = np.arange(newest - (self._len - idx), newest)
        return out

    def key_positions(self, n: int) -> np.ndarray:
        """Positions of the keys that the next `update_and_fetch` of `n` tokens returns, in order
        (the same steps as the update, on positions instead of arrays). For explicit masks."""
        off, keep = self.offset, self.keep
        if self.in_order():
            return np.arange(off + n)
        slots, idx = self._slot_positions(), self._idx
        if n > 1:
            if idx != len(slots):
                slots = (np.concatenate([slots[:keep], slots[idx:], slots[keep:idx]]) if idx < off
                         else slots[:idx])
            trim_size = len(slots) - self.max_size + 1
            if trim_size > 0:
                slots = np.concatenate([slots[:keep], slots[trim_size + keep:]])
            return np.concatenate([slots, np.arange(off, off + n)])
        if off >= len(slots) and len(slots) < self.max_size:
            slots = np.concatenate([slots, np.full(min(self.step, self.max_size - off), -1)])
            idx = off
        if len(slots) > self.max_size:
            trim_size = len(slots) - self.max_size
            slots = np.concatenate([slots[:keep], slots[trim_size + keep:]])
            idx = self.max_size
        if idx == self.max_size:
            idx = keep
        slots = slots.copy()
        slots[idx] = off
        return slots[: off + 1] if off + 1 < len(slots) else slots

    # ------------------------------------------------------------------ protocol rest
    @property
    def state(self) -> tuple[Array, ...]:
        return () if self.keys is None or self.values is None else (self.keys, self.values)

    @property
    def meta_state(self) -> tuple[int, ...]:
        return (self.keep, self.max_size, self.offset, self._idx)

    @classmethod
    def from_state(cls, state: tuple[Array, ...], meta_state: tuple[int, ...]) -> RotatingKVCache:
        keep, max_size, offset, idx = meta_state
        c = cls(max_size, keep)
        c.offset, c._idx = offset, idx
        if state:
            c.keys, c.values = state
            c._len = c.keys.shape[2]
            c._set_dims(c.keys, c.values)
        return c

    def copy(self) -> RotatingKVCache:
        c = RotatingKVCache(self.max_size, self.keep)
        c.__dict__.update(self.__dict__)
        return c

    def prefix(self, n: int) -> RotatingKVCache | None:
        """A cache in the state this one had after its first `n` tokens, as far as any later update
        can tell, or None when that state is gone (for the prompt cache; arrays are shared).

        Without sinks (`keep == 0`) what a query attends to never depends on how the tokens were
        chunked, so the last `max_size` keys before `n` are all the state there is. With sinks, an
        evicting chunk sees the sinks while a fresh one does not, so only a state that never evicted
        (n <= max_size, every key since the start) is the same whatever came before.
        """
        if self.keys is None or not 0 < n <= self.offset or (self.keep and n > self.max_size):
            return None
        lo = max(0, n - self.max_size)
        if self._idx == self.offset:  # nothing evicted: slot i holds position i
            slots = np.arange(lo, n)
        else:
            held = self._slot_positions()
            found = np.nonzero((held >= lo) & (held < n))[0]
            if len(found) != n - lo:
                return None
            slots = found[np.argsort(held[found])]
        buffers = self._held()
        if len(slots) > 1 and not np.all(np.diff(slots) == 1):
            index = mx.array(slots.astype(np.int32))
            keys, values = mx.take(buffers[0], index, axis=2), mx.take(buffers[1], index, axis=2)
        else:
            start, stop = int(slots[0]), int(slots[-1]) + 1
            keys, values = (_slice(v, [0, 0, start, 0], [v.shape[0], v.shape[1], stop, v.shape[3]], [1, 1, 1, 1])
                            for v in buffers)
        return RotatingKVCache.from_state((keys, values), (self.keep, self.max_size, n, n - lo))

    def is_trimmable(self) -> bool:
        return self.offset < self.max_size

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        self.offset -= n
        self._idx -= n
        return n

    def size(self) -> int:
        return min(self.offset, self.max_size)

    def free(self) -> None:
        """Release the buffers now; the cache is empty afterwards."""
        self._free_buffers()
        self.offset = self._idx = self._len = 0

    # ------------------------------------------------------------------ the compiled decode's buffers
    def reserve(self, capacity: int) -> None:
        """Allocate up to `capacity` slots at the first update (when still empty; at most
        `max_size`), so that prefill writes into the buffer the compiled decode starts with."""
        if self.keys is None:
            self.step = max(capacity, type(self).step)

    def unreserve(self) -> None:
        """Back to the class's growth step."""
        self.__dict__.pop("step", None)

    def decode_buffers(self, ring: int) -> tuple[Array, Array]:
        """The keys and values as a ring of `ring` slots, position p in slot p % ring (every
        position the ring can hold must still be here: `keep` == 0 or nothing evicted)."""
        offset = self.offset
        k, v = self._held()
        if self._idx == offset and offset <= ring:  # in temporal order, nothing evicted: slot = position
            if self._len > ring:
                k, v = _first_slots(k, ring), _first_slots(v, ring)
            elif self._len < ring:
                k, v = _pad_slots(k, ring), _pad_slots(v, ring)
        else:  # pick, for every slot, the buffer entry holding its latest position
            where = {int(p): i for i, p in enumerate(self._slot_positions()) if p >= 0}
            index = np.zeros(ring, dtype=np.int32)
            for s in range(min(ring, offset)):
                index[s] = where[s + ring * ((offset - 1 - s) // ring)]
            idx = mx.array(index)
            # `take` gives a view ordered position by position, and the decode's every attention
            # read of it was strided (on a CPU, an attention over 1024 keys took twice as long):
            # laid out head by head, as the buffers above already are (`_filling`).
            k, v = mx.contiguous(mx.take(k, idx, axis=2)), mx.contiguous(mx.take(v, idx, axis=2))
        return k, v

    def release_buffers(self) -> None:
        """Let go of the buffers while a decode session owns them; `take_back` returns them."""
        self.keys = self.values = None

    def take_back(self, keys: Array, values: Array, offset: int) -> None:
        """Hold the ring `keys`, `values` (position p in slot p % ring) with `offset` tokens: this
        cache's own in-place layout, with the write index at offset % ring (in temporal order until
        full)."""
        ring = keys.shape[2]
        self.keys, self.values, self.offset = keys, values, offset
        self._len = ring
        self._idx = offset if offset < ring else offset % ring
        self._set_dims(keys, values)

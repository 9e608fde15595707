"""A one-layer attention model and its KV cache on pymlxc.core: enough to exercise the generation
loops (chunked prefill, cache offsets, padding masks) without the real architectures."""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

import pymlxc.core as mx


class FakeCache:
    def __init__(self) -> None:
        self.keys: mx.Array | None = None
        self.values: mx.Array | None = None
        self.offset = 0

    def update_and_fetch(self, keys: mx.Array, values: mx.Array) -> tuple[mx.Array, mx.Array]:
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            self.keys = mx.concatenate([self.keys, keys], axis=2)
            self.values = mx.concatenate([self.values, values], axis=2)
        self.offset += keys.shape[2]
        return self.keys, self.values

    @property
    def state(self) -> list[mx.Array]:
        return [a for a in (self.keys, self.values) if a is not None]


class FakeModel:
    """Embedding -> RoPE attention (2 heads) -> MLP -> head; random weights from `seed`."""

    def __init__(self, vocab: int = 64, dims: int = 32, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        w = lambda *shape: mx.array(rng.normal(0, 1 / math.sqrt(shape[0]), shape).astype(np.float32))  # noqa: E731
        self.vocab, self.dims, self.heads = vocab, dims, 2
        self.embed = mx.array(rng.normal(0, 1, (vocab, dims)).astype(np.float32))
        self.wq, self.wk, self.wv, self.wo = w(dims, dims), w(dims, dims), w(dims, dims), w(dims, dims)
        self.w1, self.w2 = w(dims, 4 * dims), w(4 * dims, dims)
        self.head = w(dims, vocab) * 4.0
        self.calls: list[tuple[int, int]] = []  # (batch, length) of every forward pass
        self.heads_on: list[int] = []  # positions the head ran on, per forward pass
        self.layers = [object()]

    def make_cache(self, context_len: int = 0) -> list[FakeCache]:
        return [FakeCache()]

    def __call__(self, inputs: mx.Array, cache: Sequence[Any] | None = None, mask: Any = None, *,
                 last_only: bool = False) -> mx.Array:
        batch, length = inputs.shape
        self.calls.append((batch, length))
        self.heads_on.append(1 if last_only else length)
        hd = self.dims // self.heads
        x = mx.take(self.embed, inputs, axis=0)
        split = lambda t: mx.transpose(mx.reshape(t, (batch, length, self.heads, hd)), (0, 2, 1, 3))  # noqa: E731
        q, k, v = split(x @ self.wq), split(x @ self.wk), split(x @ self.wv)
        offset = cache[0].offset if cache else 0
        q = mx.fast.rope(q, hd, traditional=False, base=10000.0, scale=1.0, offset=offset)
        k = mx.fast.rope(k, hd, traditional=False, base=10000.0, scale=1.0, offset=offset)
        if cache:
            k, v = cache[0].update_and_fetch(k, v)
        if mask is None and length > 1:
            mask = "causal"
        o = mx.fast.scaled_dot_product_attention(q, k, v, scale=1 / math.sqrt(hd), mask=mask)
        h = x + mx.reshape(mx.transpose(o, (0, 2, 1, 3)), (batch, length, self.dims)) @ self.wo
        h = h + mx.maximum(h @ self.w1, 0.0) @ self.w2
        return self.output(h[:, -1:] if last_only else h)

    def output(self, h: mx.Array) -> mx.Array:
        return h @ self.head

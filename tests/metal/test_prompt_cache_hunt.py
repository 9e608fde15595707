"""`PromptCache.store` never loses an entry's own tokens: with rotating (sliding-window) caches an
old entry may hold a new one at its length yet not at the length of a shorter entry that the new
one could stand in for. That shorter entry used to be dropped before the new one was found to be
held already (and so not kept): its prompt then missed."""
from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pymlxc.core as mx
from pymlxc.backends.metal.cache import RotatingKVCache
from pymlxc.backends.metal.prompt_cache import PromptCache

TOKENS = list(range(10, 40))  # longer than any chunking below


def _fed(chunks: list[int], window: int) -> RotatingKVCache:
    """A sliding-window cache fed `chunks` tokens at a time (keys hold their position)."""
    cache = RotatingKVCache(window, 0)
    start = 0
    for n in chunks:
        pos = np.arange(start, start + n, dtype=np.float32)[None, None, :, None]
        cache.update_and_fetch(mx.array(pos), mx.array(-pos))
        start += n
    return cache


def _hits(cache: PromptCache, tokens: list[int]) -> list[int]:
    """The tokens restored for each prefix of `tokens` (0: a miss)."""
    return [found[1] if (found := cache.lookup(tokens[:n], n)) is not None else 0 for n in range(1, len(tokens) + 1)]


def test_an_entry_held_by_an_old_one_does_not_drop_a_shorter_one() -> None:
    cache = PromptCache(8, 1 << 30)
    assert cache.store(TOKENS[:3], [_fed([3], 4)])
    assert cache.store(TOKENS[:10], [_fed([6, 4], 4)])  # holds positions 3..9: restorable at 7..10 only
    before = _hits(cache, TOKENS[:10])
    assert before[2] == 3
    # Held by the 10-token entry at its length; it could stand in for the 3-token one, but is not kept.
    assert not cache.store(TOKENS[:8], [_fed([8], 4)])
    assert [n for n, _ in cache.entries()] == [3, 10]
    assert _hits(cache, TOKENS[:10]) == before


chunkings = st.lists(st.integers(1, 6), min_size=1, max_size=4)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(window=st.integers(2, 6), stores=st.lists(chunkings, min_size=1, max_size=5))
def test_an_entrys_tokens_stay_a_full_hit(window: int, stores: list[list[int]]) -> None:
    """After each store (a prefix of one token string, fed in random chunks), the tokens of every
    entry before it, and the stored ones, are still restored whole (the bounds are far away: no
    eviction). An entry may give way only to one that restores its length."""
    cache = PromptCache(64, 1 << 30)
    for chunks in stores:
        n = sum(chunks)
        wanted = {length for length, _ in cache.entries()} | {n}
        cache.store(TOKENS[:n], [_fed(chunks, window)])
        hits = _hits(cache, TOKENS)
        assert all(hits[length - 1] == length for length in wanted), (sorted(wanted), hits)

"""KVCache / RotatingKVCache against a plain numpy reference (which positions each update returns)
and against mlx-lm's caches (the exact arrays and masks), over random chunk sizes and trims."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pymlxc.core as mx
from pymlxc.backends.metal.cache import Cache, KVCache, RotatingKVCache, create_causal_mask, make_prompt_mask

mlx = pytest.importorskip("mlx.core")
mlx_cache = pytest.importorskip("mlx_lm.models.cache")

B, H, D = 1, 2, 3

# A chunk of tokens at positions [start, start + n): keys encode the position, values its negative,
# so that the returned arrays say which positions they hold.


def chunk(start: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    pos = np.arange(start, start + n, dtype=np.float32)
    k = np.broadcast_to(pos[None, None, :, None] + np.arange(D, dtype=np.float32) / 8, (B, H, n, D)).copy()
    return k, -k


def positions_of(keys: np.ndarray) -> np.ndarray:
    return np.rint(keys[0, 0, :, 0]).astype(int)


ops = st.lists(st.one_of(st.tuples(st.just("update"), st.integers(1, 12)),
                         st.tuples(st.just("update"), st.just(1)),
                         st.tuples(st.just("trim"), st.integers(0, 6))), min_size=1, max_size=25)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops)
def test_kv_cache_matches_reference(ops: list[tuple[str, int]]) -> None:
    cache = KVCache()
    ref: list[int] = []  # positions held, in order
    ref_cache = mlx_cache.KVCache()
    for op, n in ops:
        if op == "trim":
            assert cache.is_trimmable()
            assert cache.trim(n) == ref_cache.trim(n) == min(n, len(ref))
            del ref[len(ref) - min(n, len(ref)):]
            assert cache.offset == len(ref)
            continue
        start = cache.offset
        k, v = chunk(start, n)
        mask = cache.make_mask(n)
        assert mask == (None if n == 1 else "causal")
        keys, values = cache.update_and_fetch(mx.array(k), mx.array(v))
        ref.extend(range(start, start + n))
        keys, values = np.asarray(keys), np.asarray(values)
        assert keys.shape == (B, H, len(ref), D)
        np.testing.assert_array_equal(positions_of(keys), ref)
        np.testing.assert_array_equal(values, -keys)
        rk, _ = ref_cache.update_and_fetch(mlx.array(k), mlx.array(v))
        np.testing.assert_array_equal(keys, np.array(rk))
        assert cache.offset == len(ref)
        assert cache.nbytes == 2 * B * H * D * 4 * cache.keys.shape[2]
        assert cache.keys.shape[2] % KVCache.step == 0


def reference_positions(offset: int, n: int, max_size: int, keep: int) -> list[int]:
    """Which positions a rotating cache returns for an update of n tokens after `offset`, for a
    cache that has only been appended to (no trims): the first `keep` and the most recent ones, with
    at most max_size tokens for one new token and max_size - 1 old ones plus the chunk for more."""
    if n == 1:
        if offset + 1 <= max_size:
            return list(range(offset + 1))
        return list(range(keep)) + list(range(offset + 1 - (max_size - keep), offset + 1))
    if offset <= max_size - 1:
        return list(range(offset + n))
    return list(range(keep)) + list(range(offset - (max_size - 1 - keep), offset + n))


rot_params = st.integers(2, 20).flatmap(lambda m: st.tuples(st.just(m), st.integers(0, min(4, m - 1))))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(params=rot_params, ops=ops, window=st.one_of(st.none(), st.integers(1, 24)))
def test_rotating_cache_matches_reference_and_mlx_lm(params: tuple[int, int], ops: list[tuple[str, int]],
                                                      window: int | None) -> None:
    max_size, keep = params
    cache = RotatingKVCache(max_size, keep)
    ref_cache = mlx_cache.RotatingKVCache(max_size=max_size, keep=keep)
    trimmed = False
    for op, n in ops:
        if op == "trim":
            assert cache.is_trimmable() == ref_cache.is_trimmable()
            if cache.is_trimmable():
                assert cache.trim(n) == ref_cache.trim(n)
                trimmed = trimmed or n > 0
            continue
        start = cache.offset
        k, v = chunk(start, n)
        # The mask for the chunk: as mlx-lm's (same window rule), and shaped for the returned keys.
        mask = cache.make_mask(n, window)
        ref_mask = ref_cache.make_mask(n, window_size=window and min(window, max_size) if n > 1 else window)
        expected_positions = cache.key_positions(n)
        keys, values = cache.update_and_fetch(mx.array(k), mx.array(v))
        rk, rv = ref_cache.update_and_fetch(mlx.array(k), mlx.array(v))
        keys, values = np.asarray(keys), np.asarray(values)
        np.testing.assert_array_equal(keys, np.array(rk))
        np.testing.assert_array_equal(values, np.array(rv))
        got = positions_of(keys)
        np.testing.assert_array_equal(got, expected_positions)
        if not trimmed:
            assert sorted(got) == reference_positions(start, n, max_size, keep)
        if n > 1:
            assert list(got) == sorted(got)  # a chunk's keys come back in temporal order
        if isinstance(mask, str) or mask is None:
            assert mask == ref_mask
        else:
            np.testing.assert_array_equal(np.asarray(mask), np.array(ref_mask))
            assert np.asarray(mask).shape[-1] == keys.shape[2]
        assert cache.offset == ref_cache.offset
        assert cache.size() == min(cache.offset, max_size)


def test_causal_mask_and_prompt_mask() -> None:
    m = np.asarray(create_causal_mask(3, 2))
    np.testing.assert_array_equal(m, np.tril(np.ones((3, 5), bool), k=2))
    w = np.asarray(create_causal_mask(4, 0, window_size=2))
    np.testing.assert_array_equal(w, np.tril(np.ones((4, 4), bool)) & np.triu(np.ones((4, 4), bool), k=-1))
    assert make_prompt_mask(1) is None
    assert make_prompt_mask(5) == "causal"
    assert np.asarray(make_prompt_mask(5, window_size=3)).shape == (5, 5)


def test_protocol_state_copy_and_free() -> None:
    for cache in (KVCache(), RotatingKVCache(8, keep=2)):
        assert isinstance(cache, Cache)
        assert cache.state == () and cache.nbytes == 0
        k, v = chunk(0, 5)
        cache.update_and_fetch(mx.array(k), mx.array(v))
        mx.eval(cache.state)
        twin = cache.copy()
        k, v = chunk(5, 1)
        cache.update_and_fetch(mx.array(k), mx.array(v))
        assert twin.offset == 5 and cache.offset == 6
        restored = type(cache).from_state(cache.state, cache.meta_state)
        k, v = chunk(6, 1)
        a = np.asarray(cache.update_and_fetch(mx.array(k), mx.array(v))[0])
        b = np.asarray(restored.update_and_fetch(mx.array(k), mx.array(v))[0])
        np.testing.assert_array_equal(a, b)
        cache.free()
        assert cache.offset == 0 and cache.state == ()


def test_rotating_cache_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError):
        RotatingKVCache(0)
    with pytest.raises(ValueError):
        RotatingKVCache(4, keep=4)


def _head_by_head(a: mx.Array) -> bool:
    """Whether a cache buffer [B, H, slots, D] (evaluated) holds each head's slots one after another,
    D values each: what the attention reads in a row (a slice of a longer buffer qualifies)."""
    from pymlxc.core._loader import lib  # noqa: PLC0415 - strides have no public accessor

    strides = lib.mlx_array_strides(a.handle)
    _, h, slots, d = a.shape
    return strides[3] == 1 and (slots == 1 or strides[2] == d) and (h == 1 or strides[1] >= slots * d)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(max_size=st.integers(2, 20), sizes=st.lists(st.integers(1, 12), min_size=1, max_size=8),
       extra=st.integers(0, 8))
def test_rotating_decode_buffers_hold_each_slots_latest_position_head_by_head(max_size: int, sizes: list[int],
                                                                               extra: int) -> None:
    """The ring a decode starts from: slot s holds the latest position p with p % ring == s, and the
    buffers are laid out head by head (a view ordered position by position made every attention
    read of the decode strided)."""
    cache = RotatingKVCache(max_size)
    for n in sizes:
        k, v = chunk(cache.offset, n)
        # As a model hands them over: views of [B, n, H, D] projections.
        cache.update_and_fetch(mx.swapaxes(mx.array(k.transpose(0, 2, 1, 3).copy()), 1, 2),
                               mx.swapaxes(mx.array(v.transpose(0, 2, 1, 3).copy()), 1, 2))
    offset = cache.offset
    ring = min(max_size, offset + extra) if offset <= max_size else max_size
    keys, values = cache.decode_buffers(ring)
    mx.eval(keys, values)
    assert keys.shape == (B, H, ring, D) and values.shape == (B, H, ring, D)
    assert _head_by_head(keys) and _head_by_head(values)
    held = min(ring, offset)
    want = [s + ring * ((offset - 1 - s) // ring) for s in range(held)]
    np.testing.assert_array_equal(positions_of(np.asarray(keys))[:held], want)
    np.testing.assert_array_equal(np.asarray(values)[:, :, :held], -np.asarray(keys)[:, :, :held])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(max_size=st.integers(2, 12), first=st.integers(1, 30), following=st.integers(0, 20))
def test_rotating_cache_buffers_stay_head_by_head(max_size: int, first: int, following: int) -> None:
    """A prompt longer than the cache (its first chunk held as is) and the tokens after it: the
    buffers the attention reads stay laid out head by head, whatever view the model handed over."""
    cache = RotatingKVCache(max_size)
    for start, n in [(0, first)] + [(first + i, 1) for i in range(following)]:
        k, v = chunk(start, n)
        keys, _ = cache.update_and_fetch(mx.swapaxes(mx.array(k.transpose(0, 2, 1, 3).copy()), 1, 2),
                                         mx.swapaxes(mx.array(v.transpose(0, 2, 1, 3).copy()), 1, 2))
        mx.eval(cache.keys, cache.values)
        assert _head_by_head(cache.keys) and _head_by_head(cache.values)
        assert sorted(positions_of(np.asarray(keys))) == reference_positions(start, n, max_size, 0)


@pytest.mark.parametrize("first", [KVCache.step, 2 * KVCache.step, KVCache.step - 1])
def test_kv_cache_buffers_stay_head_by_head(first: int) -> None:
    """A prompt that fills the cache's buffer exactly (the buffer is then the chunk itself) and the
    tokens after it: laid out head by head, as the attention reads them."""
    cache = KVCache()
    for start, n in [(0, first), (first, 1), (first + 1, 1)]:
        k, v = chunk(start, n)
        keys, _ = cache.update_and_fetch(mx.swapaxes(mx.array(k.transpose(0, 2, 1, 3).copy()), 1, 2),
                                         mx.swapaxes(mx.array(v.transpose(0, 2, 1, 3).copy()), 1, 2))
        mx.eval(cache.keys, cache.values)
        assert _head_by_head(cache.keys) and _head_by_head(cache.values)
        np.testing.assert_array_equal(positions_of(np.asarray(keys)), np.arange(start + n))

"""Sampler and logits-processor invariants, on random logits (hypothesis) against numpy."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import pymlxc.core as mx
from pymlxc.backends.metal.sample import (
    apply_min_p,
    apply_processors,
    apply_top_k,
    apply_top_p,
    greedy,
    make_logits_processors,
    make_repeat_penalty,
    make_sampler,
)

# Rounded to a coarse grid so that ties (the interesting case for every filter) actually occur.
logit_arrays = hnp.arrays(
    np.float32,
    st.tuples(st.integers(1, 3), st.integers(1, 40)),
    elements=st.integers(-40, 40).map(lambda v: v / 4.0),
)
SETTINGS = settings(max_examples=60, deadline=None)


def kept(filtered: mx.Array) -> np.ndarray:
    return np.isfinite(np.asarray(filtered))


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


@SETTINGS
@given(logit_arrays)
def test_greedy_is_argmax(logits: np.ndarray) -> None:
    out = greedy(mx.array(logits))
    assert out.dtype == mx.int32
    assert np.asarray(out).tolist() == np.argmax(logits, axis=-1).tolist()


@SETTINGS
@given(logit_arrays, st.integers(1, 50))
def test_top_k_keeps_at_most_k_of_the_largest(logits: np.ndarray, k: int) -> None:
    keep = kept(apply_top_k(mx.array(logits), k))
    for row, mask in zip(logits, keep, strict=True):
        assert mask.sum() == min(k, row.size)
        if not mask.all():
            assert row[mask].min() >= row[~mask].max()


@SETTINGS
@given(logit_arrays, st.floats(0.01, 0.99))
def test_top_p_keeps_the_argmax_and_enough_mass(logits: np.ndarray, top_p: float) -> None:
    keep = kept(apply_top_p(mx.array(logits), top_p))
    probs = softmax(logits)
    for row, mask, p in zip(logits, keep, probs, strict=True):
        assert mask[np.argmax(row)]
        assert p[mask].sum() >= top_p - 1e-5
        if not mask.all():
            assert row[mask].min() > row[~mask].max()  # a top set; equal logits stay together
            # Minimal: without the least likely kept logit, the mass would fall short of top_p.
            assert p[row > row[mask].min()].sum() < top_p + 1e-5


@SETTINGS
@given(logit_arrays, st.floats(0.01, 1.0))
def test_min_p_keeps_the_argmax_and_the_tokens_above_the_bar(logits: np.ndarray, min_p: float) -> None:
    keep = kept(apply_min_p(mx.array(logits), min_p))
    probs = softmax(logits.astype(np.float64))
    for row, mask, p in zip(logits, keep, probs, strict=True):
        assert mask[np.argmax(row)]
        ratio = p / p.max()
        clear = np.abs(np.log(ratio) - math.log(min_p)) > 1e-4  # leave float borderline cases out
        np.testing.assert_array_equal(mask[clear], (ratio >= min_p)[clear])


@SETTINGS
@given(logit_arrays, st.integers(0, 5), st.floats(0.0, 0.95), st.floats(0.0, 0.9), st.integers(0, 2**32))
def test_sampled_tokens_survive_every_filter(logits: np.ndarray, top_k: int, top_p: float, min_p: float,
                                             seed: int) -> None:
    x = mx.array(logits)
    allowed = kept(apply_min_p(apply_top_p(apply_top_k(x, top_k), top_p), min_p))
    sampler = make_sampler(0.8, top_k=top_k, top_p=top_p, min_p=min_p, key=seed)
    for _ in range(3):
        tokens = np.asarray(sampler(x))
        assert tokens.shape == (logits.shape[0],)
        assert all(allowed[b, t] for b, t in enumerate(tokens))


@SETTINGS
@given(logit_arrays, st.integers(0, 2**32), st.floats(0.1, 3.0))
def test_same_seed_same_tokens(logits: np.ndarray, seed: int, temperature: float) -> None:
    x = mx.array(logits)
    first = make_sampler(temperature, top_p=0.9, key=seed)
    second = make_sampler(temperature, top_p=0.9, key=mx.random.key(seed))
    assert [np.asarray(first(x)).tolist() for _ in range(4)] == [np.asarray(second(x)).tolist() for _ in range(4)]


def test_the_key_is_split_each_step_and_seeds_differ() -> None:
    x = mx.zeros((1, 1000))  # uniform: repeated draws with one key would repeat the token
    draws = [int(np.asarray(s)[0]) for s in map(lambda _: make_sampler(1.0, key=7)(x), range(2))]
    assert draws[0] == draws[1]
    sampler = make_sampler(1.0, key=7)
    assert len({int(np.asarray(sampler(x))[0]) for _ in range(8)}) > 1
    assert len({int(np.asarray(make_sampler(1.0, key=s)(x))[0]) for s in range(8)}) > 1


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_frequencies_follow_the_tempered_distribution(temperature: float) -> None:
    logits = np.array([1.0, 0.0, -1.0, 0.5], np.float32)
    rows = 4000
    tokens = np.asarray(make_sampler(temperature, key=1)(mx.array(np.tile(logits, (rows, 1)))))
    freq = np.bincount(tokens, minlength=4) / rows
    np.testing.assert_allclose(freq, softmax(logits / temperature), atol=0.03)


def test_temperature_zero_is_greedy_whatever_the_filters() -> None:
    assert make_sampler(0.0, top_k=3, top_p=0.5, min_p=0.2) is greedy


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_k=-1), dict(top_p=1.5), dict(min_p=-0.1)])
def test_bad_settings_raise(bad: dict) -> None:
    with pytest.raises(ValueError):
        make_sampler(**bad)


@SETTINGS
@given(logit_arrays.filter(lambda a: a.shape[1] >= 2), st.floats(0.5, 3.0), st.integers(1, 8), st.data())
def test_repeat_penalty_matches_llama_cpp(logits: np.ndarray, penalty: float, context: int, data) -> None:
    batch, vocab = logits.shape
    width = data.draw(st.integers(1, 12))
    history = data.draw(hnp.arrays(np.int32, (batch, width), elements=st.integers(0, vocab - 1)))
    process = make_repeat_penalty(penalty, context)  # (penalty 1 included: then nothing changes)
    out = np.asarray(apply_processors([process], mx.array(history), mx.array(logits)))
    want = logits.copy()
    for b in range(batch):
        for t in set(history[b, -context:].tolist()):
            v = logits[b, t]
            want[b, t] = v * penalty if v < 0 else v / penalty
    np.testing.assert_allclose(out, want, rtol=1e-6)


def test_penalty_one_is_no_processor() -> None:
    assert make_logits_processors(1.0) == []
    assert len(make_logits_processors(1.3, 8)) == 1
    with pytest.raises(ValueError):
        make_logits_processors(0.0)


def test_top_p_below_float32_resolution_keeps_the_argmax() -> None:
    # 1e-300 rounds to 0 in float32: the cut must still keep the most likely token (only it).
    logits = mx.array([[0.0, 2.0, 1.0], [0.0, 0.0, 0.0]])
    keep = kept(apply_top_p(logits, 1e-300))
    assert keep[0].tolist() == [False, True, False] and keep[1].all()

"""The generation loops on a one-layer fake model: chunked prefill, pipelining and classify (its
left-padded batches) must give the tokens of a plain full-sequence greedy decode."""
from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pymlxc.core as mx
from pymlxc.backends.metal import generate as loops
from pymlxc.backends.metal.sample import make_sampler
from pymlxc.model import GenerationCancelled

from .fakes import FakeModel

MODEL = FakeModel(vocab=64, seed=3)
prompts = st.lists(st.integers(0, 63), min_size=1, max_size=24)


def reference(prompt: list[int], n: int) -> list[int]:
    """Greedy without a cache: the whole sequence through the model at every step."""
    ids = list(prompt)
    for _ in range(n):
        logits = MODEL(mx.array([ids], dtype=mx.int32))
        ids.append(int(np.argmax(np.asarray(logits)[0, -1])))
    return ids[len(prompt):]


def run(prompt: list[int], n: int, **kw) -> list[int]:
    return list(loops.generate_ids(MODEL, prompt, cache=MODEL.make_cache(), sampler=make_sampler(0.0),
                                   max_tokens=n, **kw))


@settings(max_examples=15, deadline=None)
@given(prompts, st.integers(1, 9))
def test_chunked_prefill_and_cache_equal_full_recompute(prompt: list[int], step: int) -> None:
    assert run(prompt, 6, prefill_step=step) == reference(prompt, 6)


def test_prefill_feeds_chunks_of_step_and_logits_for_one_position() -> None:
    MODEL.calls.clear()
    MODEL.heads_on.clear()
    run(list(range(20)), 3, prefill_step=8)
    # 20 prompt tokens in chunks of 8, the first token sampled from the last chunk's last position,
    # then one token per step (2 steps, none beyond max_tokens).
    assert MODEL.calls == [(1, 8), (1, 8), (1, 4), (1, 1), (1, 1)]
    # The head runs on one position per forward pass (in prefill, on each chunk's last).
    assert MODEL.heads_on == [1, 1, 1, 1, 1]


def test_stop_ids_end_the_stream_and_are_not_yielded() -> None:
    tokens = reference([5, 6, 7], 8)
    stop = tokens[3]
    first = tokens.index(stop)
    assert run([5, 6, 7], 8, stop_ids=frozenset({stop})) == tokens[:first]


def test_max_tokens_zero_yields_nothing() -> None:
    cache = MODEL.make_cache()
    assert list(loops.generate_ids(MODEL, [1, 2, 3], cache=cache, sampler=make_sampler(0.0), max_tokens=0)) == []
    assert cache[0].offset == 3  # the whole prompt is prefilled all the same


@settings(max_examples=10, deadline=None)
@given(st.lists(prompts, min_size=1, max_size=5))
def test_classify_equals_first_generated_token(batch: list[list[int]]) -> None:
    ids, logits = loops.classify_ids(MODEL, batch, sampler=make_sampler(0.0), return_logits=True)
    assert ids == [reference(p, 1)[0] for p in batch]
    assert logits is not None and len(logits) == len(batch) and all(len(row) == 64 for row in logits)
    for p, row in zip(batch, logits, strict=True):
        full = np.asarray(MODEL(mx.array([p], dtype=mx.int32)))[0, -1]
        np.testing.assert_allclose(row, full, rtol=1e-4, atol=1e-4)


def test_padding_masks_never_leave_a_query_without_keys() -> None:
    pads = mx.array([0, 3, 5], dtype=mx.int32)
    mask = np.asarray(loops.left_padded_mask(pads, 0, 6))
    assert mask.shape == (3, 1, 6, 6) and mask.any(axis=-1).all()
    assert not mask[1, 0, 4, :3].any() and mask[1, 0, 4, 3:5].all()  # padding hidden, causal


def test_guard_cancels_between_tokens() -> None:
    event = threading.Event()
    got = []
    with pytest.raises(GenerationCancelled, match="cancelled"):
        for token in loops.generate_ids(MODEL, [1, 2], cache=MODEL.make_cache(), sampler=make_sampler(0.0),
                                        max_tokens=50, guard=loops.Guard.make(event, None)):
            got.append(token)
            if len(got) == 2:
                event.set()
    assert len(got) == 2


def test_timings_count_tokens() -> None:
    timings = loops.Timings()
    assert len(run([1, 2, 3], 4, timings=timings)) == 4
    m = timings.metrics()
    assert (m.prompt_tokens, m.generated_tokens) == (3, 4)
    assert m.total_duration >= m.prefill_duration > 0 and m.decode_tokens_per_sec > 0

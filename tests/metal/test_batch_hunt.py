"""Batch rows restored from the prompt cache decode as the same prompts decode alone without it.

A Gemma 3 row whose cached prefix reaches past the sliding window joins the batch holding fewer
keys than positions in its sliding layers (their first valid column is later than the full layers'
one). The compiled batch step took one first valid column per row for every layer; it was handed
the first layer's (a sliding one), so the full-attention layers masked out the row's first
positions: other log-probabilities, silently. Such a batch now hands the compiled step one first
valid column per attention layer (`Batch.layer_valid`).
"""
from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pymlxc
from pymlxc import settings as pymlxc_settings
from pymlxc.backends.metal.batching import Collector, Request, SamplingParams
from pymlxc.testing import write_tiny_model

WINDOW = 16  # the tiny Gemma 3's sliding window
Step = list[tuple[int, float]]  # each event's (token, log-probability)


@pytest.fixture(scope="module", params=["gemma3_text", "llama"])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any]]:
    """(a model with the prompt cache, the same without it), both on the compiled batch step."""
    path = write_tiny_model(tmp_path_factory.mktemp(request.param) / request.param, request.param, seed=7)
    with pymlxc_settings.override(batch_compile="1"):
        cached = pymlxc.load_model(str(path), backend="metal")
        plain = pymlxc.load_model(str(path), backend="metal", prompt_cache_entries=0)
    with cached, plain:
        yield cached, plain


def _together(model: Any, prompts: list[list[int]], max_tokens: int) -> list[Step]:
    """Each prompt's (token, log-probability) steps, all prompts queued at once."""
    params = SamplingParams(max_tokens=max_tokens, logprobs=1)
    collectors = [Collector() for _ in prompts]
    model.scheduler().submit_all([Request(p, params, c) for p, c in zip(prompts, collectors, strict=True)],
                                 bounded=False)
    for collector in collectors:
        assert collector.wait(120)
    return [[(e.token, e.logprob) for e in c.events if e.token is not None] for c in collectors]


def _assert_same(got: list[Step], want: list[Step]) -> None:
    for row, expected in zip(got, want, strict=True):
        assert [t for t, _ in row] == [t for t, _ in expected]
        np.testing.assert_allclose([lp for _, lp in row], [lp for _, lp in expected], atol=1e-3)


def test_a_row_cached_past_the_window_decodes_as_alone(pair: tuple[Any, Any]) -> None:
    cached, plain = pair
    rng = random.Random(1)
    prompt = [rng.randrange(3, 500) for _ in range(2 * WINDOW + 8)]
    assert cached.warm_prompt_cache(prompt[:WINDOW + 4]) == WINDOW + 4
    want = _together(plain, [prompt], 4)
    stats = cached._batch_step.stats  # noqa: SLF001 - the step's own counters
    before = dict(stats)
    _assert_same(_together(cached, [prompt], 4), want)
    # Every decode step after the first token ran compiled, per-layer columns or not.
    assert stats["compiled"] - before["compiled"] == 3 and stats["fallback"] == before["fallback"]


def _mixed_columns_batch(cached: Any, plain: Any, seed: int) -> None:
    """A row cached past the window beside one that is not (the layers' first valid columns differ
    in one row only) decode together as each decodes alone without the cache."""
    rng = random.Random(seed)
    base = [rng.randrange(3, 500) for _ in range(2 * WINDOW + 8)]
    other = [rng.randrange(3, 500) for _ in range(WINDOW // 2)]
    cached.warm_prompt_cache(base[:WINDOW + 6])
    want = [_together(plain, [p], 5)[0] for p in (base, other)]
    _assert_same(_together(cached, [base, other], 5), want)


def test_rows_of_different_layer_columns_share_the_compiled_step(pair: tuple[Any, Any]) -> None:
    cached, plain = pair
    stats = cached._batch_step.stats  # noqa: SLF001 - the step's own counters
    before = dict(stats)
    _mixed_columns_batch(cached, plain, 2)
    assert stats["compiled"] > before["compiled"] and stats["fallback"] == before["fallback"]


def test_rows_of_different_layer_columns_op_by_op(tmp_path: Any) -> None:
    """The same batch stepped op by op: each layer masks with its own rows' first valid columns
    (`Columns` keeps a mask per form of them, so the layers do not undo each other's)."""
    path = write_tiny_model(tmp_path / "gemma3_text", "gemma3_text", seed=7)
    with pymlxc_settings.override(batch_compile="0"):
        cached = pymlxc.load_model(str(path), backend="metal")
        plain = pymlxc.load_model(str(path), backend="metal", prompt_cache_entries=0)
    with cached, plain:
        _mixed_columns_batch(cached, plain, 3)
        assert cached._batch_step.stats["compiled"] == 0  # noqa: SLF001 - the step's own counters


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_batch_with_cached_prefixes_equals_one_by_one(pair: tuple[Any, Any], data: st.DataObject) -> None:
    """Prompts sharing random prefixes of one token string (longer than the window; prefixes of it
    warmed into the prompt cache) decode together as each decodes alone without the cache."""
    cached, plain = pair
    base = data.draw(st.lists(st.integers(3, 499), min_size=WINDOW + 2, max_size=3 * WINDOW), label="base")
    cuts = data.draw(st.lists(st.integers(1, len(base)), min_size=1, max_size=4), label="cuts")
    tails = data.draw(st.lists(st.lists(st.integers(3, 499), max_size=WINDOW), min_size=len(cuts),
                               max_size=len(cuts)), label="tails")
    prompts = [base[:cut] + tail for cut, tail in zip(cuts, tails, strict=True)]
    for cut in data.draw(st.lists(st.integers(1, len(base)), min_size=1, max_size=2), label="warmed"):
        cached.warm_prompt_cache(base[:cut])
    max_tokens = data.draw(st.integers(1, 6), label="max_tokens")
    want = [_together(plain, [p], max_tokens)[0] for p in prompts]
    _assert_same(_together(cached, prompts, max_tokens), want)


# ---------------------------------------------------------------------- one request's failure is its own

# A request whose emit raises after its first token (a client gone) or whose grammar's mask raises,
# beside three plain ones: the plain ones run to their max_tokens, the failing one ends alone, and
# the scheduler serves the next request. Before, the exception failed the whole batch with the other
# request's error, and where the emit raised again (as it did for every event) the requests after
# it in the batch never got an end: their callers waited forever. In a child process: a hang fails
# the test.
_ONE_FAILS = """
import pymlxc
from pymlxc.backends.metal.batching import Collector, Request, SamplingParams
from pymlxc.testing import write_tiny_model

class BadMask:
    def allowed(self):
        raise RuntimeError("mask failed")
    def advance(self, token):
        pass
    def done(self):
        return False

model = pymlxc.load_model(str(write_tiny_model({path!r}, "llama", seed=7)), backend="metal")
scheduler = model.scheduler()
calls = []
def gone(event):
    calls.append(event)
    if len(calls) > 1:
        raise RuntimeError("client gone")
params = SamplingParams(max_tokens=6)
bad = Collector()
failing = {{"emit": Request([5, 6, 7], params, gone), "mask": Request([5, 6, 7], params, bad, BadMask())}}[{how!r}]
good = [Collector() for _ in range(3)]
scheduler.submit_all([failing] + [Request([8, 9, 10 + i], params, c) for i, c in enumerate(good)], bounded=False)
finished = [c.wait(60) for c in good]
after = Collector()
scheduler.submit(Request([3, 4], SamplingParams(max_tokens=2), after))
report({{"finished": finished, "ends": [c.finish().finish if c.finish() else None for c in good],
        "tokens": [len(c.tokens()) for c in good], "after": [after.wait(60), len(after.tokens())],
        "bad": [e.finish for e in bad.events], "error": repr(bad.finish().error) if bad.finish() else None}})
model.close()
"""


@pytest.mark.parametrize("how", ["emit", "mask"])
def test_a_failing_request_fails_alone(tmp_path_factory: pytest.TempPathFactory, how: str) -> None:
    from reliability.subproc import run_case

    path = str(tmp_path_factory.mktemp("fails") / "llama")
    got = run_case(_ONE_FAILS.format(path=path, how=how), timeout=240)
    assert got["finished"] == [True, True, True]
    assert got["ends"] == ["length"] * 3 and got["tokens"] == [6] * 3
    assert got["after"] == [True, 2]
    if how == "mask":
        assert got["bad"] == ["error"] and "mask failed" in got["error"]

"""Prompts that arrive together are prefilled together (`Scheduler._prefill_group`): one
left-padded forward pass, each row at its own positions. Each row's first token's log-probabilities
equal those of its prompt prefilled alone, through sliding windows (Gemma 3's 16, prompts longer
than it), experts and Gated DeltaNet layers (Qwen 3.5: the padding kept out of their states); the
rows keep decoding as single generations do; their caches reach the prompt cache; a group that
cannot run falls back to one prompt at a time."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pymlxc
import pymlxc.core as mx
from pymlxc.backends.metal import batching
from pymlxc.backends.metal import generate as loops
from pymlxc.backends.metal.batching import Collector, Request, SamplingParams
from pymlxc.testing import write_tiny_model

TOP = 5


def _submit_together(scheduler: batching.Scheduler, prompts: list[list[int]],
                     params: SamplingParams) -> list[Collector]:
    """Queue every prompt at once (`submit_all`: the loop's next turn sees all), then wait for all."""
    collectors = [Collector() for _ in prompts]
    scheduler.submit_all([Request(prompt, params, collector) for prompt, collector in zip(prompts, collectors,
                                                                                          strict=True)], bounded=False)
    for collector in collectors:
        assert collector.wait(120)
    return collectors


def _first_top(collector: Collector) -> list[tuple[int, float]]:
    first = next(e for e in collector.events if e.token is not None)
    return list(first.top_logprobs)


def _alone(scheduler: batching.Scheduler, prompt: list[int], params: SamplingParams) -> Collector:
    (collector,) = _submit_together(scheduler, [prompt], params)
    return collector


@pytest.fixture(scope="module", params=["llama", "gemma3_text", "qwen3_moe", "qwen3_5"])
def tiny(request, tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp(request.param) / request.param, request.param, seed=7)


def test_batch_generate_queues_its_prompts_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """batch_generate hands its prompts to the loop in one step, so the loop prefills them as one
    group whenever its thread wakes: the ranks of a distributed model each run batch_generate and
    must run the same steps (before, a rank whose loop woke between two submissions prefilled the
    first prompt alone, and the ranks' collectives fell out of step)."""
    path = write_tiny_model(tmp_path / "m", "llama", seed=7)
    queued: list[int] = []
    groups: list[int] = []
    submit_all, prefill_group = batching.Scheduler.submit_all, batching.Scheduler._prefill_group

    def spy_submit(self: batching.Scheduler, requests, bounded: bool = True) -> None:
        queued.append(len(requests))
        submit_all(self, requests, bounded)

    def spy_group(self: batching.Scheduler, group) -> None:
        groups.append(len(group))
        prefill_group(self, group)

    monkeypatch.setattr(batching.Scheduler, "submit_all", spy_submit)
    monkeypatch.setattr(batching.Scheduler, "_prefill_group", spy_group)
    with pymlxc.load_model(path, backend="metal") as model:
        for _ in range(3):
            results = model.batch_generate(["one two", "three four five", "six"], max_tokens=3, temperature=0)
            assert all(r.error is None and len(r.tokens) == 3 for r in results)
    assert queued == [3, 3, 3] and groups == [3, 3, 3]


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lengths=st.lists(st.integers(1, 40), min_size=2, max_size=6), seed=st.integers(0, 1000))
def test_a_group_gives_each_row_its_prefill_alone(tiny: Path, lengths: list[int], seed: int) -> None:
    rng = np.random.default_rng(seed)
    prompts = [[int(t) for t in rng.integers(3, 200, n)] for n in lengths]
    params = SamplingParams(max_tokens=6, logprobs=TOP)
    with pymlxc.load_model(str(tiny), backend="metal", prompt_cache_entries=0) as model:
        scheduler = model.scheduler()
        together = _submit_together(scheduler, prompts, params)
        assert scheduler.grouped == len(prompts)
        for prompt, collector in zip(prompts, together, strict=True):
            alone = _alone(scheduler, prompt, params)
            got, want = _first_top(collector), _first_top(alone)
            np.testing.assert_allclose([lp for _, lp in got], [lp for _, lp in want], atol=1e-4)
            assert collector.tokens() == alone.tokens()
        assert scheduler.grouped == len(prompts)  # one at a time: no group


def test_grouped_rows_reach_the_prompt_cache_and_decode_as_single_generations(tmp_path: Path) -> None:
    path = write_tiny_model(tmp_path / "gemma3_text", "gemma3_text", seed=11)
    with pymlxc.load_model(str(path), backend="metal") as model:
        texts = ["Once upon a time there was a baker", "hi", "The coins in her drawer were counted twice over"]
        prompts = [model.encode(t) for t in texts]
        scheduler = model.scheduler()
        together = _submit_together(scheduler, prompts, SamplingParams(max_tokens=20))
        assert scheduler.grouped == len(prompts)
        assert len(model.prompt_cache) == len(prompts)
        for text, collector in zip(texts, together, strict=True):
            assert collector.tokens() == [t.id for t in model.generate(text, max_tokens=20)]
        # Prompts whose prefixes are cached (of different lengths, one longer than the other's
        # whole prompt) go together too, each on top of its prefix; a new prompt pads.
        longer = [prompts[0] + prompts[1], prompts[2] + prompts[1] + prompts[1], prompts[1][:1] + [5, 6]]
        params = SamplingParams(max_tokens=8, logprobs=TOP)
        again = _submit_together(scheduler, longer, params)
        assert scheduler.grouped == len(prompts) + len(longer)
        model.prompt_cache.clear()
        for prompt, collector in zip(longer, again, strict=True):
            alone = _alone(scheduler, prompt, params)
            np.testing.assert_allclose([lp for _, lp in _first_top(collector)], [lp for _, lp in _first_top(alone)],
                                       atol=1e-4)
            assert collector.tokens() == alone.tokens()


def test_a_group_that_cannot_run_is_prefilled_one_by_one(tmp_path: Path, monkeypatch) -> None:
    path = write_tiny_model(tmp_path / "llama", "llama", seed=13)
    real = batching.loops.prefill

    def refuse_groups(model, tokens, cache, **kw):
        if tokens.shape[0] > 1:
            raise MemoryError("no room for the group")
        return real(model, tokens, cache, **kw)

    monkeypatch.setattr(batching.loops, "prefill", refuse_groups)
    with pymlxc.load_model(str(path), backend="metal") as model:
        texts = ["Once upon a time", "The baker counted", "hi there"]
        scheduler = model.scheduler()
        got = _submit_together(scheduler, [model.encode(t) for t in texts], SamplingParams(max_tokens=10))
        assert scheduler.grouped == 0
        for text, collector in zip(texts, got, strict=True):
            assert collector.finish() is not None and collector.finish().finish == "length"
            assert collector.tokens() == [t.id for t in model.generate(text, max_tokens=10)]


@pytest.mark.parametrize("offset", [0, 3])
@pytest.mark.parametrize("window", [None, 2])
def test_prompt_mask_hides_padding_and_keeps_padded_queries_finite(offset: int, window: int | None) -> None:
    """The group's chunk mask (`left_padded_mask` with the batch's first valid columns): causal,
    within the window, no column before a row's first valid one, except a query's own."""
    valid = np.array([0, 3, 6])
    got = np.array(loops.left_padded_mask(mx.array(valid.astype(np.int32)), offset, 5, window).tolist())[:, 0]
    q = np.arange(offset, offset + 5)[:, None]
    k = np.arange(offset + 5)[None, :]
    causal = (k <= q) & ((k > q - window) if window else True)
    want = np.stack([causal & ((k >= v) | (k == q)) for v in valid])
    assert np.array_equal(got, want)
    assert got.any(axis=-1).all()  # every query sees at least itself


@pytest.mark.parametrize("bad", [-1, 512, 10**6])
def test_a_prompt_id_past_the_embedding_fails_its_request_alone(tmp_path: Path, bad: int) -> None:
    path = write_tiny_model(tmp_path / "llama", "llama", seed=3, vocab_size=512)
    with pymlxc.load_model(str(path), backend="metal") as model:
        good = model.encode("Once upon a time")
        scheduler = model.scheduler()
        wrong, right = _submit_together(scheduler, [[*good[:2], bad, *good[2:]], good], SamplingParams(max_tokens=6))
        end = wrong.finish()
        assert end is not None and end.finish == "error" and isinstance(end.error, ValueError)
        assert f"token id {bad} (position 2 of the prompt) is outside the model's vocabulary of 512" in str(end.error)
        assert wrong.tokens() == []
        # The other request of the same turn decodes as it would alone.
        assert right.tokens() == [t.id for t in model.generate("Once upon a time", max_tokens=6)]


def test_a_request_cancelled_while_queued_frees_its_place(tmp_path: Path) -> None:
    """A full queue whose waiting request is cancelled takes the next one (before, the cancelled
    request kept its place until a row freed, and new requests got QueueFull meanwhile), and the
    cancelled request ends with its "cancelled" event. The one row is held by a request whose
    event sink blocks the scheduler's thread at its second token, so the queue cannot move."""
    import threading

    path = write_tiny_model(tmp_path / "m", "llama", seed=7)
    with pymlxc.load_model(path, backend="metal") as model:
        scheduler = model.scheduler(max_batch=1, max_queue=1)
        first_token, release = threading.Event(), threading.Event()
        long = Collector()

        def blocking(event: batching.Event) -> None:
            long(event)
            if len(long.tokens()) == 2:  # a decode step's token: the row is in the batch
                first_token.set()
                release.wait(60)

        running = Request([1, 2, 3], SamplingParams(max_tokens=8), blocking)
        scheduler.submit(running)
        assert first_token.wait(60), "the first request never reached its second token"
        waiting, late = Collector(), Collector()
        queued = Request([4, 5], SamplingParams(max_tokens=4), waiting)
        scheduler.submit(queued)
        try:
            with pytest.raises(batching.QueueFull):
                scheduler.submit(Request([6], SamplingParams(max_tokens=4), Collector()))
            queued.cancel()
            scheduler.submit(Request([6, 7], SamplingParams(max_tokens=4), late))
            assert waiting.finished and waiting.finish() is not None
            assert waiting.finish().finish == "cancelled"
            assert scheduler.stats()["queued"] == 1
        finally:
            release.set()
        assert late.wait(60) and len(late.tokens()) == 4
        assert long.wait(60)

"""Decoding with the evaluation thread (PYMLXC_EVAL_THREAD=1; the default on GPUs) gives the tokens
of decoding without it: every decode path (whole-step graph, segments, uncompiled), sampling with
processors, batches, early stops, and a prompt-cache hit after a threaded generation."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import pymlxc
import pymlxc.core
from pymlxc import settings
from pymlxc.backends.metal import generate as loops
from pymlxc.backends.metal.decode.decoder import CompiledDecoder
from pymlxc.backends.metal.loader import LoadedModel, load_weights_and_config
from pymlxc.backends.metal.sample import greedy, make_logits_processors, make_sampler
from pymlxc.backends.metal.step_queue import StepQueue
from pymlxc.core import eval_thread
from pymlxc.testing import write_tiny_model

_loaded: dict[str, LoadedModel] = {}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("threaded")

    def get(arch: str) -> LoadedModel:
        if arch not in _loaded:
            _loaded[arch] = load_weights_and_config(write_tiny_model(root / arch, arch, num_layers=3))
        return _loaded[arch]

    yield get
    for m in _loaded.values():
        m.free()
    _loaded.clear()


def ids(n: int = 19, seed: int = 2) -> list[int]:
    return [int(i) for i in np.random.default_rng(seed).integers(16, 500, size=n)]


def generate(model: Any, prompt: list[int], mode: str | None, threaded: bool, monkeypatch: pytest.MonkeyPatch,
             steps: int = 20, decoder: CompiledDecoder | None = None, **kw: Any) -> list[int]:
    with settings.override(eval_thread="1" if threaded else "0"):
        return _generate(model, prompt, mode, steps, decoder, **kw)


def _generate(model: Any, prompt: list[int], mode: str | None, steps: int, decoder: CompiledDecoder | None,
              **kw: Any) -> list[int]:
    own = decoder is None and mode is not None
    decoder = CompiledDecoder(model, mode) if own else decoder
    kw.setdefault("sampler", greedy)
    try:
        return list(loops.generate_ids(model, prompt, cache=model.make_cache(None), max_tokens=steps,
                                       decoder=decoder, **kw))
    finally:
        if own:
            decoder.close()


@pytest.mark.parametrize("mode", ["graph", "segmented", None])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3_text"])
def test_threaded_tokens_equal_unthreaded(models, monkeypatch: pytest.MonkeyPatch, arch: str, mode: str | None) -> None:
    model = models(arch).model
    prompt = ids()
    worker = eval_thread.shared(pymlxc.core.default_device())
    submitted = []
    submit = worker.submit
    monkeypatch.setattr(worker, "submit", lambda arrays: submitted.append(len(arrays)) or submit(arrays))
    want = generate(model, prompt, mode, False, monkeypatch)
    assert submitted == []
    assert generate(model, prompt, mode, True, monkeypatch) == want
    # The thread did the scheduling: each of the 3 prefill layers and the chunk's end (with the
    # first token, sampled from the prefill's logits), then every later step.
    assert len(submitted) == 3 + 1 + 19
    assert generate(model, prompt, mode, True, monkeypatch) == want  # a second threaded run reuses the traces


@pytest.mark.parametrize("mode", ["graph", "segmented"])
def test_one_decoder_on_and_off_the_thread(models, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    """A decoder alternating between the thread's stream and the caller's: MLX keeps a trace per
    stream, so each gets its own: the step is traced twice, then never again."""
    model = models("llama").model
    prompt = ids(seed=7)
    decoder = CompiledDecoder(model, mode)
    try:
        runs = [generate(model, prompt, mode, threaded, monkeypatch, decoder=decoder)
                for threaded in (False, True, False, True)]
        traces = decoder.stats["traces"]
        assert runs[1:] == runs[:1] * 3
        assert generate(model, prompt, mode, True, monkeypatch, decoder=decoder) == runs[0]
        assert decoder.stats["traces"] == traces
        assert traces == 2
    finally:
        decoder.close()


@pytest.mark.parametrize("mode", ["graph", None])
def test_sampling_with_processors_threaded(models, monkeypatch: pytest.MonkeyPatch, mode: str | None) -> None:
    model = models("llama").model
    prompt = ids(seed=5)

    def run(threaded: bool) -> list[int]:
        return generate(model, prompt, mode, threaded, monkeypatch, sampler=make_sampler(0.9, top_k=30, key=11),
                        processors=make_logits_processors(repeat_penalty=1.3))

    assert run(True) == run(False)


@pytest.mark.parametrize("mode", ["graph", "segmented"])
def test_an_early_stop_leaves_caches_that_continue(models, switches, mode: str) -> None:
    """Breaking out after 5 tokens: the caches hold every step fed (one queued step included) and
    a generation continuing from them gives the tokens of a fresh one."""
    model = models("llama").model
    prompt = ids()
    switches(eval_thread="1")
    decoder = CompiledDecoder(model, mode)
    try:
        cache, sampled = model.make_cache(None), []
        stream = loops.generate_ids(model, prompt, cache=cache, sampler=greedy, max_tokens=20, decoder=decoder,
                                    sampled_ids=sampled)
        for i, _ in enumerate(stream):
            if i == 4:
                break
        stream.close()
        seen = (prompt + sampled)[: cache[0].offset]
        rest = ids(6, 9)
        fresh = list(loops.generate_ids(model, seen + rest, cache=model.make_cache(None), sampler=greedy,
                                        max_tokens=8, decoder=decoder))
        continued = list(loops.generate_ids(model, seen + rest, cache=cache, cached=len(seen), sampler=greedy,
                                            max_tokens=8, decoder=decoder))
        assert continued == fresh
    finally:
        decoder.close()


def test_textmodel_with_the_thread_and_the_prompt_cache(tmp_path: Path, switches) -> None:
    switches(eval_thread="1", decode="segmented")
    path = write_tiny_model(tmp_path / "m", "llama", num_layers=2)
    with pymlxc.load_model(str(path), backend="metal") as m, \
            pymlxc.load_model(str(path), backend="metal", prompt_cache_entries=0) as plain:
        for text in ("The baker walked", "The baker walked to the river"):
            got = [t.id for t in m.generate(text, max_tokens=10)]
            assert m.err() is None
            assert got == [t.id for t in plain.generate(text, max_tokens=10)]
        assert m.metrics().prompt_cache_hits == 1  # the second prompt continues the first's state


@pytest.mark.parametrize("lookahead", [1, 2, 3])
def test_pipeline_queues_lookahead_steps_ahead_of_the_reader(lookahead: int) -> None:
    """Step n > 0 is read only once steps up to n + lookahead are built (fewer at the end); the
    first step is read as soon as it is built; each step is built from the previous step's lazy
    tokens; stopping early builds nothing more."""
    queue = StepQueue(threaded=True)
    built: list[int] = []

    def first() -> Any:
        built.append(0)
        return pymlxc.core.array([1], dtype=pymlxc.core.int32)

    def following(tokens: Any) -> Any:
        built.append(len(built))
        return tokens * 2

    stream = queue.pipeline(first, following, 6, lookahead)
    seen = []
    for n, shown in enumerate(stream):
        assert len(built) == min(n + (lookahead if n else 0) + 1, 6)
        seen.append(shown.item())
        if n == 3:
            break
    stream.close()
    queue.drain()
    assert seen == [1, 2, 4, 8]
    assert len(built) == min(3 + lookahead + 1, 6)


@pytest.mark.parametrize("threaded", [False, True])
@pytest.mark.parametrize("lead", [1, 2, 3])
def test_layer_lead_waits_for_the_layer_lead_layers_back(threaded: bool, lead: int, monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """After layer i is handed over, the host has waited for layers up to i - lead and no later one,
    the waits in the order of the layers; the values come out as built."""
    queue = StepQueue(threaded=threaded)
    submitted: list[Any] = []
    waited: list[Any] = []
    real_submit, real_ready = queue.submit, queue.ready
    monkeypatch.setattr(queue, "submit", lambda arrays: submitted.append(real_submit(arrays)) or submitted[-1])
    monkeypatch.setattr(queue, "ready", lambda handle: (waited.append(handle), real_ready(handle))[-1])
    layer_lead = loops.LayerLead(queue, lead)
    mx = pymlxc.core
    h = mx.zeros((1, 3, 4))
    queue.hand_over([h])  # built on this thread's stream, as a prompt's tokens are
    outputs = []
    for i in range(6):
        with queue.building():
            h = h + 1.0
            layer_lead.on_layer(h, None)
        outputs.append(h)
        assert waited == submitted[:max(0, i + 1 - lead)]
    queue.drain()
    assert [float(o[0, -1, 0].item()) for o in outputs] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]


@pytest.mark.parametrize("threaded", [False, True])
def test_a_long_prompt_gives_the_buffer_cache_back_after_the_first_token(models, monkeypatch: pytest.MonkeyPatch,
                                                                         threaded: bool) -> None:
    """A prompt of at least CLEAR_CACHE_PROMPT_TOKENS new tokens empties MLX's buffer cache once, after
    the first token is out and before any decode step; shorter prompts, and the part a prompt
    cache already holds, do not count, and the tokens do not change."""
    model = models("llama").model
    prompt = ids(40)
    baseline = generate(model, prompt, "segmented", threaded, monkeypatch, steps=6)
    events: list[tuple[str, int]] = []
    real_clear = pymlxc.core.clear_cache

    def clear() -> None:
        events.append(("clear", pymlxc.core.get_cache_memory()))
        real_clear()
        assert pymlxc.core.get_cache_memory() == 0

    monkeypatch.setattr(loops.mx, "clear_cache", clear)
    monkeypatch.setattr(loops, "CLEAR_CACHE_PROMPT_TOKENS", 32)

    def tokens(prompt: list[int], cached: int = 0, cache: Any = None) -> list[int]:
        out = []
        with settings.override(eval_thread="1" if threaded else "0"):
            for token in loops.generate_ids(model, prompt, cache=cache if cache is not None else model.make_cache(None),
                                            cached=cached, sampler=greedy, max_tokens=6):
                events.append(("token", token))
                out.append(token)
        return out

    assert tokens(prompt) == baseline
    assert [e[0] for e in events] == ["token", "clear"] + ["token"] * 5
    assert events[1][1] > 0  # the prefill's freed temporaries were there to give back
    events.clear()
    tokens(prompt[:31])
    assert "clear" not in [e[0] for e in events]
    cache = model.make_cache(None)
    list(loops.generate_ids(model, prompt[:20], cache=cache, sampler=greedy, max_tokens=0))
    events.clear()
    tokens(prompt, cached=20, cache=cache)  # 20 new tokens: under the threshold
    assert "clear" not in [e[0] for e in events]


def test_prefill_lead_is_one_layer_where_dense_copies_would_pass_the_budget(models) -> None:
    """mark_dense_products records a block's dense copies (two bytes a weight of its quantized
    linears); the lead drops to one layer only for chunks that go dense and whose copies over
    PREFILL_LEAD_LAYERS + 1 layers pass PREFILL_DENSE_BYTES."""
    from pymlxc.backends.metal import nn
    from pymlxc.testing import write_tiny_model as write

    budget, layers = loops.PREFILL_DENSE_BYTES, loops.PREFILL_LEAD_LAYERS + 1

    class Model:
        dense_rows = 512
        dense_block_bytes = budget // layers + 1

    model = Model()
    assert loops.prefill_lead(model, 2048) == 1
    assert loops.prefill_lead(model, 511) == loops.PREFILL_LEAD_LAYERS
    model.dense_block_bytes = budget // layers
    assert loops.prefill_lead(model, 2048) == loops.PREFILL_LEAD_LAYERS
    model.dense_rows = 0
    model.dense_block_bytes = budget
    assert loops.prefill_lead(model, 2048) == loops.PREFILL_LEAD_LAYERS
    # The largest chunk counts: after a prompt-cache hit the first one may be short.
    assert loops._largest_chunk(4096, 2000, 2048) == 2048  # noqa: SLF001 - chunks 48, 2048
    assert loops._largest_chunk(2100, 2000, 2048) == 52  # noqa: SLF001 - chunks 48, 52
    assert loops._largest_chunk(600, 0, 2048) == 600  # noqa: SLF001

    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        loaded = load_weights_and_config(write(Path(tmp) / "q", "llama", num_layers=3, quantize_bits=4))
        try:
            lm = loaded.model
            nn.mark_dense_products(lm, True)
            dense = [pymlxc.core.dequantize(m.weight, m.scales, m.biases, group_size=m.group_size, bits=m.bits)
                     for m in nn.quantized_layers(lm) if isinstance(m, nn.QuantizedLinear)]
            weights = sum(w.size for w in dense)
            assert weights > 0
            assert lm.dense_block_bytes == 2 * weights // len(lm.layers)
            nn.mark_dense_products(lm, False)
            assert lm.dense_block_bytes == 0 and loops.prefill_lead(lm, 4096) == loops.PREFILL_LEAD_LAYERS
            assert nn.dequantized_block_bytes(lm) == 2 * weights // len(lm.layers)
        finally:
            loaded.free()


def test_prefill_lead_counts_the_compiled_prefills_dequantized_copies(models, monkeypatch) -> None:
    """A prefill runner that dequantizes its products holds a block's dense copies
    (`PrefillRunner.dense_block_bytes`) for the chunks it takes: the lead drops to one layer where
    they pass the budget over PREFILL_LEAD_LAYERS + 1 layers, as for the op-by-op dense products."""

    class Runner:
        dense_block_bytes = 1000

        def takes_rows(self, rows: int) -> bool:
            return 8 < rows < 512

    class Model:  # no op-by-op dense products
        dense_rows = 0
        dense_block_bytes = 0

    runner, model = Runner(), Model()
    monkeypatch.setattr(loops, "PREFILL_DENSE_BYTES", (loops.PREFILL_LEAD_LAYERS + 1) * 1000 - 1)
    assert loops.prefill_lead(model, 128, runner) == 1
    assert loops.prefill_lead(model, 128) == loops.PREFILL_LEAD_LAYERS  # no runner: MLX's products
    assert loops.prefill_lead(model, 4, runner) == loops.PREFILL_LEAD_LAYERS  # not the runner's chunk
    runner.dense_block_bytes = 0  # MLX's quantized products
    assert loops.prefill_lead(model, 128, runner) == loops.PREFILL_LEAD_LAYERS
    runner.dense_block_bytes = 1000
    monkeypatch.setattr(loops, "PREFILL_DENSE_BYTES", (loops.PREFILL_LEAD_LAYERS + 1) * 1000)
    assert loops.prefill_lead(model, 128, runner) == loops.PREFILL_LEAD_LAYERS

"""End to end on tiny random checkpoints: the metal backend's TextModel against mlx-lm and itself."""
from __future__ import annotations

import gc
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

import pymlxc
import pymlxc.core as mx
from pymlxc import ContextLengthError, GenerationCancelled, ModelClosedError
from pymlxc.testing import write_tiny_model

ARCHS = ("llama", "qwen3")
PROMPTS = ["Once upon a time", "The baker counted the coins in her drawer before she locked the door.", "hi"]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: write_tiny_model(root / arch, arch, seed=1) for arch in ARCHS}


@pytest.fixture(scope="module", params=ARCHS)
def arch(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def model(model_dirs: dict[str, Path], arch: str):
    with pymlxc.load_model(str(model_dirs[arch]), backend="metal", parallel_slots=2) as m:
        yield m


def ids(tokens) -> list[int]:
    return [t.id for t in tokens]


def mlx_lm_greedy(path: Path, prompt_ids: list[int], n: int) -> list[int]:
    import mlx.core as mlx_core
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    lm, _ = load(str(path))
    out = []
    for token, _ in generate_step(mlx_core.array(prompt_ids), lm, max_tokens=n):
        out.append(int(token))
    return out


# ---------------------------------------------------------------------- parity and consistency

def test_greedy_tokens_equal_mlx_lm(model, model_dirs, arch) -> None:
    prompt = PROMPTS[0]
    ours = ids(model.generate(prompt, max_tokens=32))
    assert model.err() is None
    assert len(ours) == 32  # the tiny models' special tokens are muted: no early EOS
    assert ours == mlx_lm_greedy(model_dirs[arch], model.encode(prompt), 32)


def test_chat_equals_mlx_lm_on_the_chat_template(model, model_dirs, arch) -> None:
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is two plus two?"}]
    ours = ids(model.chat(messages, max_tokens=16))
    tokenizer = load_tokenizer(model_dirs[arch])
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert ours == mlx_lm_greedy(model_dirs[arch], list(prompt), 16)


def test_token_texts_concatenate_to_the_decoded_text(model) -> None:
    tokens = list(model.generate(PROMPTS[1], max_tokens=24))
    assert "".join(t.text for t in tokens) == model.decode(ids(tokens))


def test_classify_equals_first_generated_token(model) -> None:
    results = model.classify(PROMPTS, return_logits=True)
    firsts = [ids(model.generate(p, max_tokens=1))[0] for p in PROMPTS]
    assert [r.token.id for r in results] == firsts
    vocab = model.info().vocab_size
    for r in results:
        assert r.logits is not None and len(r.logits) == vocab
        assert int(np.argmax(r.logits)) == r.token.id
        assert r.token.text == model.decode([r.token.id])
    assert all(r.logits is None for r in model.classify(PROMPTS[:1]))


def test_batch_generate_equals_single_generations(model) -> None:
    batch = model.batch_generate(PROMPTS, max_tokens=20)
    assert [r.error for r in batch] == [None] * len(PROMPTS)
    for result, prompt in zip(batch, PROMPTS, strict=True):
        single = list(model.generate(prompt, max_tokens=20))
        assert ids(result.tokens) == ids(single)
        assert result.text == "".join(t.text for t in single)


def test_a_batch_row_the_context_cuts_short_says_so(model_dirs: dict[str, Path]) -> None:
    """With a context length, a batch row ends where prompt and tokens fill it (its caches do not
    rotate as a single generation's do): its result holds the single generation's first tokens and
    an error naming the context; a row that fits is untouched and err() stays clear. (The rows used
    to come back shorter, or empty, with no error.) A prompt past the context runs no row at all."""
    with pymlxc.load_model(str(model_dirs["llama"]), backend="metal", context_len=16) as m:
        short, long = "hi", "The baker counted the coins in her drawer before she locked the door."
        room = 16 - len(m.encode(short))
        with pytest.raises(ContextLengthError, match=r"^prompts item 1 has \d+ tokens, more than the context length"):
            m.batch_generate([short, long, short], max_tokens=room + 4)
        results = m.batch_generate([short, short], max_tokens=room + 4)
        fits = m.batch_generate([short], max_tokens=room)[0]
        single = ids(m.generate(short, max_tokens=room + 4))
        assert m.err() is None
        assert ids(results[0].tokens) == single[:room] and ids(results[1].tokens) == single[:room]
        assert results[0].error is not None and "context of 16 tokens (context_len)" in results[0].error
        assert fits.error is None and ids(fits.tokens) == single[:room]


def test_stop_tokens_end_generation(model) -> None:
    full = ids(model.generate(PROMPTS[0], max_tokens=12))
    stop = full[6]
    assert ids(model.generate(PROMPTS[0], max_tokens=12, stop_tokens=[stop])) == full[: full.index(stop)]


def test_eos_from_generation_config_ends_generation(model, model_dirs, arch, tmp_path) -> None:
    import json
    import shutil

    full = ids(model.generate(PROMPTS[0], max_tokens=12))
    eos = full[5]
    path = shutil.copytree(model_dirs[arch], tmp_path / arch)
    config = json.loads((path / "generation_config.json").read_text())
    config["eos_token_id"] = [eos]
    (path / "generation_config.json").write_text(json.dumps(config))
    with pymlxc.load_model(str(path), backend="metal") as m:
        assert ids(m.generate(PROMPTS[0], max_tokens=12)) == full[: full.index(eos)]
        assert m.err() is None


def test_seed_makes_sampling_reproducible(model) -> None:
    kw = dict(max_tokens=16, temperature=1.0, top_k=50, top_p=0.95, min_p=0.01)
    first = ids(model.generate(PROMPTS[0], seed=11, **kw))
    assert first == ids(model.generate(PROMPTS[0], seed=11, **kw))
    others = {tuple(ids(model.generate(PROMPTS[0], seed=s, **kw))) for s in range(12, 16)}
    assert len(others | {tuple(first)}) > 1


def test_repeat_penalty_changes_greedy_output(model) -> None:
    plain = ids(model.generate(PROMPTS[0], max_tokens=24))
    penalised = ids(model.generate(PROMPTS[0], max_tokens=24, repeat_penalty=5.0))
    assert len(set(penalised)) >= len(set(plain))
    assert penalised != plain or len(set(plain)) == len(plain)


def test_metrics_of_the_last_call(model) -> None:
    n_prompt = len(model.encode(PROMPTS[1]))
    list(model.generate(PROMPTS[1], max_tokens=9))
    m = model.metrics()
    assert (m.prompt_tokens, m.generated_tokens) == (n_prompt, 9)
    assert m.prefill_duration > 0 and m.decode_duration > 0 and m.total_duration >= m.prefill_duration
    assert m.prefill_tokens_per_sec > 0 and m.decode_tokens_per_sec > 0
    assert m.peak_memory_bytes >= m.active_memory_bytes > 0


def test_info(model, arch) -> None:
    info = model.info()
    assert (info.architecture, info.num_layers, info.hidden_size, info.vocab_size) == (arch, 2, 64, 512)
    assert model.model_type == arch and model.num_layers == 2


# ---------------------------------------------------------------------- stopping

def test_cancel_event_after_three_tokens(model) -> None:
    cancel = threading.Event()
    got = []
    for token in model.generate(PROMPTS[0], max_tokens=50, cancel=cancel):
        got.append(token)
        if len(got) == 3:
            cancel.set()
    assert len(got) == 3
    assert isinstance(model.err(), GenerationCancelled)
    list(model.generate(PROMPTS[0], max_tokens=2))
    assert model.err() is None  # reset by the next call


def test_timeout_stops_generation(model) -> None:
    got = list(model.generate(PROMPTS[1], max_tokens=200, timeout=1e-4))
    assert len(got) < 200
    assert isinstance(model.err(), GenerationCancelled) and "timed out" in str(model.err())


def test_scheduler_rows_leaving_and_joining_a_looked_ahead_batch(model) -> None:
    """Greedy rows run with the scheduler's look-ahead (step k+1 queued before step k's ids are read):
    rows that stop at different steps, and a row that joins while the others decode, each give the
    tokens of a single generation."""
    from pymlxc.backends.metal.batching import Collector, Request, SamplingParams

    scheduler = model.scheduler()
    lengths = [3, 9, 17, 6]
    texts = [*PROMPTS, "a late arrival"]
    prompts = [model.encode(p) for p in texts]
    jobs = [(Request(ids, SamplingParams(max_tokens=n), c := Collector()), c)
            for ids, n in zip(prompts[:3], lengths[:3], strict=True)]
    for request, _ in jobs:
        scheduler.submit(request)
    steps = scheduler.steps
    late = Request(prompts[3], SamplingParams(max_tokens=lengths[3]), late_collector := Collector())
    while scheduler.steps < steps + 2 and not jobs[2][1].finished:
        time.sleep(0.001)
    scheduler.submit(late)
    for _, collector in [*jobs, (late, late_collector)]:
        assert collector.wait(60)
    for (_, collector), text, n in zip([*jobs, (late, late_collector)], texts, lengths, strict=True):
        single = list(model.generate(text, max_tokens=n))
        assert collector.tokens() == ids(single)
        assert collector.finish() is not None and collector.finish().finish == "length"


def test_scheduler_greedy_rows_with_logit_bias_keep_the_look_ahead(model) -> None:
    """Greedy rows with a fixed logit bias decode on the batch's argmax (with the look-ahead): a row
    whose bias forces a token gives only it, a row that bans the tokens it would pick gives the
    per-row path's tokens (logprobs make that row go through it), and a row without a bias gives a
    single generation's tokens."""
    from pymlxc.backends.metal.batching import Collector, Request, SamplingParams

    scheduler = model.scheduler()
    text = PROMPTS[0]
    prompt = model.encode(text)
    free = ids(list(model.generate(text, max_tokens=8)))
    banned = tuple((t, -100.0) for t in sorted(set(free)))
    forced = ((free[0] + 1) % 50 + 5, 100.0)
    params = [SamplingParams(max_tokens=8), SamplingParams(max_tokens=8, logit_bias=(forced,)),
              SamplingParams(max_tokens=8, logit_bias=banned),
              SamplingParams(max_tokens=8, logit_bias=banned, logprobs=0)]
    jobs = [(Request(prompt, p, c := Collector()), c) for p in params]
    steps = scheduler.steps
    for request, _ in jobs[:3]:  # plain rows only: the look-ahead runs
        scheduler.submit(request)
    for _, collector in jobs[:3]:
        assert collector.wait(60)
    scheduler.submit(jobs[3][0])  # the per-row path, alone
    assert jobs[3][1].wait(60)
    got = [collector.tokens() for _, collector in jobs]
    assert got[0] == free
    assert got[1] == [forced[0]] * 8
    assert not set(got[2]) & set(free)
    assert got[2] == got[3]
    assert scheduler.steps > steps


BAD_SAMPLING = [
    # A NaN bias used to force its token (every logit NaN: argmax picks it), a NaN presence penalty
    # repeated the first token; the others failed the row mid-run with a TypeError of numpy or MLX.
    ({"logit_bias": ((5, float("nan")),)}, ValueError, r"^logit_bias\[0\]'s amount must be finite"),
    ({"presence_penalty": float("nan")}, ValueError, "^presence_penalty must be finite"),
    ({"frequency_penalty": float("inf")}, ValueError, "^frequency_penalty must be finite"),
    ({"logit_bias": {5: 1.0}}, TypeError, "^logit_bias must be a sequence of"),
    ({"logit_bias": ((-1, 1.0),)}, ValueError, r"^logit_bias\[0\]'s token id must be >= 0"),
    ({"logit_bias": (("5", 1.0),)}, TypeError, r"^logit_bias\[0\]'s token id must be an int"),
    ({"logit_bias": ((5,),)}, TypeError, r"^logit_bias\[0\] must be a \(token id, amount\) pair"),
    ({"stop_ids": "ab"}, TypeError, "^stop_ids must be a sequence of token ids"),
    ({"logprobs": 1.5}, TypeError, "^top_logprobs must be an int"),
]


@pytest.mark.parametrize("options, error, message", BAD_SAMPLING, ids=[next(iter(o)) + str(i) for i, (o, _, _)
                                                                        in enumerate(BAD_SAMPLING)])
def test_sampling_params_refuse_bad_values_naming_them(options, error, message) -> None:
    from pymlxc.backends.metal.batching import SamplingParams

    with pytest.raises(error, match=message):
        SamplingParams(**options)


def test_a_logit_bias_id_too_big_for_int32_fails_its_row_naming_the_vocabulary(model) -> None:
    from pymlxc.backends.metal.batching import Collector, Request, SamplingParams

    collector = Collector()
    model.scheduler().submit(Request(model.encode("hi"), SamplingParams(max_tokens=2, logit_bias=((2**40, 1.0),)),
                                     collector))
    assert collector.wait(60)
    end = collector.finish()
    assert end is not None and isinstance(end.error, ValueError)  # was numpy's OverflowError
    assert "outside the vocabulary" in str(end.error)


@pytest.mark.parametrize("options, error, message", [
    ({"max_batch": 0}, ValueError, "^max_batch must be >= 1, not 0"),  # was taken as "the default"
    ({"max_batch": -5}, ValueError, "^max_batch must be >= 1"),
    ({"max_batch": 1.5}, TypeError, "^max_batch must be an int"),
    ({"max_queue": -1}, ValueError, "^max_queue must be >= 0"),
    ({"max_queue": "x"}, TypeError, "^max_queue must be an int"),
])
def test_scheduler_options_are_checked_also_once_the_scheduler_exists(model, options, error, message) -> None:
    scheduler = model.scheduler()  # made already: the path that used to store any value
    before = (scheduler.max_batch, scheduler.max_queue)
    with pytest.raises(error, match=message):
        model.scheduler(**options)
    assert (scheduler.max_batch, scheduler.max_queue) == before
    assert len(model.batch_generate(["a", "b"], max_tokens=2)[1].tokens) == 2


def test_scheduler_warm_steps_each_batch_size_and_leaves_nothing_behind(model, monkeypatch) -> None:
    from pymlxc.backends.metal import batching

    scheduler = model.scheduler()
    sizes: list[int] = []
    real_add = batching.Batch.add

    def add(self, row, caches) -> None:
        real_add(self, row, caches)
        sizes.append(len(self))

    monkeypatch.setattr(batching.Batch, "add", add)
    scheduler.warm()  # what a server asks: no size off CUDA
    assert sizes == []
    scheduler.warm(3)
    assert sizes == [1, 2, 3]
    assert scheduler.running() == 0
    batch = model.batch_generate(PROMPTS, max_tokens=8)
    for result, prompt in zip(batch, PROMPTS, strict=True):
        assert ids(result.tokens) == ids(model.generate(prompt, max_tokens=8))


def test_compiled_batch_step_gives_the_tokens_of_single_generations(model_dirs: dict[str, Path], arch: str) -> None:
    """The continuous batch's compiled step (switched on here; by default on CUDA only): rows that
    join, leave and stop at different steps give a single generation's tokens, and the steps ran
    compiled, one trace per batch size."""
    from pymlxc import settings

    with settings.override(batch_compile="1"), \
            pymlxc.load_model(str(model_dirs[arch]), backend="metal") as compiled:
        lengths = [5, 12, 3]
        results = compiled.batch_generate(PROMPTS, max_tokens=12)
        stats = compiled._batch_step.stats  # noqa: SLF001 - the step's own counters
        assert stats["compiled"] > 0 and stats["fallback"] == 0
        assert stats["traces"] <= len(PROMPTS) * 2  # per batch size (and buffer size), not per step
        for result, prompt in zip(results, PROMPTS, strict=True):
            assert ids(result.tokens) == ids(compiled.generate(prompt, max_tokens=12))
        from pymlxc.backends.metal.batching import Collector, Request, SamplingParams

        scheduler = compiled.scheduler()
        jobs = [(Request(compiled.encode(p), SamplingParams(max_tokens=n), c := Collector()), c)
                for p, n in zip(PROMPTS, lengths, strict=True)]
        for request, _ in jobs:
            scheduler.submit(request)
        for (_, collector), prompt, n in zip(jobs, PROMPTS, lengths, strict=True):
            assert collector.wait(60)
            assert collector.tokens() == ids(compiled.generate(prompt, max_tokens=n))


def test_batch_cancel_reports_on_rows(model) -> None:
    cancel = threading.Event()
    cancel.set()
    results = model.batch_generate(PROMPTS, max_tokens=10, cancel=cancel)
    assert all(r.error and "cancelled" in r.error for r in results)
    assert isinstance(model.err(), GenerationCancelled)


# ---------------------------------------------------------------------- threads and slots

def test_threads_generate_their_own_tokens(model) -> None:
    prompts = [*PROMPTS, "Numbers matter too"]
    want = {p: ids(model.generate(p, max_tokens=16)) for p in prompts}
    got: dict[str, list[int]] = {}
    errors: dict[str, object] = {}

    def work(p: str) -> None:
        got[p] = ids(model.generate(p, max_tokens=16))
        errors[p] = model.err()

    threads = [threading.Thread(target=work, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert got == want
    assert set(errors.values()) == {None}


def test_parallel_slots_cap_running_generations(model) -> None:
    # parallel_slots=2: two started streams hold both slots; a third waits until one ends.
    first, second = model.generate(PROMPTS[0], max_tokens=50), model.generate(PROMPTS[1], max_tokens=50)
    next(first), next(second)
    third_token: list[object] = []
    waiter = threading.Thread(target=lambda: third_token.append(next(model.generate(PROMPTS[2], max_tokens=5))))
    waiter.start()
    time.sleep(0.5)
    assert third_token == []
    first.close()
    waiter.join(30)
    assert len(third_token) == 1
    second.close()


# ---------------------------------------------------------------------- arguments and lifetime

def test_bad_arguments_raise_at_once(model) -> None:
    with pytest.raises(ValueError, match="empty"):
        model.generate("")
    with pytest.raises(ValueError):
        model.generate("x", temperature=-1)
    with pytest.raises(TypeError, match="unknown option"):
        model.generate("x", temprature=0.5)
    with pytest.raises(ValueError):
        model.classify([])
    with pytest.raises(ValueError):
        model.batch_generate(["ok", ""])
    with pytest.raises(ValueError):
        model.chat([])
    with pytest.raises(TypeError):
        model.classify("not a list")


def test_max_tokens_zero_yields_nothing(model) -> None:
    assert list(model.generate(PROMPTS[0], max_tokens=0)) == []
    assert [r.tokens for r in model.batch_generate(PROMPTS, max_tokens=0)] == [[]] * len(PROMPTS)
    assert model.err() is None


def test_cpu_device_and_gpu_layers_warning(model_dirs) -> None:
    path = str(model_dirs["llama"])
    with pymlxc.load_model(path, backend="metal") as default:
        want = ids(default.generate(PROMPTS[0], max_tokens=8))
    with pymlxc.load_model(path, backend="metal", gpu_layers=0) as cpu:
        assert ids(cpu.generate(PROMPTS[0], max_tokens=8)) == want
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pymlxc.load_model(path, backend="metal", gpu_layers=12).close()
    assert len([w for w in caught if "gpu_layers" in str(w.message)]) == 1


def test_close_frees_the_weights_and_blocks_use(model_dirs) -> None:
    gc.collect()
    mx.clear_cache()
    baseline = mx.get_active_memory()
    m = pymlxc.load_model(str(model_dirs["qwen3"]), backend="metal")
    list(m.generate(PROMPTS[0], max_tokens=8))
    m.batch_generate(PROMPTS, max_tokens=4)
    m.classify(PROMPTS)
    assert mx.get_active_memory() > baseline
    m.close()
    m.close()  # idempotent
    mx.clear_cache()
    assert mx.get_active_memory() == baseline
    for use in (lambda: m.generate("x"), lambda: m.chat([{"role": "user", "content": "x"}]),
                lambda: m.classify(["x"]), lambda: m.batch_generate(["x"]), lambda: m.model):
        with pytest.raises(ModelClosedError):
            use()


def test_close_during_a_stream_ends_it_with_an_error(model_dirs) -> None:
    m = pymlxc.load_model(str(model_dirs["llama"]), backend="metal")
    stream = m.generate(PROMPTS[0], max_tokens=50)
    got = [next(stream)]
    m.close()
    got.extend(stream)
    assert len(got) < 50
    assert isinstance(m.err(), ModelClosedError)

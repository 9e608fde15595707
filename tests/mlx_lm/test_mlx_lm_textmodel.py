"""MlxLmModel as a TextModel: streams, errors in err(), cancellation, timeouts, workers that fail, and closing."""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from mlx_lm_procs import children  # type: ignore[import-not-found]

from pymlxc.backends.mlx_lm import MlxLmBackend, MlxLmModel, WorkerDied, WorkerError, WorkerReplyError, WorkerTimeout
from pymlxc.model import GenerationCancelled, ModelClosedError, TextModel
from pymlxc.options import LoadConfig
from pymlxc.types import BatchResult, ClassifyResult, ModelInfo, Token
from tests.streams import LONG, cancel_after


def test_is_a_text_model_with_info_type_and_metrics(model: MlxLmModel) -> None:
    assert isinstance(model, TextModel)
    assert model.model_type == "llama"
    assert model.info() == ModelInfo("llama", vocab_size=512, num_layers=2, hidden_size=64)
    tokens = list(model.generate("The baker", max_tokens=7))
    assert len(tokens) == 7 and all(isinstance(t, Token) for t in tokens)
    m = model.metrics()
    assert m.generated_tokens == 7 and m.prompt_tokens > 0
    assert m.prefill_duration > 0 and m.decode_duration > 0 and m.total_duration >= m.decode_duration
    assert m.decode_tokens_per_sec > 0 and m.peak_memory_bytes > 0


def test_chat_classify_and_batch_generate_return_the_public_types(model: MlxLmModel) -> None:
    reply = list(model.chat([{"role": "user", "content": "hi"}], max_tokens=4))
    assert len(reply) == 4 and model.err() is None
    classified = model.classify(["a", "b"])
    assert all(isinstance(c, ClassifyResult) and c.logits is None for c in classified)
    batch = model.batch_generate(["a", "bb"], max_tokens=3)
    assert all(isinstance(b, BatchResult) and len(b.tokens) == 3 and b.error is None for b in batch)
    assert model.metrics().generated_tokens == 6
    for call in (model.classify, model.batch_generate):  # as on the metal backend
        with pytest.raises(ValueError, match="no prompts"):
            call([])
        with pytest.raises(ValueError, match="prompts item 1 is empty"):
            call(["a", ""])


@pytest.mark.parametrize(
    "call, error",
    [
        (lambda m: m.generate("x", bogus=1), TypeError),
        (lambda m: m.generate("x", temperature=-1), ValueError),
        (lambda m: m.generate("x", top_p=2), ValueError),
        (lambda m: m.generate(b"x"), TypeError),
        (lambda m: m.generate(""), ValueError),
        (lambda m: m.chat([]), ValueError),  # no messages: a wrong value, as on the metal backend
        (lambda m: m.chat("hello"), TypeError),
        (lambda m: m.chat([{"role": "user"}]), TypeError),
        (lambda m: m.classify("abc"), TypeError),
        (lambda m: m.batch_generate([1, 2]), TypeError),
        (lambda m: m.batch_generate(["a"], timeout=0), ValueError),
    ],
)
def test_invalid_arguments_raise_at_the_call_not_at_iteration(model: MlxLmModel, call: Any, error: type) -> None:
    with pytest.raises(error):
        call(model)  # generate/chat return lazily, so raising here proves the check is eager


def test_cancel_after_a_few_tokens_stops_the_stream(model: MlxLmModel) -> None:
    assert len(cancel_after(model, 3)) == 3
    assert isinstance(model.err(), GenerationCancelled)
    assert model.metrics().generated_tokens < 1000
    assert len(list(model.generate("x", max_tokens=5))) == 5 and model.err() is None  # err reset, worker in step


def test_a_cancel_set_before_the_call_yields_nothing(model: MlxLmModel) -> None:
    cancel = threading.Event()
    cancel.set()
    assert list(model.generate("x", max_tokens=5, cancel=cancel)) == []
    assert isinstance(model.err(), GenerationCancelled)
    with pytest.raises(GenerationCancelled):
        model.classify(["x"], cancel=cancel)


def test_timeout_ends_stream_and_batch_with_err_set(model: MlxLmModel) -> None:
    start = time.monotonic()
    tokens = list(model.generate("x", max_tokens=LONG, timeout=0.5))
    assert time.monotonic() - start < 10
    assert tokens and "timed out" in str(model.err())
    results = model.batch_generate(["a", "b"], max_tokens=LONG, timeout=0.5)
    assert "timed out" in str(model.err())
    assert all(0 < len(r.tokens) < LONG for r in results)


def test_an_abandoned_stream_is_cancelled_and_the_worker_kept(model: MlxLmModel) -> None:
    pids = model.worker_pids()
    stream = model.generate("x", max_tokens=LONG)
    assert next(stream) and next(stream)
    stream.close()  # the consumer walks away mid-stream
    assert len(list(model.generate("y", max_tokens=4))) == 4
    assert model.worker_pids() == pids


def test_concurrent_callers_are_serialised(model: MlxLmModel) -> None:
    prompts = ["alpha", "beta gamma", "delta"]
    expected = {p: [t.id for t in model.generate(p, max_tokens=12)] for p in prompts}
    got: dict[str, list[int]] = {}

    def run(prompt: str) -> None:
        got[prompt] = [t.id for t in model.generate(prompt, max_tokens=12)]

    threads = [threading.Thread(target=run, args=(p,)) for p in prompts * 2]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert got == expected


def test_parallel_slots_run_calls_on_separate_workers_and_close_reaps_them(
    backend: MlxLmBackend, tiny_model: Path
) -> None:
    before = children()
    two = backend.load(str(tiny_model), LoadConfig(parallel_slots=2))
    pids = set(two.worker_pids())
    assert len(pids) == 2 and pids <= children()
    held = two.generate("x", max_tokens=LONG)
    next(held)  # one worker is busy streaming...
    assert len(list(two.generate("y", max_tokens=3, timeout=20))) == 3  # ...the other answers meanwhile
    assert two.err() is None
    held.close()
    two.close()
    two.close()  # idempotent
    assert children() == before  # no worker left, not even a zombie
    assert not any(Path(f"/proc/{pid}").exists() for pid in pids)
    with pytest.raises(ModelClosedError):
        two.generate("x")


def test_a_killed_worker_gives_an_error_and_the_next_call_a_fresh_worker(model: MlxLmModel) -> None:
    [pid] = model.worker_pids()
    stream = model.generate("x", max_tokens=LONG)
    next(stream)
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(WorkerDied) as raised:  # a failure, not a stop: raised from the iterator
        for _ in stream:
            pass
    err = model.err()
    # The error raised, kept as a copy without its traceback (TextModel's rule for err()).
    assert type(err) is type(raised.value) and str(err) == str(raised.value) and err.__traceback__ is None
    assert isinstance(err, WorkerDied) and "signal 9" in str(err)
    assert pid not in children()  # reaped, not a zombie
    assert len(list(model.generate("x", max_tokens=4))) == 4 and model.err() is None
    assert model.worker_pids() != [pid]


def test_the_context_manager_closes(fake_backend: Any, tmp_path: Path) -> None:
    before = children()
    with fake_backend("error").load(str(tmp_path), LoadConfig()) as m:
        assert len(m.worker_pids()) == 1
    assert children() == before
    with pytest.raises(ModelClosedError):
        m.classify(["x"])


# ---- workers that misbehave (a stand-in script, so these are fast) ---------------------------------


@pytest.fixture
def fake_backend(tmp_path: Path) -> Any:
    def make(mode: str, **options: Any) -> MlxLmBackend:
        python = tmp_path / f"python-{mode}"
        fake = Path(__file__).with_name("fake_worker.py")
        python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{fake}" {mode} "$@"\n')
        python.chmod(0o755)
        return MlxLmBackend(str(python), **options)

    return make


def test_a_dying_worker_error_carries_its_last_stderr_lines(fake_backend: Any, tmp_path: Path) -> None:
    with fake_backend("die").load(str(tmp_path), LoadConfig()) as m:
        tokens: list[Token] = []
        with pytest.raises(WorkerDied):
            tokens.extend(m.generate("x"))
        assert [t.text for t in tokens] == ["a", "b"]
        err = m.err()
        assert isinstance(err, WorkerDied)
        assert "exited with code 3" in str(err) and "RESOURCE EXHAUSTED, out of memory" in str(err)
        assert m.worker_pids() == []
        with pytest.raises(WorkerDied):  # a fresh worker serves the next call (and dies the same way)
            list(m.generate("x"))
        assert isinstance(m.err(), WorkerDied)


def test_a_silent_worker_is_killed_after_the_response_timeout(fake_backend: Any, tmp_path: Path) -> None:
    before = children()
    with fake_backend("hang", response_timeout=1.0).load(str(tmp_path), LoadConfig()) as m:
        [pid] = m.worker_pids()
        start = time.monotonic()
        texts: list[str] = []
        with pytest.raises(WorkerTimeout):
            texts.extend(t.text for t in m.generate("x"))
        assert texts == ["a"]
        assert 1.0 <= time.monotonic() - start < 10
        assert isinstance(m.err(), WorkerTimeout) and "killed" in str(m.err())
        assert pid not in children()
    assert children() == before


def test_an_error_reply_is_raised_from_the_stream_and_for_single_replies_and_kept(
    fake_backend: Any, tmp_path: Path
) -> None:
    with fake_backend("error").load(str(tmp_path), LoadConfig()) as m:
        with pytest.raises(WorkerReplyError, match="fake failure"):
            list(m.generate("x"))
        err = m.err()
        assert isinstance(err, WorkerReplyError) and err.code == "failed" and "fake failure" in str(err)
        with pytest.raises(WorkerReplyError):
            m.classify(["x"])
        assert isinstance(m.err(), WorkerReplyError)


def test_a_worker_speaking_another_protocol_version_is_refused(fake_backend: Any, tmp_path: Path) -> None:
    before = children()
    with pytest.raises(WorkerError, match="protocol 999"):
        fake_backend("protocol").load(str(tmp_path), LoadConfig())
    assert children() == before


def test_a_timeout_against_a_hung_worker_returns_within_a_second_of_it(fake_backend: Any, tmp_path: Path) -> None:
    """The worker ignores the cancel: the call still ends about CANCEL_WAIT_S after the timeout, and
    the worker is killed in the background CANCEL_GRACE_S after the cancel (not by the caller)."""
    from pymlxc.backends.mlx_lm.textmodel import CANCEL_GRACE_S, CANCEL_WAIT_S

    before = children()
    with fake_backend("hang").load(str(tmp_path), LoadConfig()) as m:
        [pid] = m.worker_pids()
        start = time.monotonic()
        assert [t.text for t in m.generate("x", timeout=1.0)] == ["a"]
        assert time.monotonic() - start < 1.0 + CANCEL_WAIT_S + 0.5
        assert isinstance(m.err(), GenerationCancelled) and "timed out" in str(m.err())
        deadline = time.monotonic() + CANCEL_GRACE_S + 5
        while pid in children() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert pid not in children()  # killed and reaped by the background settle
        start = time.monotonic()
        results = m.batch_generate(["a", "b"], timeout=1.0)  # a fresh worker, hung the same way
        assert time.monotonic() - start < 1.0 + CANCEL_WAIT_S + 1.5
        assert all(r.tokens == [] and "timed out" in str(r.error) for r in results)
        assert isinstance(m.err(), GenerationCancelled)
    assert children() == before


def test_an_option_json_cannot_carry_raises_at_the_call_and_the_worker_lives(model: MlxLmModel) -> None:
    pids = model.worker_pids()
    with pytest.raises(ValueError, match="temperature"):
        model.generate("x", temperature=float("nan"), max_tokens=2)
    with pytest.raises(ValueError, match="top_p"):
        model.classify(["x"], top_p=float("nan"))
    assert len(list(model.generate("x", max_tokens=2))) == 2 and model.err() is None
    assert model.worker_pids() == pids  # no reload: the worker was never sent the bad request


def test_template_kwargs_json_cannot_carry_raise_naming_the_variable(model: MlxLmModel) -> None:
    # An object value used to raise json's bare "Object of type object is not JSON serializable".
    messages = [{"role": "user", "content": "x"}]
    deep: list[Any] = []
    for _ in range(100_000):
        deep = [deep]
    # Not JSON data: refused by the check both backends share (options.check_template_kwargs); JSON
    # data the worker's line cannot carry (nested past the encoder's depth): by the encoding.
    sent = r"chat_template_kwargs\['v'\] cannot be sent to the worker as JSON: .*"
    cases = [(object(), TypeError, r"chat_template_kwargs\.v is object, not JSON data .*"),
             (float("nan"), ValueError, r"chat_template_kwargs\.v is nan, not a finite number"),
             (deep, ValueError, sent + "nested too deeply")]
    for value, error, what in cases:
        with pytest.raises(error, match="^" + what):
            model.chat(messages, max_tokens=2, chat_template_kwargs={"v": value})
    assert len(list(model.chat(messages, max_tokens=2, chat_template_kwargs={"v": [1, "a"]}))) == 2


def test_ids_outside_the_embedding_raise_value_errors_naming_them(model: MlxLmModel) -> None:
    for call in (lambda: model.decode([5, 512]), lambda: model.inspect_attention([512])):
        with pytest.raises(ValueError, match=r"token id 512 is outside the vocabulary of 512 \(the embedding's rows\)"):
            call()


def test_err_belongs_to_the_calling_thread(model: MlxLmModel) -> None:
    cancel = threading.Event()
    cancel.set()
    list(model.generate("x", max_tokens=3, cancel=cancel))
    other: list[BaseException | None] = []
    t = threading.Thread(target=lambda: (list(model.generate("y", max_tokens=2)), other.append(model.err())))
    t.start()
    t.join(60)
    assert other == [None]
    assert isinstance(model.err(), GenerationCancelled)  # another thread's call did not reset it

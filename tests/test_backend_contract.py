"""The TextModel contract, checked on both backends with the same tiny model: what raises at the
call, what ends a stream into err(), close during a generation, and classify's logits (raw logits,
equal across backends to float tolerance)."""
from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pymlxc
from pymlxc.backends.mlx_lm import MlxLmBackend
from pymlxc.model import GenerationCancelled, ModelClosedError, TextModel
from pymlxc.options import LoadConfig
from pymlxc.testing import write_tiny_model
from pymlxc.types import BatchResult, ContextLengthError, Message, TemplateError
from tests.streams import LONG, cancel_after

BACKENDS = ("metal", "mlx_lm")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("contract") / "llama", "llama", seed=3)


def _load(backend: str, path: Path, context_len: int = 1024) -> TextModel:
    if backend == "mlx_lm":
        return MlxLmBackend(sys.executable, response_timeout=30.0, load_timeout=120.0).load(
            str(path), LoadConfig(context_len=context_len)
        )
    return pymlxc.load_model(str(path), backend="metal", context_len=context_len)


@pytest.fixture(scope="module")
def loaded(tiny: Path) -> Iterator[dict[str, TextModel]]:
    models = {name: _load(name, tiny) for name in BACKENDS}
    yield models
    for m in models.values():
        m.close()


@pytest.fixture(params=BACKENDS)
def model(request: pytest.FixtureRequest, loaded: dict[str, TextModel]) -> TextModel:
    return loaded[request.param]


BAD_CALLS: list[tuple[str, Callable[[TextModel], Any], type[Exception], str]] = [
    ("unknown option", lambda m: m.generate("x", bogus=1), TypeError, "bogus"),
    ("negative temperature", lambda m: m.generate("x", temperature=-1.0), ValueError, "temperature"),
    ("NaN temperature", lambda m: m.generate("x", temperature=float("nan")), ValueError, "temperature"),
    ("NaN top_p", lambda m: m.classify(["x"], top_p=float("nan")), ValueError, "top_p"),
    ("negative stop token", lambda m: m.generate("x", stop_tokens=[-1]), ValueError, "stop_tokens"),
    ("zero timeout", lambda m: m.batch_generate(["x"], timeout=0), ValueError, "timeout"),
    ("bytes prompt", lambda m: m.generate(b"x"), TypeError, "str"),
    ("empty prompt", lambda m: m.generate(""), ValueError, "empty"),
    ("one string as prompts", lambda m: m.classify("abc"), TypeError, "prompts"),
    ("no prompts to classify", lambda m: m.classify([]), ValueError, "no prompts"),
    ("no prompts to batch", lambda m: m.batch_generate([]), ValueError, "no prompts"),
    # Not Unicode text (a lone surrogate, from a bad decode upstream): the position named, on both backends.
    ("lone surrogate prompt", lambda m: m.generate("ab\ud800"), ValueError, "surrogate .* at position 2"),
    ("lone surrogate in prompts", lambda m: m.batch_generate(["x", "\udc00"]), ValueError, "at position 0"),
    ("lone surrogate in a message", lambda m: m.chat([{"role": "user", "content": "a\ud800"}]), ValueError,
     "content has a lone surrogate .* at position 1"),
    ("lone surrogate to count", lambda m: m.prompt_length("a\ud800"), ValueError, "at position 1"),
    ("message content not a string", lambda m: m.chat([{"role": "user", "content": ["hi"]}]), TypeError,
     "content must be strings"),
    ("message without content", lambda m: m.chat([{"role": "user"}]), TypeError, "content"),
    # A message's other keys reach the template as transformers passes them (test_extra_message_keys_...);
    # what a template cannot read by name, or the worker cannot receive, is refused alike. The
    # mlx_lm backend refused every other key; the metal backend took these and rendered them.
    ("a message key that is not a str", lambda m: m.chat([{"role": "user", "content": "hi", 1: "x"}]), TypeError,
     "^message 0 has a key that is not a str: 1$"),
    ("a message that is a str", lambda m: m.chat([{"role": "user", "content": "hi"}, "hi"]), TypeError,
     "^message 1 must be a Message or a dict with 'role' and 'content'"),
    ("a message value that is no JSON data", lambda m: m.chat([{"role": "user", "content": "hi", "tags": {"a"}}]),
     TypeError, r"^message 0's tags is set, not JSON data \(str, number, bool, None, list or dict\)"),
    ("a nested key that is not a str",
     lambda m: m.chat([{"role": "user", "content": "hi", "meta": [{"a": {2: "x"}}]}]), TypeError,
     r"^message 0's meta\[0\]\['a'\] has a key that is not a str: 2"),
    ("a NaN in a message", lambda m: m.prompt_length([{"role": "user", "content": "hi", "score": float("nan")}]),
     ValueError, "^message 0's score is nan, not a finite number"),
    ("a lone surrogate deep in a message",
     lambda m: m.chat([{"role": "user", "content": "hi", "tool_calls": [{"name": "a\ud800"}]}]), ValueError,
     r"^message 0's tool_calls\[0\]\['name'\] has a lone surrogate .* at position 1"),
    # Used to raise tokenizers' "TextInputSequence must be str" (metal) or "'int' object is not iterable".
    ("a number to encode", lambda m: m.encode(5), TypeError, "^text must be a str"),
    ("bytes to encode", lambda m: m.encode(b"x"), TypeError, "^text must be a str"),
    ("a number to count", lambda m: m.prompt_length(5), TypeError,
     "^prompt must be a str or a sequence of messages, not int"),
    ("a number as messages", lambda m: m.chat(5), TypeError, "^messages must be a .*sequence of Message"),
    ("a stop token past the vocabulary", lambda m: m.generate("x", stop_tokens=[3, 10**6]), ValueError,
     r"^stop_tokens\[1\] is 1000000, outside the model's vocabulary of \d+ tokens"),
    ("negative id to decode", lambda m: m.decode([-1]), ValueError, "-1"),
    ("id past the vocabulary to decode", lambda m: m.decode([5, 100_000]), ValueError, "100000"),
    # The mlx_lm backend used int() on each id: 1.5 decoded as id 1, True as 1, and a str "12" as ids 1, 2.
    ("a float id to decode", lambda m: m.decode([5, 1.5]), TypeError, r"^token 1 must be an int, not float 1\.5"),
    ("a bool id to decode", lambda m: m.decode([True]), TypeError, "^token 0 must be an int, not bool"),
    ("a str to decode", lambda m: m.decode("12"), TypeError, "^ids must be a sequence of token ids"),
    ("None to decode", lambda m: m.decode(None), TypeError, "^ids must be a sequence of token ids .*NoneType"),
    # The mlx_lm backend said TypeError for no messages; the metal backend ValueError (a wrong value).
    ("no messages", lambda m: m.chat([]), ValueError, "^chat needs at least one message"),
    ("no messages to count", lambda m: m.prompt_length([]), ValueError, "^chat needs at least one message"),
    # The metal backend took any iterable: a set or a dict's keys in an order the caller did not
    # choose, and an empty iterator (truthy) answered [] silently.
    ("a set of prompts", lambda m: m.classify({"a", "b"}), TypeError, "^prompts must be a sequence of str.*set"),
    ("a dict of prompts", lambda m: m.batch_generate({"a": 1}), TypeError, "^prompts must be a sequence .*dict"),
    ("an empty iterator of prompts", lambda m: m.batch_generate(iter([])), TypeError, "^prompts must be a sequence"),
    ("a number among the prompts", lambda m: m.classify(["a", 5]), TypeError, "^prompts item 1 must be a str"),
    ("an empty prompt among the prompts", lambda m: m.batch_generate(["a", ""]), ValueError,
     "^prompts item 1 is empty"),
    # The mlx_lm backend answered for an empty prompt (the BOS token alone), said TypeError for a
    # negative id, and "'int' object is not iterable" for a number.
    ("an empty prompt to inspect", lambda m: m.inspect_attention(""), ValueError, "empty"),
    ("no ids to inspect", lambda m: m.inspect_attention([]), ValueError, "no token ids|encodes to no tokens"),
    ("a negative id to inspect", lambda m: m.inspect_attention([5, -1]), ValueError, "-1"),
    ("an id past the vocabulary to inspect", lambda m: m.inspect_attention([10**6]), ValueError, "1000000"),
    ("a number to inspect", lambda m: m.inspect_attention(5), TypeError, "^prompt must be .*not int"),
    # float() of an int past float's range raised OverflowError (no ValueError, no option named).
    ("an int temperature past float's range", lambda m: m.generate("x", temperature=10**400), ValueError,
     "^temperature must be finite"),
    ("an int top_p past float's range", lambda m: m.classify(["x"], top_p=-(10**400)), ValueError,
     "^top_p must be finite"),
    ("an int timeout past float's range", lambda m: m.batch_generate(["x"], timeout=10**400), ValueError,
     "^timeout must be finite"),
    # The worker ran one unchunked pass whatever the length (attention memory grows with its square:
    # a line of millions of ids got it OOM-killed); the metal backend evicted past context_len.
]


@pytest.mark.parametrize("what, call, error, names", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_arguments_raise_at_the_call(model: TextModel, what: str, call: Callable[[TextModel], Any],
                                         error: type[Exception], names: str) -> None:
    with pytest.raises(error, match=names):
        call(model)  # generate returns lazily: raising here proves the check is eager
    assert len(list(model.generate("x", max_tokens=2))) == 2 and model.err() is None  # and the model serves on


@pytest.mark.parametrize("text", ["hi", "The baker went", " spaced"])
def test_a_prompt_with_its_bos_text_is_counted_and_generated_once(loaded: dict[str, TextModel], text: str) -> None:
    """A prompt that already starts with the BOS text gets no second BOS (as mlx-lm's generate and
    server add special tokens only when the prompt does not start with it)."""
    bos = "<|begin_of_text|>"  # the tiny Llama's
    metal, mlx_lm = loaded["metal"], loaded["mlx_lm"]
    plain = metal.prompt_length(text)
    bos_id = metal.encode("hi")[0]
    assert metal.encode(bos + text)[:2] == [bos_id, bos_id]  # encode itself adds what it is told
    for m in (metal, mlx_lm):
        assert m.prompt_length(bos + text) == plain
    with_bos = [[t.id for t in m.generate(bos + text, max_tokens=4)] for m in (metal, mlx_lm)]
    assert with_bos[0] == with_bos[1] == [t.id for t in metal.generate(text, max_tokens=4)]
    assert metal.metrics().prompt_tokens == plain


def test_inspect_attention_takes_a_prompt_that_fills_the_context(loaded: dict[str, TextModel]) -> None:
    snapshots = {name: m.inspect_attention([1] * 1024) for name, m in loaded.items()}
    assert {s.seq_len for s in snapshots.values()} == {1024}
    np.testing.assert_allclose(snapshots["metal"].keys[1][0], snapshots["mlx_lm"].keys[1][0], rtol=1e-3, atol=1e-3)


def test_a_stream_that_finishes_leaves_err_none_and_a_cancelled_one_sets_it(model: TextModel) -> None:
    got = cancel_after(model, 3)
    assert 3 <= len(got) < 50
    assert isinstance(model.err(), GenerationCancelled)
    assert len(list(model.generate("x", max_tokens=4))) == 4
    assert model.err() is None  # each call resets it


def test_a_timeout_ends_the_stream_into_err(model: TextModel) -> None:
    tokens = list(model.generate("x", max_tokens=LONG, timeout=0.5))
    assert 0 < len(tokens) < LONG
    assert isinstance(model.err(), GenerationCancelled) and "timed out" in str(model.err())


def test_a_cancelled_classify_raises(model: TextModel) -> None:
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(GenerationCancelled):
        model.classify(["x"], cancel=cancel)


def test_streamed_texts_join_into_the_decoded_text(model: TextModel) -> None:
    tokens = list(model.generate("The baker", max_tokens=16))
    assert len(tokens) == 16
    text = "".join(t.text for t in tokens)
    decoded = model.decode([t.id for t in tokens])
    assert text == decoded or (text == decoded[1:] and decoded.startswith(" "))


@pytest.mark.parametrize("backend", BACKENDS)
def test_close_during_a_generation_ends_it_with_model_closed_error(backend: str, tiny: Path) -> None:
    m = _load(backend, tiny)
    started, outcome = threading.Event(), {}

    def consume() -> None:
        n = 0
        for _ in m.generate("x", max_tokens=LONG):
            n += 1
            if n == 2:
                started.set()
        outcome.update(n=n, err=m.err())

    consumer = threading.Thread(target=consume)
    consumer.start()
    assert started.wait(60)
    m.close()
    consumer.join(30)
    assert not consumer.is_alive()
    assert outcome["n"] < LONG and isinstance(outcome["err"], ModelClosedError)
    with pytest.raises(ModelClosedError):
        m.generate("x")


def test_classify_logits_are_raw_logits_equal_across_backends(loaded: dict[str, TextModel]) -> None:
    prompts = ["a", "The baker kneads", "bb b"]
    results = {name: m.classify(prompts, return_logits=True) for name, m in loaded.items()}
    metal, mlx_lm = (np.array([r.logits for r in results[name]], dtype=np.float64) for name in BACKENDS)
    assert metal.shape == mlx_lm.shape == (3, 512)
    np.testing.assert_allclose(mlx_lm, metal, atol=2e-3, rtol=1e-3)  # log-probabilities would be off by a constant
    for name in BACKENDS:
        assert [r.token.id for r in results[name]] == list(metal.argmax(1))  # greedy: the argmax
    penalised = {name: m.classify(prompts, return_logits=True, repeat_penalty=1.5) for name, m in loaded.items()}
    np.testing.assert_allclose(np.array([r.logits for r in penalised["mlx_lm"]]),
                               np.array([r.logits for r in penalised["metal"]]), atol=2e-3, rtol=1e-3)


def test_a_call_behind_this_threads_own_paused_stream_raises_instead_of_waiting(model: TextModel) -> None:
    paused = model.generate("x", max_tokens=LONG)
    next(paused)  # the stream holds the only slot until it ends
    try:
        with pytest.raises(RuntimeError, match="slot"):
            model.classify(["y"])
    finally:
        paused.close()
    assert len(model.classify(["y"])) == 1


@pytest.fixture(scope="module")
def qwen3_models(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, TextModel]]:
    path = write_tiny_model(tmp_path_factory.mktemp("contract") / "qwen3", "qwen3", seed=5)
    models = {b: _load(b, path) for b in BACKENDS}
    yield models
    for m in models.values():
        m.close()


def test_chat_template_kwargs_reach_the_template_on_both_backends(qwen3_models: dict[str, TextModel]) -> None:
    # Qwen 3's template writes an empty think block when thinking is off: a longer prompt, the
    # same on both backends, and the same tokens.
    messages = [{"role": "user", "content": "Say something."}]
    seen = {}
    for name, m in qwen3_models.items():
        on = [t.id for t in m.chat(messages, max_tokens=6)]
        on_len = m.metrics().prompt_tokens
        off = [t.id for t in m.chat(messages, max_tokens=6, chat_template_kwargs={"enable_thinking": False})]
        off_len = m.metrics().prompt_tokens
        assert off_len > on_len, name
        # prompt_length counts as the call reads (what a server checks against its context).
        assert m.prompt_length(messages) == on_len, name
        assert m.prompt_length(messages, chat_template_kwargs={"enable_thinking": False}) == off_len, name
        assert m.prompt_length("Say something.") == len(m.encode("Say something.")), name
        seen[name] = (on, off, on_len, off_len)
    assert seen["metal"] == seen["mlx_lm"]


@pytest.mark.parametrize("bad", [{"_private": 1}, {"not a name": 1}, {1: 2}])
def test_bad_chat_template_kwargs_raise_at_the_call(model: TextModel, bad: dict[Any, Any]) -> None:
    with pytest.raises(ValueError, match="template variable name"):
        model.chat([{"role": "user", "content": "hi"}], chat_template_kwargs=bad)


@pytest.mark.parametrize("name", ["add_generation_prompt", "messages", "tokenizer", "guard", "tokenize",
                                  "conversation"])
def test_chat_template_kwargs_that_the_call_passes_itself_raise_naming_the_key(model: TextModel, name: str) -> None:
    # They clashed with the call's own arguments (a TypeError from inside), or were taken by
    # mlx-lm's apply_chat_template as its own options.
    with pytest.raises(ValueError, match=f"'{name}' is set by the chat call"):
        model.chat([{"role": "user", "content": "hi"}], chat_template_kwargs={name: False})
    assert len(list(model.chat([{"role": "user", "content": "hi"}], max_tokens=2))) == 2


def test_encode_takes_add_special_tokens_on_both_backends(loaded: dict[str, TextModel]) -> None:
    # The metal backend's encode had no add_special_tokens (a TypeError where mlx_lm's answered).
    seen = {name: (m.encode("The baker"), m.encode("The baker", add_special_tokens=False))
            for name, m in loaded.items()}
    assert seen["metal"] == seen["mlx_lm"]
    with_bos, plain = seen["metal"]
    assert with_bos[1:] == plain and len(with_bos) == len(plain) + 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_model_call_after_close_raises_model_closed_error(backend: str, tiny: Path) -> None:
    m = _load(backend, tiny)
    m.close()
    m.close()  # idempotent
    calls: list[Callable[[], Any]] = [
        lambda: m.generate("x"), lambda: m.chat([{"role": "user", "content": "x"}]), lambda: m.classify(["x"]),
        lambda: m.batch_generate(["x"]), lambda: m.prompt_length("x"), lambda: m.inspect_attention("x"),
        # The metal backend's encode and decode still answered from the tokenizer after close().
        lambda: m.encode("x"), lambda: m.decode([1]),
    ]
    for call in calls:
        with pytest.raises(ModelClosedError):
            call()


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=12),
       max_tokens=st.integers(0, 5))
def test_greedy_ids_and_usage_counts_agree_across_backends(loaded: dict[str, TextModel], prompt: str,
                                                           max_tokens: int) -> None:
    # Each call's metrics answer for it: after max_tokens=0 the metal backend's still held the
    # previous call's counts (here, the warm-up's 7 generated tokens).
    seen = {}
    for name, m in loaded.items():
        list(m.generate("warm up", max_tokens=7))
        ids = [t.id for t in m.generate(prompt, max_tokens=max_tokens)]
        assert m.err() is None, name
        seen[name] = (ids, m.metrics().prompt_tokens, m.metrics().generated_tokens)
        if max_tokens == 0:  # nothing ran: no prefill rate (the metal backend reported ~10**6 tok/s)
            assert (m.metrics().prefill_tokens_per_sec, m.metrics().prefill_duration) == (0.0, 0.0), name
    assert seen["metal"] == seen["mlx_lm"]
    ids, prompt_tokens, generated = seen["metal"]
    assert prompt_tokens == len(loaded["metal"].encode(prompt)) and generated == len(ids) <= max_tokens


def test_a_batch_of_no_tokens_reports_its_own_metrics_on_metal(loaded: dict[str, TextModel]) -> None:
    m = loaded["metal"]
    list(m.generate("warm up", max_tokens=7))
    assert m.batch_generate(["a", "The baker"], max_tokens=0) == [BatchResult(), BatchResult()]
    assert (m.metrics().prompt_tokens, m.metrics().generated_tokens) == (5, 0)
    assert m.metrics().prefill_tokens_per_sec == 0.0


def test_batch_usage_counts_agree_across_backends(loaded: dict[str, TextModel]) -> None:
    stop = [t.id for t in loaded["metal"].generate("The baker", max_tokens=3)][2]
    counts = {}
    for name, m in loaded.items():
        m.batch_generate(["a", "The baker"], max_tokens=3, stop_tokens=[stop])
        counts[name] = (m.metrics().prompt_tokens, m.metrics().generated_tokens)
        m.classify(["a", "The baker"])
        counts[name] += (m.metrics().prompt_tokens,)
    assert counts["mlx_lm"] == counts["metal"]


# Refuses any role but user and assistant, as many chat templates do (raise_exception).
STRICT_TEMPLATE = ("{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
                   "{{ raise_exception('roles must be user or assistant, not ' + m['role']) }}{% endif %}"
                   "{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
                   "{% if add_generation_prompt %}assistant:{% endif %}")


def _template_models(factory: pytest.TempPathFactory, name: str, template: str) -> Iterator[dict[str, TextModel]]:
    """A tiny Llama with `template` as its chat template, loaded on each backend (closed after)."""
    path = write_tiny_model(factory.mktemp("contract") / name, "llama", seed=3, chat_template=template)
    models = {b: _load(b, path) for b in BACKENDS}
    yield models
    for m in models.values():
        m.close()


@pytest.fixture(scope="module")
def strict_template_models(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, TextModel]]:
    yield from _template_models(tmp_path_factory, "strict", STRICT_TEMPLATE)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_template_that_refuses_the_messages_raises_template_error(strict_template_models: dict[str, TextModel],
                                                                 backend: str) -> None:
    # The mlx_lm backend raised WorkerReplyError, a RuntimeError: the server, which counts the
    # prompt first and answers 400 for a ValueError, answered 500 for a caller's wrong role.
    m = strict_template_models[backend]
    bad = [{"role": "system", "content": "hi"}]
    with pytest.raises(TemplateError, match="roles must be user or assistant, not system"):
        m.prompt_length(bad)
    with pytest.raises(TemplateError, match="roles must be user or assistant, not system"):
        list(m.chat(bad, max_tokens=2))  # metal: at the call; mlx_lm: from the stream, where it renders
    good = [{"role": "user", "content": "hi"}]
    assert len(list(m.chat(good, max_tokens=2))) == 2 and m.err() is None
    assert m.prompt_length(good) == strict_template_models["metal"].prompt_length(good)


# ---- sampling: the same options sample the same tokens on both backends ---------------------------
# The metal backend draws from its own key as mlx's global generator does after mx.random.seed, so
# a seed gives the same tokens on both where their filters and penalties agree.


def _ids_on_both(loaded: dict[str, TextModel], call: Callable[[TextModel], Any]) -> dict[str, Any]:
    seen = {}
    for name, m in loaded.items():
        seen[name] = call(m)
        assert m.err() is None, (name, m.err())
    return seen


def test_the_repeat_penalty_looks_at_the_same_tokens_on_both_backends(loaded: dict[str, TextModel]) -> None:
    # The mlx_lm worker penalised the last 20 tokens (mlx-lm's default), metal the last 64
    # (llama.cpp's): the greedy tokens parted once prompt and output passed 20 tokens.
    prompt = "a b " * 30
    streams = _ids_on_both(loaded, lambda m: [t.id for t in m.generate(prompt, max_tokens=30, repeat_penalty=1.5)])
    assert streams["metal"] == streams["mlx_lm"]
    batches = _ids_on_both(loaded, lambda m: [[t.id for t in r.tokens] for r in m.batch_generate(
        [prompt, "x"], max_tokens=30, repeat_penalty=1.5)])
    assert batches["metal"] == batches["mlx_lm"]
    assert batches["metal"][0] == streams["metal"]


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(top_k=st.integers(1, 600), top_p=st.sampled_from([0.0, 0.05, 0.5, 0.9, 1.0]),
       min_p=st.sampled_from([0.0, 0.5, 0.9]), seed=st.integers(0, 2**64 - 1))
def test_seeded_sampling_with_the_filters_together_agrees_across_backends(
        loaded: dict[str, TextModel], top_k: int, top_p: float, min_p: float, seed: int) -> None:
    # The worker used mlx-lm's make_sampler, whose top-p sees the whole distribution before top-k;
    # metal applies top-k, then top-p over what it kept (llama.cpp's order): other tokens were kept.
    options = dict(max_tokens=6, temperature=1.0, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)
    seen = _ids_on_both(loaded, lambda m: [t.id for t in m.generate("The baker", **options)])
    assert seen["metal"] == seen["mlx_lm"]


def test_top_k_then_top_p_keeps_what_metal_keeps_on_the_worker(loaded: dict[str, TextModel]) -> None:
    options = dict(max_tokens=8, temperature=1.0, top_k=40, top_p=0.5, seed=1)
    seen = _ids_on_both(loaded, lambda m: [t.id for t in m.generate("x", **options)])
    assert seen["metal"] == seen["mlx_lm"]
    # Top-p over the 40 kept is a stronger cut than top-k alone: the two options do not reduce to one.
    assert seen["metal"] != [t.id for t in loaded["metal"].generate("x", **{**options, "top_p": 0.0})]


def test_each_row_of_a_seeded_batch_samples_as_generate_does_on_both_backends(loaded: dict[str, TextModel]) -> None:
    # The worker drew a seeded batch's rows from one generator: a row's tokens depended on the
    # other rows, and equal prompts got different tokens (the metal backend's rows each have a key).
    prompts = ["x", "x", "The baker"]
    options = dict(max_tokens=5, temperature=1.0, top_k=40, seed=3)
    seen = _ids_on_both(loaded, lambda m: [[t.id for t in r.tokens] for r in m.batch_generate(prompts, **options)])
    assert seen["metal"] == seen["mlx_lm"]
    rows = seen["metal"]
    assert rows[0] == rows[1]
    for name, m in loaded.items():
        assert [t.id for t in m.generate("The baker", **options)] == rows[2], name


# ---- a prompt past the context: ContextLengthError on every call, in the same words --------------
# Both backends used to prefill such a prompt through caches that keep its first 4 and latest tokens,
# each in its own chunks, and go on: which part of its middle the model saw differed between them
# (other greedy tokens for prompts of 22, 32 or 60 tokens at a context of 16), and metal's batch rows
# ended at once (ContextFull) where the worker's generated.
CONTEXT = 32
TOO_LONG = "the prompt has {n} tokens, more than the context length of {c}: shorten it, or load the model with a " \
           "larger context_len"


@pytest.fixture(scope="module")
def short_context(tiny: Path) -> Iterator[dict[str, TextModel]]:
    models = {b: _load(b, tiny, context_len=CONTEXT) for b in BACKENDS}
    yield models
    for m in models.values():
        m.close()


def _text_of(m: TextModel, tokens: int) -> str:
    """A prompt that `generate` reads as exactly `tokens` tokens."""
    for words in range(tokens):
        text = "a" + " b" * words
        if m.prompt_length(text) == tokens:
            return text
    raise AssertionError(f"no prompt of {tokens} tokens")


def _run(result: Any) -> Any:
    """A call's result, a stream read to its end: metal refuses at the call, the mlx_lm backend's
    stream before its first token (its worker tokenizes, as it renders a chat template)."""
    return list(result) if isinstance(result, Iterator) else result


def _as_chat(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


# (what, the call on a prompt of CONTEXT + 1 tokens, how many tokens the model reads, what the error names)
PAST_THE_CONTEXT: list[tuple[str, Callable[[TextModel, str], Any], Callable[[TextModel, str], int], str]] = [
    ("generate", lambda m, p: m.generate(p, max_tokens=4), lambda m, p: m.prompt_length(p), "the prompt"),
    ("generate no tokens", lambda m, p: m.generate(p, max_tokens=0), lambda m, p: m.prompt_length(p), "the prompt"),
    ("chat", lambda m, p: m.chat(_as_chat(p), max_tokens=4), lambda m, p: m.prompt_length(_as_chat(p)),
     "the prompt"),
    ("classify", lambda m, p: m.classify(["x", p]), lambda m, p: m.prompt_length(p), "prompts item 1"),
    ("batch_generate", lambda m, p: m.batch_generate(["x", p, "y"], max_tokens=4), lambda m, p: m.prompt_length(p),
     "prompts item 1"),
    ("inspect_attention", lambda m, p: m.inspect_attention(p), lambda m, p: m.prompt_length(p), "the prompt"),
    ("inspect_attention ids", lambda m, p: m.inspect_attention([5] * (CONTEXT + 1)), lambda m, p: CONTEXT + 1,
     "the prompt"),
]


@pytest.mark.parametrize("what, call, count, names", PAST_THE_CONTEXT, ids=[c[0] for c in PAST_THE_CONTEXT])
def test_a_prompt_past_the_context_raises_context_length_error_alike(
        short_context: dict[str, TextModel], what: str, call: Callable[[TextModel, str], Any],
        count: Callable[[TextModel, str], int], names: str) -> None:
    prompt = _text_of(short_context["metal"], CONTEXT + 1)
    seen = {}
    for name, m in short_context.items():
        with pytest.raises(ContextLengthError) as caught:
            _run(call(m, prompt))
        seen[name] = (str(caught.value), caught.value.prompt_tokens, caught.value.context_len)
        assert count(m, prompt) == caught.value.prompt_tokens, name  # prompt_length counts it, refusing nothing
        assert len(list(m.generate("x", max_tokens=2))) == 2 and m.err() is None, name  # and the model serves on
    n = count(short_context["metal"], prompt)
    assert seen["metal"] == seen["mlx_lm"] == (TOO_LONG.format(n=n, c=CONTEXT).replace("the prompt", names, 1),
                                               n, CONTEXT)
    assert issubclass(ContextLengthError, ValueError)  # a caller's wrong value: a server's 400


def test_a_prompt_that_fills_the_context_runs_alike(short_context: dict[str, TextModel]) -> None:
    # Generation past the context goes on (the caches keep the first and the latest tokens), alike.
    # (Not batch_generate's rows: they end where prompt and tokens fill the context, the next test.)
    prompt = _text_of(short_context["metal"], CONTEXT)
    seen = {}
    for name, m in short_context.items():
        ids = [t.id for t in m.generate(prompt, max_tokens=8)]
        assert m.err() is None, name
        seen[name] = (ids, m.metrics().prompt_tokens, [r.token.id for r in m.classify([prompt, "x"])],
                      m.inspect_attention(prompt).seq_len)
    assert seen["metal"] == seen["mlx_lm"]
    assert seen["metal"][1] == seen["metal"][3] == CONTEXT and len(seen["metal"][0]) == 8


def test_batch_rows_end_at_the_context_alike(short_context: dict[str, TextModel]) -> None:
    """A batch row ends where its prompt and tokens fill the context, with the same tokens and the
    same ContextFull words on both backends; a row with room for its max_tokens, and a row whose
    prompt is the whole context (no tokens), beside it. The worker's rows rotated on (protocol 4)."""
    metal = short_context["metal"]
    prompts = [_text_of(metal, CONTEXT - 5), "x", _text_of(metal, CONTEXT)]
    seen = {}
    for name, m in short_context.items():
        results = m.batch_generate(prompts, max_tokens=8)
        assert m.err() is None, name  # a row the context cut short says so on its own result
        seen[name] = [([t.id for t in r.tokens], r.error) for r in results]
    assert seen["metal"] == seen["mlx_lm"]
    (cut, cut_error), (free, free_error), (none, none_error) = seen["metal"]
    assert len(cut) == 5 and len(free) == 8 and none == [] and free_error is None
    words = "ContextFull: {p} prompt and {g} generated tokens fill the context of 32 tokens (context_len) before " \
            "max_tokens (8): batch rows do not go past it"
    assert cut_error == words.format(p=CONTEXT - 5, g=5) and none_error == words.format(p=CONTEXT, g=0)


# ---- chat messages: their other keys reach the template, as transformers passes them --------------
# The mlx_lm backend refused a message with any key but role and content (TypeError); the metal backend
# passed every other key to the template, whatever its key or value. Both now pass string keys with
# JSON values as they are (None as if absent), and refuse the rest (BAD_CALLS).
NAMED_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}{% if m.name is defined %} ({{ m.name }}){% endif %}: "
                  "{{ m['content'] }}{% if m.tool_calls is defined %} calls {{ m.tool_calls | tojson }}{% endif %}"
                  "{% if m['x-trace'] is defined %} [{{ m['x-trace'] }}]{% endif %}{{ '\\n' }}{% endfor %}"
                  "{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.fixture(scope="module")
def named_template_models(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, TextModel]]:
    yield from _template_models(tmp_path_factory, "named", NAMED_TEMPLATE)


def test_extra_message_keys_reach_the_template_alike(named_template_models: dict[str, TextModel]) -> None:
    from pymlxc.backends.metal.chat_template import render_chat

    plain = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"},
             {"role": "user", "content": "and?"}]
    calls = [{"type": "function", "function": {"name": "f", "arguments": {"city": "Oslo"}}}]
    extra = [{**plain[0], "name": "bob", "x-trace": 7}, {**plain[1], "tool_calls": calls},
             Message(role="user", content="and?")]
    unset = [{**plain[0], "name": None}, plain[1], plain[2]]  # None: as if absent (transformers drops it)
    seen = {}
    for name, m in named_template_models.items():
        lengths = [m.prompt_length(messages) for messages in (plain, extra, unset)]
        ids = [[t.id for t in m.chat(messages, max_tokens=6)] for messages in (plain, extra, unset)]
        assert m.err() is None, name
        seen[name] = (lengths, ids, m.metrics().prompt_tokens)
    assert seen["metal"] == seen["mlx_lm"]
    (plain_len, extra_len, unset_len), ids, _ = seen["metal"]
    assert extra_len > plain_len == unset_len and ids[2] == ids[0]
    metal: Any = named_template_models["metal"]
    text = render_chat(extra, metal.tokenizer)  # what both rendered: the same count and greedy tokens
    assert text.startswith('user (bob): hi [7]\nassistant: yes calls [{"type": "function", "function": '
                           '{"name": "f", "arguments": {"city": "Oslo"}}}]\nuser: and?\nassistant:')
    assert len(metal.encode(text, add_special_tokens=False)) == extra_len

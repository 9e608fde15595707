"""The native backend's stream, err() and close() rules (pymlxc.model.TextModel's docstring) on tiny
random checkpoints: errors raised or kept, err() holding no arrays, tokens given at once, the calls'
checks of prompts and token ids. Cases that could hang or crash are in tests/reliability/test_lifetime.py."""
from __future__ import annotations

import dataclasses
import gc
import threading
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pymlxc
import pymlxc.core as mx
from pymlxc import GenerationCancelled, ModelClosedError
from pymlxc.backends.metal.memory_check import DeviceMemoryError
from pymlxc.backends.metal.textmodel import _tokens
from pymlxc.backends.metal.tokenizer import BYTE_LEVEL, Tokenizer
from pymlxc.testing import write_tiny_model

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("lifetime") / "llama", "llama", seed=3)


@pytest.fixture(scope="module")
def model(model_dir: Path):
    # No prompt cache: it keeps caches on purpose, which would blur the memory counts.
    with pymlxc.load_model(str(model_dir), backend="metal", prompt_cache_entries=0) as m:
        yield m


def _byte_tokens(tokenizer: Tokenizer, data: bytes) -> list[int]:
    """One byte-level token per byte of `data`."""
    spelling = {b: c for c, b in BYTE_LEVEL.items()}
    return [tokenizer.token_to_id(spelling[b]) for b in data]


def _settled_memory() -> int:
    gc.collect()
    mx.clear_cache()
    return mx.get_active_memory()


# ---------------------------------------------------------------------- errors from a stream

def test_an_error_inside_a_stream_is_raised_and_kept(model_dir: Path) -> None:
    # A real failure: the KV cache of 2**30 new tokens cannot fit (the memory check before prefill).
    with pymlxc.load_model(str(model_dir), backend="metal", prompt_cache_entries=0, context_len=2**30) as m:
        stream = m.generate(PROMPT, max_tokens=2**30)
        with pytest.raises(DeviceMemoryError, match="max_tokens") as raised:
            for _ in stream:
                pass
        kept = m.err()
        assert isinstance(kept, DeviceMemoryError) and str(kept) == str(raised.value)
        assert kept.__traceback__ is None and raised.value.__traceback__ is not None
        assert list(stream) == []  # the stream has ended
        assert list(m.generate(PROMPT, max_tokens=3)) and m.err() is None  # reset by the next call


def test_cancellation_and_close_end_the_stream_quietly(model_dir: Path, model) -> None:
    cancel = threading.Event()
    got = []
    for token in model.generate(PROMPT, max_tokens=50, cancel=cancel):  # no exception
        got.append(token)
        cancel.set()
    assert len(got) == 1 and isinstance(model.err(), GenerationCancelled)
    with pymlxc.load_model(str(model_dir), backend="metal") as m:
        stream = m.generate(PROMPT, max_tokens=50)
        next(stream)
        m.close()
        assert list(stream) == []
        assert isinstance(m.err(), ModelClosedError)



def test_chat_timeout_counts_from_the_call(model) -> None:
    # chat() renders its template at the call, under the call's timeout; the stream keeps that
    # deadline instead of starting a second full timeout when it is first iterated.
    stream = model.chat([{"role": "user", "content": "hi"}], max_tokens=50, timeout=0.3)
    time.sleep(0.5)
    assert list(stream) == []
    assert isinstance(model.err(), GenerationCancelled) and "timed out" in str(model.err())


# ---------------------------------------------------------------------- err() holds no arrays

def test_err_after_a_cancelled_generation_holds_no_arrays(model) -> None:
    list(model.generate(PROMPT, max_tokens=40))
    assert model.err() is None
    after_complete = _settled_memory()
    cancel = threading.Event()
    for n, _ in enumerate(model.generate(PROMPT, max_tokens=40, cancel=cancel)):
        if n == 20:
            cancel.set()
    assert isinstance(model.err(), GenerationCancelled)
    assert model.err().__traceback__ is None and model.err().__context__ is None
    # The cancelled generation's KV cache is gone although err() still reports it.
    assert _settled_memory() == after_complete


def test_err_after_close_with_a_paused_stream_holds_no_arrays(model_dir: Path) -> None:
    baseline = _settled_memory()
    m = pymlxc.load_model(str(model_dir), backend="metal", prompt_cache_entries=0)
    stream = m.generate(PROMPT, max_tokens=100)
    for _ in range(30):
        next(stream)
    m.close()
    assert list(stream) == []
    del stream
    assert isinstance(m.err(), ModelClosedError)
    assert _settled_memory() == baseline  # weights and the paused stream's cache both gone


# ---------------------------------------------------------------------- tokens at once

def test_each_token_is_yielded_before_the_next_id_is_read(model_dir: Path) -> None:
    tokenizer = Tokenizer(model_dir)
    ids = tokenizer.encode("ok ", add_special_tokens=False) + _byte_tokens(tokenizer, "ä".encode())
    read: list[int] = []

    def source():
        for i in ids:
            read.append(i)
            yield i

    stream = _tokens(source(), tokenizer.detokenizer(), last=len(ids) + 1)
    texts = []
    for n, token in enumerate(stream, 1):
        assert len(read) == n  # nothing read ahead, nothing held back
        texts.append(token.text)
    assert "".join(texts) == tokenizer.decode(ids) == "ok ä"
    assert texts[-2:] == ["", "ä"]


def test_the_last_token_of_max_tokens_carries_an_unfinished_character(model_dir: Path) -> None:
    tokenizer = Tokenizer(model_dir)
    ids = tokenizer.encode("ok", add_special_tokens=False) + _byte_tokens(tokenizer, "ä".encode()[:1])
    texts = [t.text for t in _tokens(iter(ids), tokenizer.detokenizer(), last=len(ids))]
    assert "".join(texts) == tokenizer.decode(ids) == "ok\ufffd"


def test_stream_texts_add_up_to_the_decode(model) -> None:
    tokens = list(model.generate("héllo wörld 你好 🙂", max_tokens=40, temperature=1.5, seed=5))
    assert len(tokens) == 40
    assert "".join(t.text for t in tokens) == model.decode([t.id for t in tokens])


# ---------------------------------------------------------------------- checks at the call

@settings(max_examples=25, deadline=None)
@given(before=st.text(max_size=8), after=st.text(max_size=8), surrogate=st.integers(0xD800, 0xDFFF))
def test_a_lone_surrogate_names_its_position(model, before: str, after: str, surrogate: int) -> None:
    prompt = before + chr(surrogate) + after
    with pytest.raises(ValueError, match=f"the prompt has a lone surrogate .* at position {len(before)}"):
        model.generate(prompt)
    with pytest.raises(ValueError, match=f"position {len(before)}"):
        model.classify(["fine", prompt])
    with pytest.raises(ValueError, match=f"message 1's content has a lone surrogate .* at position {len(before)}"):
        model.chat([{"role": "user", "content": "hi"}, {"role": "assistant", "content": prompt}])


def test_token_ids_outside_the_vocabulary_name_the_id(model) -> None:
    vocab = model.info().vocab_size
    for call in (model.warm_prompt_cache, model.inspect_attention):
        with pytest.raises(ValueError, match=f"token id {vocab} \\(position 1 of the prompt\\).* of {vocab}"):
            call([1, vocab, 2])
        with pytest.raises(ValueError, match="token id -1 "):
            call([-1])


def test_text_whose_ids_pass_the_embedding_is_refused_at_the_call(model_dir: Path) -> None:
    # A tokenizer with more ids than the embedding has rows (the loader refuses such a checkpoint;
    # the call's check stands on its own): here the rows are cut to 100 after loading.
    with pymlxc.load_model(str(model_dir), backend="metal") as m:
        ids = m.encode(PROMPT)
        assert max(ids) >= 100
        m._info = dataclasses.replace(m.info(), vocab_size=100)
        for call in (lambda: m.generate(PROMPT), lambda: m.classify([PROMPT]),
                     lambda: m.batch_generate(["hi", PROMPT]),
                     lambda: m.chat([{"role": "user", "content": PROMPT}])):
            with pytest.raises(ValueError, match="outside the model's vocabulary of 100"):
                call()


def test_a_call_behind_its_own_paused_stream_raises(model_dir: Path) -> None:
    with pymlxc.load_model(str(model_dir), backend="metal", parallel_slots=2) as m:
        first, second = m.generate(PROMPT, max_tokens=20), m.generate(PROMPT, max_tokens=20)
        next(first)
        assert len(list(m.generate("hi", max_tokens=3))) == 3  # one slot is still free
        next(second)
        with pytest.raises(RuntimeError, match="parallel_slots"):
            m.classify(["hi"])
        with pytest.raises(RuntimeError, match="parallel_slots"):
            next(m.generate("hi", max_tokens=3))
        assert isinstance(m.err(), RuntimeError)
        first.close()
        assert len(m.classify(["hi"])) == 1
        second.close()

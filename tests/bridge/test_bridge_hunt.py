"""The worker and its client where they used to fail: a context_len past int32 that loaded and then
broke every batch, a request line past the worker's limit that hung its caller and killed a healthy
worker, and batch pieces of the byte 0x00 that did not join into the decode."""
from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from bridge_raw_worker import RawWorker  # type: ignore[import-not-found]
from hypothesis import given, settings
from hypothesis import strategies as st

from pymlxc.bridge import protocol as P

FUZZ = settings(max_examples=200, deadline=None)
INT32_MAX = 2**31 - 1


# ---- context_len past int32 ----------------------------------------------------------------------


@FUZZ
@given(st.integers(min_value=-(2**70), max_value=2**70) | st.sampled_from([0, 1, INT32_MAX, INT32_MAX + 1, 2**63]))
def test_load_takes_context_len_only_within_int32(value: int) -> None:
    message = {"cmd": "load", "path": "/m", "context_len": value}
    if 1 <= value <= INT32_MAX:
        assert P.parse_request(message).args["context_len"] == value
    else:
        with pytest.raises(P.ProtocolError) as e:
            P.parse_request(message)
        assert e.value.code == "bad_field" and "context_len" in str(e.value)


def test_a_context_len_past_int32_is_refused_at_load_and_the_largest_one_runs_batches(
    start_worker: Any, tiny_model: Path
) -> None:
    """It used to load, and then every batch_generate and classify failed with "std::bad_cast" or
    "Converting ... to int32 would result in overflow", naming no field."""
    worker: RawWorker = start_worker()
    for value in (INT32_MAX + 1, 2**63):
        reply = worker.request(cmd="load", id="big", path=str(tiny_model), context_len=value)
        assert reply["type"] == "error" and reply["error"] == "bad_field", reply
        assert "context_len" in reply["message"] and str(INT32_MAX) in reply["message"], reply
    assert worker.request(cmd="load", id="L", path=str(tiny_model), context_len=INT32_MAX)["type"] == "result"
    batch = worker.request(cmd="batch_generate", id="b", prompts=["hello", "a b"], max_tokens=2)
    assert batch["type"] == "result" and all(r["finish_reason"] == "length" for r in batch["results"]), batch
    classify = worker.request(cmd="classify", id="c", prompts=["hello"])
    assert classify["type"] == "result", classify


# ---- a request line past the worker's --max-line-bytes ------------------------------------------------

LINE_LIMIT = 4096


@pytest.fixture(scope="module")
def limited_model(tiny_model: Path) -> Iterator[Any]:
    """The client's model over one worker that reads lines of at most LINE_LIMIT bytes; a short
    response timeout, so that a call waiting on a reply that never comes fails within seconds."""
    from pymlxc.backends.mlx_lm.textmodel import MlxLmModel
    from pymlxc.options import LoadConfig

    model = MlxLmModel(str(tiny_model), LoadConfig(), python=sys.executable, response_timeout=5.0,
                       load_timeout=60.0, startup_timeout=30.0, worker_args=("--max-line-bytes", str(LINE_LIMIT)))
    yield model
    model.close()


def test_a_request_past_the_workers_line_limit_raises_at_once_and_keeps_the_worker(limited_model: Any) -> None:
    """The worker skips such a line unread and refuses it without an id: the call used to wait the
    whole response timeout for a reply to its id, then kill the healthy worker as stalled."""
    pids = limited_model.worker_pids()
    start = time.monotonic()
    with pytest.raises(ValueError, match=f"limit of {LINE_LIMIT}"):
        list(limited_model.generate("word " * LINE_LIMIT, max_tokens=2))
    with pytest.raises(ValueError, match=f"limit of {LINE_LIMIT}"):
        limited_model.batch_generate(["a" * (LINE_LIMIT // 2), "b" * (LINE_LIMIT // 2)], max_tokens=2)
    assert time.monotonic() - start < 2.0
    assert limited_model.worker_pids() == pids
    assert len(list(limited_model.generate("hello", max_tokens=3))) == 3  # the same worker still serves


@settings(max_examples=15, deadline=None)
@given(st.integers(min_value=LINE_LIMIT - 120, max_value=LINE_LIMIT + 40))
def test_a_request_just_inside_the_line_limit_is_served_and_one_past_it_refused(
    limited_model: Any, size: int
) -> None:
    """The client's bound is the worker's: a line of LINE_LIMIT bytes (without its newline) is read,
    one byte more is refused before it is sent; neither waits on the worker or kills it."""
    text = "x" * size
    pids = limited_model.worker_pids()
    # The line the client sends, but for its id: a count of this module's calls, of 1 to 3 digits.
    rest = len(P.encode({"cmd": "encode", "id": 0, "text": text, "add_special_tokens": True})) - 2
    try:
        tokens = limited_model.encode(text)
    except ValueError as e:
        assert "limit of" in str(e) and rest + 3 > LINE_LIMIT, e
    else:
        assert tokens and rest + 1 <= LINE_LIMIT
    assert limited_model.worker_pids() == pids


# ---- batch pieces of the byte 0x00 ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tiny_model: Path) -> Any:
    pytest.importorskip("mlx_lm")
    from pymlxc.bridge.engine import Engine

    return Engine(str(tiny_model), None, None, None)


def _byte_zero_id(engine: Any) -> int:
    """The id of the byte-level token that spells the byte 0x00 ("\u0100" in GPT-2's alphabet)."""
    return int(engine.tokenizer.convert_tokens_to_ids("\u0100"))


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_batch_pieces_join_into_the_decode_with_byte_zero(engine: Any, data: st.DataObject) -> None:
    """mlx-lm's BPE detokenizer took the byte 0x00 for the letter "\u0100": batch_generate's pieces
    had "\u0100" where the decode (and generate's stream) has "\\x00"."""
    zero = _byte_zero_id(engine)
    assert engine.tokenizer.decode([zero]) == "\x00"
    ids = data.draw(st.lists(st.integers(0, engine.vocab_size - 1) | st.just(zero), min_size=1, max_size=8))
    pieces = engine._pieces(ids)
    assert [p["token_id"] for p in pieces] == ids
    assert "".join(p["token"] for p in pieces) == engine.tokenizer.decode(ids)


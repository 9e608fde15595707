"""The worker process over its pipes: handshake, refusals, streaming, cancel, and staying alive."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from pymlxc.bridge import protocol as P

from bridge_raw_worker import BRIDGE_DIR, RawWorker  # type: ignore[import-not-found]

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def idle_worker() -> Any:
    """A worker with no model: it still validates every line (and answers fast, without mlx-lm)."""
    worker = RawWorker("--max-line-bytes", "4096")
    yield worker
    worker.close()


def _is_quit(line: bytes) -> bool:
    try:
        return P.parse_request(P.decode(line)).cmd == "quit"
    except P.ProtocolError:
        return False


def test_hello_comes_first_with_the_protocol_version(idle_worker: RawWorker) -> None:
    assert idle_worker.hello["type"] == "hello"
    assert idle_worker.hello["protocol"] == P.PROTOCOL_VERSION
    assert idle_worker.hello["pid"] == idle_worker.proc.pid


@FUZZ
@given(st.binary(max_size=300).filter(lambda b: b"\n" not in b))
def test_any_byte_line_gets_one_terminal_reply_and_the_worker_lives(idle_worker: RawWorker, line: bytes) -> None:
    assume(not _is_quit(line))
    idle_worker.send_raw(line + b"\n")
    reply = idle_worker.read()
    assert reply["type"] in ("error", "result")
    assert idle_worker.proc.poll() is None


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=10,
)
near_requests = st.dictionaries(
    st.sampled_from(["cmd", "id", "prompt", "prompts", "max_tokens", "tokens", "text", "messages", "path"]) | st.text(max_size=8),
    json_values | st.sampled_from(list(P.COMMANDS)),
    max_size=5,
)


@FUZZ
@given(json_values | near_requests)
def test_any_json_value_gets_one_terminal_reply_echoing_its_id(idle_worker: RawWorker, value: Any) -> None:
    line = json.dumps(value).encode()
    assume(not _is_quit(line))
    idle_worker.send_raw(line + b"\n")
    reply = idle_worker.read()
    assert reply["type"] in ("error", "result")
    if isinstance(value, dict) and P.request_id(value) is not None:
        assert reply["id"] == value["id"]
    assert idle_worker.proc.poll() is None


def test_an_oversized_line_is_refused_and_the_next_line_served(idle_worker: RawWorker) -> None:
    idle_worker.send_raw(b'{"cmd": "info", "pad": "' + b"x" * 20_000 + b'"}\n')
    reply = idle_worker.read()
    assert reply["type"] == "error" and reply["error"] == "line_too_long"
    assert idle_worker.request(cmd="encode", id=9, text="hi") == {
        "type": "error", "id": 9, "cmd": "encode", "error": "no_model", "message": "no model is loaded; send a load command first",
    }


def test_commands_needing_a_model_say_so_and_loading_a_missing_path_fails(idle_worker: RawWorker) -> None:
    for cmd, fields in [("generate", {"prompt": "x"}), ("info", {}), ("decode", {"tokens": [1]})]:
        assert idle_worker.request(cmd=cmd, id=cmd, **fields)["error"] == "no_model"
    reply = idle_worker.request(cmd="load", id="L", path="/nonexistent/model")
    assert reply["error"] == "load_failed" and "/nonexistent/model" in reply["message"]


def test_stdout_stays_protocol_only_when_python_and_c_print() -> None:
    # Whatever prints after the worker claims stdout, from Python or through fd 1, lands on stderr.
    code = (
        "import os, sys; sys.path.insert(0, sys.argv[1]);"
        "from bridge.channel import claim_stdout, LineWriter;"
        "w = LineWriter(claim_stdout()); print('python noise'); os.write(1, b'fd noise\\n');"
        "w.send({'type': 'hello', 'protocol': 1})"
    )
    done = subprocess.run([sys.executable, "-c", code, str(BRIDGE_DIR.parent)], capture_output=True, timeout=30)
    assert done.stdout == b'{"type":"hello","protocol":1}\n'
    assert b"python noise" in done.stderr and b"fd noise" in done.stderr


def test_quit_and_end_of_input_end_the_worker_cleanly(start_worker: Any) -> None:
    worker = start_worker()
    assert worker.request(cmd="quit", id="q") == {"type": "result", "id": "q", "cmd": "quit"}
    assert worker.proc.wait(timeout=10) == 0
    worker = start_worker()
    worker.proc.stdin.close()
    assert worker.proc.wait(timeout=10) == 0


# ---- with a model ----------------------------------------------------------------------------------


def _tokens(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [line for line in lines if line["type"] == "token"]


def test_generate_streams_token_lines_then_done_with_metrics(loaded_worker: RawWorker) -> None:
    loaded_worker.send(cmd="generate", id="g", prompt="The baker", max_tokens=6)
    lines = loaded_worker.until_terminal("g")
    done = lines[-1]
    assert done["type"] == "done" and done["finish_reason"] == "length"
    assert [line["type"] for line in lines if line["type"] != "progress"] == ["token"] * 6 + ["done"]
    assert done["generation_tokens"] == 6 and done["prompt_tokens"] > 0
    assert done["prompt_tps"] > 0 and done["generation_tps"] > 0 and done["peak_memory_bytes"] > 0
    text = "".join(t["token"] for t in _tokens(lines))
    decoded = loaded_worker.request(cmd="decode", id="d", tokens=[t["token_id"] for t in _tokens(lines)])
    assert decoded["text"].strip() == text.strip()  # mlx-lm's streaming detokenizer drops a leading space


def test_a_stop_token_ends_the_stream_without_being_sent(loaded_worker: RawWorker) -> None:
    loaded_worker.send(cmd="generate", id="a", prompt="The baker", max_tokens=5)
    free = [t["token_id"] for t in _tokens(loaded_worker.until_terminal("a"))]
    stop = free[2]
    loaded_worker.send(cmd="generate", id="b", prompt="The baker", max_tokens=5, stop_tokens=[stop])
    lines = loaded_worker.until_terminal("b")
    assert [t["token_id"] for t in _tokens(lines)] == free[: free.index(stop)]
    assert lines[-1]["finish_reason"] == "stop"


def test_cancel_stops_a_running_stream_and_queued_requests_only(loaded_worker: RawWorker) -> None:
    loaded_worker.send(cmd="generate", id="long", prompt="Once upon a time", max_tokens=100_000)
    loaded_worker.send(cmd="generate", id="queued", prompt="x", max_tokens=100_000)
    seen = [loaded_worker.read() for _ in range(4)]
    assert any(line["type"] == "token" for line in seen)
    loaded_worker.send(cmd="cancel", id="c")
    loaded_worker.send(cmd="generate", id="after", prompt="x", max_tokens=3)
    lines = loaded_worker.until_terminal("after")
    by_id = {(line["type"], line["id"]): line for line in lines}
    assert by_id[("result", "c")]["active"] is True
    assert by_id[("done", "long")]["finish_reason"] == "cancelled"
    assert by_id[("done", "queued")]["finish_reason"] == "cancelled"
    assert by_id[("done", "queued")]["generation_tokens"] == 0
    assert by_id[("done", "after")]["finish_reason"] == "length"
    streamed = [line for line in seen + lines if line["type"] == "token" and line["id"] == "long"]
    assert len(streamed) < 1000  # stopped at once, not after the whole budget


def test_cancel_when_idle_is_answered_and_harmless(loaded_worker: RawWorker) -> None:
    assert loaded_worker.request(cmd="cancel", id="c0") == {"type": "result", "id": "c0", "cmd": "cancel", "active": False}
    assert loaded_worker.request(cmd="generate", id="g", prompt="x", max_tokens=2)["finish_reason"] == "length"


def test_chat_classify_batch_encode_and_info(loaded_worker: RawWorker, tiny_model: Path) -> None:
    chat = loaded_worker.request(cmd="chat", id="c", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert chat["type"] == "done" and chat["generation_tokens"] == 3
    classify = loaded_worker.request(cmd="classify", id="k", prompts=["a", "bb b"], return_logits=True)
    assert len(classify["results"]) == 2
    vocab = loaded_worker.request(cmd="info", id="i")["info"]["vocab_size"]
    for item in classify["results"]:
        assert len(item["logits"]) == vocab
        assert max(range(vocab), key=item["logits"].__getitem__) == item["token_id"]  # greedy
    batch = loaded_worker.request(cmd="batch_generate", id="b", prompts=["a", "bb b", "ccc"], max_tokens=4)
    assert [len(r["tokens"]) for r in batch["results"]] == [4, 4, 4]
    assert all(r["finish_reason"] == "length" and r["error"] is None for r in batch["results"])
    encoded = loaded_worker.request(cmd="encode", id="e", text="hello", add_special_tokens=False)["tokens"]
    assert loaded_worker.request(cmd="decode", id="d", tokens=encoded)["text"] == "hello"
    bad = loaded_worker.request(cmd="decode", id="d2", tokens=[vocab + 5])
    assert bad["error"] == "bad_field"
    info = loaded_worker.request(cmd="info", id="i2")
    assert info["model_type"] == "llama" and info["path"] == str(tiny_model)


sampling_values = st.fixed_dictionaries(
    {"max_tokens": st.integers(0, 4) | json_values},
    optional={
        "temperature": st.floats(0, 3) | json_values,
        "top_k": st.integers(0, 2000) | json_values,  # past the vocabulary of 512 too
        "top_p": st.floats(0, 1) | json_values,
        "min_p": st.floats(0, 1) | json_values,
        "repeat_penalty": st.floats(0.1, 3) | json_values,
        "stop_tokens": st.lists(st.integers(0, 600), max_size=3) | json_values,
        "seed": st.integers(0, 2**31) | json_values,
        "return_logits": st.booleans() | json_values,
    },
)


@FUZZ
@given(st.sampled_from(["generate", "chat", "classify", "batch_generate"]), sampling_values)
def test_sampling_fields_of_any_value_get_a_stream_or_an_error(loaded_worker: RawWorker, cmd: str, fields: dict[str, Any]) -> None:
    body = {"generate": {"prompt": "ab"}, "chat": {"messages": [{"role": "user", "content": "ab"}]}}.get(cmd, {"prompts": ["ab", "c"]})
    if type(fields.get("max_tokens")) is int:  # a valid count runs that many steps: keep the run short
        fields["max_tokens"] = min(fields["max_tokens"], 2 if cmd in ("classify", "batch_generate") else 4)
    loaded_worker.send(cmd=cmd, id="f", **body, **fields)
    last = loaded_worker.until_terminal("f")[-1]
    assert last["type"] in ("done", "result", "error")
    if last["type"] == "error":
        assert last["error"] == "bad_field" and last["message"]  # valid values never make mlx-lm fail
    assert loaded_worker.proc.poll() is None


def test_recover_repairs_the_random_state_a_failed_compiled_sampler_leaves() -> None:
    mx = pytest.importorskip("mlx.core")
    from mlx_lm.sample_utils import make_sampler

    from pymlxc.bridge.engine import Engine

    logprobs = mx.log(mx.softmax(mx.arange(8, dtype=mx.float32)[None], axis=-1))
    with pytest.raises(ValueError):
        make_sampler(0.5, top_k=100)(logprobs)  # raises inside mx.compile, with mx.random.state captured
    with pytest.raises(RuntimeError):
        mx.eval(make_sampler(0.5)(logprobs))  # ...which poisons every later sample
    Engine.recover(object.__new__(Engine))
    assert 0 <= make_sampler(0.5)(logprobs).item() < 8

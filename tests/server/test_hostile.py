"""The server driven as a careless or hostile client would: clients that leave before their answer,
a worker that dies mid-stream, a server stopped under load, and bodies whose errors must name the
field. Real server processes on loopback, real clients (httpx, `openai`)."""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

try:
    import httpx
except ImportError:  # the openai client's HTTP library under its newer name
    import httpx2 as httpx  # type: ignore[no-redef]
import openai
import pytest

from .conftest import API_KEY, Server, start_server, stop_server

HEADERS = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
# A logit bias that makes one ordinary token win every step: the answer never reaches a stop id,
# so it runs to max_tokens (seconds of decoding for 8000 tokens).
ENDLESS = {"logit_bias": {"65": 100}}


def _post(server: Server, endpoint: str, body: bytes | dict[str, Any], **headers: str) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{server.url}/v1/{endpoint}", content=content, headers={**HEADERS, **headers}, timeout=60)


def _wait_idle(server: Server, seconds: float = 10) -> dict[str, Any]:
    deadline = time.monotonic() + seconds
    while (now := server.health())["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    return now


def _error(response: httpx.Response) -> dict[str, Any]:
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    return error


# ---- clients that leave ------------------------------------------------------------------------------


def test_a_client_that_leaves_before_its_whole_answer_frees_its_row(server: Server) -> None:
    # A non-streamed answer is sent only at its end: a client that times out before then is gone,
    # and its generation must stop rather than run on to max_tokens for nobody.
    assert _wait_idle(server)["running"] == 0
    body = {"prompt": "Tell me everything", "max_tokens": 8000, "temperature": 0, **ENDLESS}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{server.url}/v1/completions", json=body, headers=HEADERS, timeout=1.0)
    now = _wait_idle(server, 3)
    assert now["running"] == 0, now
    steps = now["steps"]
    time.sleep(0.3)
    assert server.health()["steps"] == steps  # nothing decodes for the gone client
    assert _post(server, "completions", {"prompt": "x", "max_tokens": 2}).status_code == 200


def test_a_streaming_client_that_leaves_while_queued_is_never_run(model_dir: Path, tmp_path: Path) -> None:
    # Waiting in the queue, no piece has come yet: the client's leaving must be seen then, not only
    # once its stream has started (else its long prompt is prefilled for nobody once a row frees).
    small = start_server(model_dir, "--max-concurrency", "1", "--max-tokens-limit", "8000", log=tmp_path / "q.log")
    try:
        busy = {"prompt": "first", "max_tokens": 8000, "temperature": 0, "stream": True, **ENDLESS}
        queued = {"prompt": list(range(100)) * 60, "max_tokens": 8000, "temperature": 0, "stream": True, **ENDLESS}
        with (
            httpx.Client(timeout=60) as http,
            http.stream("POST", f"{small.url}/v1/completions", json=busy) as first,
        ):
            lines = first.iter_lines()
            next(lines)
            with (
                pytest.raises(httpx.TimeoutException),  # waits behind the first, then leaves
                http.stream("POST", f"{small.url}/v1/completions", json=queued, timeout=1.0) as second,
            ):
                second.read()
            assert small.health()["queued"] == 1
        seen = []
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            now = small.health()
            seen.append((now["prefilling"], now["running"]))
            time.sleep(0.02)
        assert seen[-1] == (0, 0), seen
        assert all(prefilling == 0 for prefilling, _ in seen[len(seen) // 4:]), seen  # never prefilled
    finally:
        stop_server(small)


# ---- failures after the stream started ---------------------------------------------------------------


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found


@pytest.fixture
def mlx_lm_slots(model_dir: Path, tmp_path: Path) -> Iterator[Server]:
    running = start_server(model_dir, "--backend", "mlx_lm", "--context-len", "4096", "--max-concurrency", "1",
                           "--max-tokens-limit", "4000", log=tmp_path / "slots.log")
    yield running
    stop_server(running)


def test_a_worker_dying_mid_stream_ends_the_stream_with_an_error_and_is_replaced(mlx_lm_slots: Server) -> None:
    client = openai.OpenAI(base_url=f"{mlx_lm_slots.url}/v1", api_key="unused", max_retries=0, timeout=60)
    (worker,) = _children(mlx_lm_slots.process.pid)
    stream = client.completions.create(model="m", prompt="Hello", max_tokens=4000, temperature=0, stream=True)
    got = []
    with pytest.raises(openai.APIError) as caught:
        for chunk in stream:
            got.append(chunk)
            if len(got) == 3:
                os.kill(worker, signal.SIGKILL)
    # An error the client can read (OpenAI's error event), not a connection cut mid-body.
    assert "WorkerDied" in str(caught.value) or "killed" in str(caught.value), caught.value
    assert not isinstance(caught.value, openai.APIConnectionError)
    again = client.completions.create(model="m", prompt="Hello", max_tokens=3, temperature=0)
    assert again.usage.completion_tokens == 3  # a new worker serves the next request
    assert _children(mlx_lm_slots.process.pid) != [worker]


# ---- stopping the server -----------------------------------------------------------------------------


def test_stopping_the_server_answers_its_requests_in_flight(model_dir: Path, tmp_path: Path) -> None:
    stopping = start_server(model_dir, "--max-tokens-limit", "8000", log=tmp_path / "stop.log")
    got: dict[str, Any] = {}
    started = threading.Barrier(3)
    body = {"prompt": "Talk", "max_tokens": 8000, "temperature": 0, **ENDLESS}

    def streamed() -> None:
        try:
            with httpx.stream("POST", f"{stopping.url}/v1/completions", json={**body, "stream": True},
                              timeout=60) as r:
                lines = r.iter_lines()
                next(lines)
                started.wait()
                got["stream"] = [line for line in lines if line.startswith("data:")]
        except BaseException as exc:  # noqa: BLE001 - checked below
            got["stream"] = exc

    def whole() -> None:
        try:
            started.wait()
            got["whole"] = httpx.post(f"{stopping.url}/v1/completions", json=body, timeout=60)
        except BaseException as exc:  # noqa: BLE001 - checked below
            got["whole"] = exc

    threads = [threading.Thread(target=streamed), threading.Thread(target=whole)]
    try:
        for t in threads:
            t.start()
        started.wait()
        time.sleep(0.5)
        stopping.process.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(30)
        stopping.process.wait(30)
    finally:
        stop_server(stopping)
    lines = got["stream"]
    assert isinstance(lines, list), lines  # the body ended whole, not cut
    last = json.loads(lines[-1][5:])
    assert last["error"]["code"] == "server_shutting_down", last
    whole_answer = got["whole"]
    assert isinstance(whole_answer, httpx.Response), whole_answer
    assert whole_answer.status_code == 503, whole_answer.text
    assert _error(whole_answer)["code"] == "server_shutting_down"


# ---- errors that name the field ----------------------------------------------------------------------


@pytest.mark.parametrize(("field", "value"), [("temperature", 1e-9), ("temperature", 5e-324),
                                              ("repetition_penalty", 1e-300), ("min_p", 5e-324)])
def test_a_value_the_sampler_refuses_is_a_400_naming_its_field(server: Server, field: str, value: float) -> None:
    got = _post(server, "completions", {"prompt": "Hi", "max_tokens": 2, field: value})
    assert got.status_code == 400, got.text
    assert _error(got)["param"] == field


@pytest.mark.parametrize(("endpoint", "body", "param", "says"), [
    ("completions", {"prompt": None}, "prompt", "string"),
    ("completions", {"prompt": "x", "stop": [1]}, "stop.0", "string"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages.0.content.0.type", "'text'"),
    ("chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages.0.content", "string"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "function"}},
     "tool_choice.function", "required"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "sometimes"},
     "tool_choice", "'required'"),
])
def test_a_wrong_type_inside_a_union_names_the_field_itself(server: Server, endpoint: str, body: dict[str, Any],
                                                             param: str, says: str) -> None:
    got = _post(server, endpoint, {"max_tokens": 2, **body})
    assert got.status_code == 400, got.text
    error = _error(got)
    assert error["param"] == param, error
    assert says in error["message"], error


def test_stop_strings_are_limited_in_number(server: Server) -> None:
    # Each is searched for after every token on the event loop that serves everyone: a 1 MB list of
    # them stalled every other client for the whole answer.
    many = _post(server, "completions", {"prompt": "Hi", "max_tokens": 2, "stop": [f"s{i}" for i in range(65)]})
    assert many.status_code == 400, many.text
    assert _error(many)["param"] == "stop" and "64" in _error(many)["message"]
    assert _post(server, "completions", {"prompt": "Hi", "max_tokens": 2,
                                         "stop": [f"s{i}" for i in range(64)]}).status_code == 200


def test_top_logprobs_without_logprobs_is_refused(server: Server) -> None:
    """As OpenAI answers it: an answer without the log-probabilities asked for would be silently short."""
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    got = _post(server, "chat/completions", {**chat, "top_logprobs": 3})
    assert got.status_code == 400, got.text
    assert _error(got)["param"] == "top_logprobs" and "logprobs" in _error(got)["message"]
    fine = _post(server, "chat/completions", {**chat, "top_logprobs": 3, "logprobs": True})
    assert fine.status_code == 200, fine.text
    assert len(fine.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 3


@pytest.mark.parametrize("role", ["user", "system", "tool"])
def test_a_message_without_content_is_refused(server: Server, role: str) -> None:
    got = _post(server, "chat/completions", {"messages": [{"role": role}], "max_tokens": 2})
    assert got.status_code == 400, got.text
    assert _error(got)["param"] == "messages.0.content"
    # An assistant turn that calls tools has no content, as OpenAI's history sends it.
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    history = [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": calls},
               {"role": "tool", "tool_call_id": "c1", "content": "5"}]
    assert _post(server, "chat/completions", {"messages": history, "max_tokens": 2}).status_code == 200


def test_a_json_body_without_its_content_type_is_read_as_json(server: Server) -> None:
    # `curl -d '{...}'` sends application/x-www-form-urlencoded.
    body = b'{"prompt": "Hi", "max_tokens": 2}'
    for kind in ("application/x-www-form-urlencoded", "text/plain"):
        got = _post(server, "completions", body, **{"Content-Type": kind})
        assert got.status_code == 200, got.text
    bad = _post(server, "completions", b"prompt=Hi", **{"Content-Type": "application/x-www-form-urlencoded"})
    assert bad.status_code == 400 and _error(bad)["code"] == "invalid_json"


@pytest.mark.parametrize("body", [b'{"prompt": "\xff\xfe", "max_tokens": 2}',
                                  b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}",
                                  b'{"prompt": "x", "max_tokens": 2, "a": ' + b"[" * 5000 + b"]" * 5000 + b"}"])
def test_a_body_python_cannot_read_as_json_is_an_invalid_json_400(server: Server, body: bytes) -> None:
    got = _post(server, "completions", body)
    assert got.status_code == 400, got.text
    assert _error(got)["code"] == "invalid_json"


def test_the_server_still_serves_after_the_abuse(server: Server) -> None:
    assert _post(server, "completions", {"prompt": "x", "max_tokens": 2}).json()["usage"]["completion_tokens"] == 2
    assert _wait_idle(server)["running"] == 0

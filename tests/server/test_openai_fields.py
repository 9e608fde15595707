"""OpenAI's request fields as its clients send them, and the answers' fields as they read them: null
for an optional field, fields this server cannot honour, log-probabilities that JSON can carry and
that a stream gives as its whole answer does. A real server process on loopback, raw bodies (httpx)."""
from __future__ import annotations

import json
import math
from typing import Any

try:
    import httpx
except ImportError:  # the openai client's HTTP library under its newer name
    import httpx2 as httpx  # type: ignore[no-redef]
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .conftest import API_KEY, Server

HEADERS = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
CHAT = {"messages": [{"role": "user", "content": "Weather?"}]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}}}]


def _strict_json(text: str) -> Any:
    """JSON as the standard has it: Python's reader also takes NaN and Infinity, which others refuse."""
    def refuse(constant: str) -> Any:
        raise ValueError(f"{constant} is not JSON")
    return json.loads(text, parse_constant=refuse)


def _post(server: Server, endpoint: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/{endpoint}", content=json.dumps(body).encode(), headers=HEADERS, timeout=120)


def _events(server: Server, endpoint: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """A streamed answer's events, each read as strict JSON."""
    with httpx.stream("POST", f"{server.url}/v1/{endpoint}", json={**body, "stream": True}, headers=HEADERS,
                      timeout=120) as response:
        assert response.status_code == 200, response.read()
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [_strict_json(line) for line in lines[:-1]]


def _error(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    return error


# ---- null is the default -----------------------------------------------------------------------------

NULLABLE = {
    "completions": ["temperature", "top_p", "n", "stream", "stop", "presence_penalty", "frequency_penalty",
                    "logit_bias", "logprobs", "echo", "best_of", "suffix", "user", "stream_options", "top_k",
                    "min_p", "repetition_penalty"],
    "chat/completions": ["temperature", "top_p", "n", "stream", "stop", "presence_penalty", "frequency_penalty",
                         "logit_bias", "logprobs", "top_logprobs", "stream_options", "response_format", "tools",
                         "tool_choice", "functions", "function_call", "max_completion_tokens"],
}


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), endpoint=st.sampled_from(sorted(NULLABLE)))
def test_a_null_field_is_its_default(server: Server, data: st.DataObject, endpoint: str) -> None:
    # OpenAI's optional fields are nullable, and clients send null for "not set": the answer is the
    # one the field left out gives (the same seed, the same tokens).
    nulls = data.draw(st.sets(st.sampled_from(NULLABLE[endpoint]), min_size=1), label="nulls")
    base = {"prompt": "Once upon"} if endpoint == "completions" else CHAT
    body = {**base, "max_tokens": 6, "seed": 11}
    plain = _post(server, endpoint, body)
    nulled = _post(server, endpoint, {**body, **dict.fromkeys(nulls)})
    assert nulled.status_code == 200, nulled.text
    pick = (lambda r: r.json()["choices"][0]["text"]) if endpoint == "completions" else (
        lambda r: r.json()["choices"][0]["message"]["content"])
    assert pick(nulled) == pick(plain)


@pytest.mark.parametrize(("endpoint", "field"), [("completions", "prompt"), ("chat/completions", "messages")])
def test_a_null_required_field_is_still_refused(server: Server, endpoint: str, field: str) -> None:
    assert _error(_post(server, endpoint, {field: None, "max_tokens": 2}))["param"] == field


# ---- fields this server cannot honour -----------------------------------------------------------------


@pytest.mark.parametrize(("endpoint", "field", "value", "says"), [
    ("completions", "best_of", 2, "1"),
    ("completions", "suffix", " and they lived happily", "suffix"),
    ("chat/completions", "functions", [{"name": "f", "parameters": {"type": "object"}}], "tools"),
    ("chat/completions", "function_call", "auto", "tool_choice"),
    ("chat/completions", "function_call", {"name": "f"}, "tool_choice"),
])
def test_a_field_that_would_change_the_answer_unhonoured_is_refused(server: Server, endpoint: str, field: str,
                                                                     value: Any, says: str) -> None:
    # Ignored, each gives another answer than the one asked for (the functions never reach the model).
    base = {"prompt": "Once upon"} if endpoint == "completions" else CHAT
    error = _error(_post(server, endpoint, {**base, "max_tokens": 2, field: value}))
    assert error["param"] == field and says in error["message"], error


@pytest.mark.parametrize(("field", "value"), [("best_of", 1), ("suffix", "")])
def test_the_values_that_change_nothing_are_taken(server: Server, field: str, value: Any) -> None:
    assert _post(server, "completions", {"prompt": "Once", "max_tokens": 2, field: value}).status_code == 200


# ---- log-probabilities --------------------------------------------------------------------------------

ONE_ANSWER = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"enum": ["a"]}}}


def test_logprobs_of_tokens_a_constraint_forbids_are_openais_impossible_value(server: Server) -> None:
    # The grammar masks every token but one: the others' log-probability is -inf, which JSON cannot
    # carry (a stream's event said -Infinity, a whole answer null); OpenAI says -9999.0.
    body = {**CHAT, "max_tokens": 5, "temperature": 0, "logprobs": True, "top_logprobs": 5,
            "response_format": ONE_ANSWER}
    whole = _post(server, "chat/completions", body)
    assert whole.status_code == 200, whole.text
    entries = _strict_json(whole.text)["choices"][0]["logprobs"]["content"]
    streamed = [e for event in _events(server, "chat/completions", body) if event["choices"]
                for e in (event["choices"][0]["logprobs"] or {}).get("content") or []]
    assert "".join(e["token"] for e in entries) == '"a"'
    for got in (entries, streamed):
        assert [e["token"] for e in got] == [e["token"] for e in entries]
        values = [v for e in got for v in (e["logprob"], *(t["logprob"] for t in e["top_logprobs"]))]
        assert all(isinstance(v, float) and math.isfinite(v) for v in values), values
        assert -9999.0 in values  # the forbidden tokens among the top 5


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(st.sampled_from("日本語éßщ€😀"), min_size=1, max_size=3))
def test_logprob_bytes_join_into_the_answer(server: Server, text: str) -> None:
    # OpenAI's `bytes` are each token's own: a character split over tokens comes back by joining
    # them. The tiny vocabulary spells these characters byte by byte, each byte's decoded text
    # alone U+FFFD (bytes EF BF BD), which would join into nothing like the answer.
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    body: dict[str, Any] = {"model": "m", "messages": CHAT["messages"], "max_tokens": 40, "temperature": 0,
                            "logprobs": True, "top_logprobs": 2, "response_format": {
                                "type": "json_schema", "json_schema": {"name": "x", "schema": {"const": text}}}}
    whole = client.chat.completions.create(**body).choices[0]
    assert json.loads(whole.message.content) == text
    streamed = [e for chunk in client.chat.completions.create(**body, stream=True) if chunk.choices
                for e in (chunk.choices[0].logprobs.content or [] if chunk.choices[0].logprobs else [])]
    for entries in (whole.logprobs.content, streamed):
        assert b"".join(bytes(e.bytes) for e in entries) == whole.message.content.encode()
        for e in entries:  # a candidate that is whole characters: its bytes are its text's
            assert all(bytes(t.bytes).decode() == t.token for t in e.top_logprobs if "\ufffd" not in t.token)


def test_a_streamed_tool_call_keeps_the_logprobs_of_its_tokens(server: Server) -> None:
    # A stream holds back text that may be a tool call; the log-probabilities of its tokens come
    # with what it releases, as many as the whole answer has.
    body = {**CHAT, "tools": TOOLS, "tool_choice": "required", "max_tokens": 24, "temperature": 0,
            "logprobs": True}
    whole = _post(server, "chat/completions", body).json()["choices"][0]["logprobs"]["content"]
    events = _events(server, "chat/completions", {**body, "stream_options": {"include_usage": True}})
    streamed = [e for event in events if event["choices"]
                for e in (event["choices"][0]["logprobs"] or {}).get("content") or []]
    assert [e["token"] for e in streamed] == [e["token"] for e in whole]
    assert len(streamed) == events[-1]["usage"]["completion_tokens"]


def test_streamed_completion_logprobs_have_the_whole_answers_text_offsets(server: Server) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "logprobs": 2}
    whole = _post(server, "completions", body).json()["choices"][0]["logprobs"]
    streamed: dict[str, list[Any]] = {"tokens": [], "text_offset": []}
    for event in _events(server, "completions", body):
        logprobs = event["choices"][0]["logprobs"] if event["choices"] else None
        for key in streamed:
            streamed[key] += logprobs[key] if logprobs else []
    assert streamed == {"tokens": whole["tokens"], "text_offset": whole["text_offset"]}
    assert whole["text_offset"] == [sum(len(t) for t in whole["tokens"][:i]) for i in range(len(whole["tokens"]))]


# ---- errors that name the field -----------------------------------------------------------------------


@pytest.mark.parametrize(("body", "param"), [({"max_completion_tokens": 10**6}, "max_completion_tokens"),
                                             ({"max_tokens": 10**6}, "max_tokens"),
                                             ({"max_tokens": 2, "max_completion_tokens": 10**6},
                                              "max_completion_tokens")])
def test_a_token_limit_over_the_servers_names_the_field_given(server: Server, body: dict[str, Any],
                                                              param: str) -> None:
    error = _error(_post(server, "chat/completions", {**CHAT, **body}))
    assert error["param"] == param and error["message"].startswith(param), error


def test_an_empty_token_id_prompt_is_called_empty(server: Server) -> None:
    error = _error(_post(server, "completions", {"prompt": [], "max_tokens": 2}))
    assert (error["param"], error["message"]) == ("prompt", "prompt is empty")

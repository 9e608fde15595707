"""Requests whose errors must name the field that is wrong, a logit bias that names one token twice,
and browsers calling through CORS with OpenAI's SDK headers. Real server processes on loopback, the
official `openai` client (httpx for a CORS preflight, which no SDK sends)."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

try:
    import httpx
except ImportError:  # the openai client's HTTP library under its newer name
    import httpx2 as httpx  # type: ignore[no-redef]
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .conftest import API_KEY, Server, start_server, stop_server

MESSAGES = [{"role": "user", "content": "Weather in Rome?"}]
TOOLS: list[Any] = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
UNUSABLE_SCHEMA = {"type": "no-such-type"}
ORIGIN = "http://app.example"
# Headers a browser may send without a preflight's leave (the Fetch standard's CORS-safelisted ones,
# and those the browser sets itself): the preflight asks for every other header of the request.
SAFELISTED = {"accept", "accept-language", "content-language", "content-type", "host", "connection",
              "content-length", "accept-encoding", "user-agent", "origin"}


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


# ---- an error names the field at fault -------------------------------------------------------------


@pytest.mark.parametrize("tool_choice", ["auto", None])
def test_an_unusable_response_format_beside_tools_is_named_as_response_format(client: openai.OpenAI,
                                                                              tool_choice: str | None) -> None:
    # The tools are fine and not forced: the grammar that fails is response_format's.
    extra: dict[str, Any] = {} if tool_choice is None else {"tool_choice": tool_choice}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model="m", messages=MESSAGES, max_tokens=4, tools=TOOLS,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": UNUSABLE_SCHEMA}},
            **extra)
    assert caught.value.param == "response_format", caught.value.body


def test_an_unusable_forced_tool_is_named_as_tools(client: openai.OpenAI) -> None:
    bad_tools: list[Any] = [{"type": "function", "function": {"name": "f", "parameters": UNUSABLE_SCHEMA}}]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=4, tools=bad_tools,
                                       tool_choice="required")
    assert caught.value.param == "tools", caught.value.body


# ---- logit_bias ------------------------------------------------------------------------------------


AMOUNTS = st.floats(-100, 100).filter(lambda x: x == 0 or abs(x) > 1e-30)  # none the sampler refuses


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(token=st.integers(0, 400), amount=st.floats(min_value=1e-320, max_value=1e-39), negative=st.booleans())
def test_a_subnormal_logit_bias_is_a_400_naming_its_key(client: openai.OpenAI, token: int, amount: float,
                                                         negative: bool) -> None:
    # The sampler refuses a subnormal amount (as it does a subnormal penalty): the error says which
    # field and which key, not a position in the server's own list of pairs.
    key = str(token if token != 7 else 8)  # after an ordinary amount for token 7
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="m", prompt="Hi", max_tokens=2, temperature=0,
                                  logit_bias={"7": 1.0, key: -amount if negative else amount})
    assert caught.value.param == "logit_bias", caught.value.body
    assert f"logit_bias[{key}]" in caught.value.message, caught.value.message


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(token=st.integers(0, 400), zeros=st.integers(1, 3), first=AMOUNTS, second=AMOUNTS, padded_first=st.booleans())
def test_a_logit_bias_naming_one_token_twice_is_refused(client: openai.OpenAI, token: int, zeros: int,
                                                         first: float, second: float, padded_first: bool) -> None:
    # "65" and "065" are the same token: one of the two amounts would be dropped, silently.
    keys = [str(token), "0" * zeros + str(token)]
    if padded_first:
        keys.reverse()
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="m", prompt="Hi", max_tokens=2, temperature=0,
                                  logit_bias={keys[0]: first, keys[1]: second})
    assert caught.value.param == "logit_bias", caught.value.body
    assert str(token) in caught.value.message


def test_a_logit_bias_of_distinct_tokens_is_still_taken(client: openai.OpenAI) -> None:
    got = client.completions.create(model="m", prompt="Hi", max_tokens=3, temperature=0,
                                    logit_bias={"65": 100, "066": -100})
    assert got.usage is not None and got.usage.completion_tokens == 3


# ---- CORS --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cors_server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    running = start_server(model_dir, "--cors-origin", ORIGIN, "--api-key", API_KEY, "--max-body-bytes", "4096",
                           log=tmp_path_factory.mktemp("log") / "cors.log")
    yield running
    stop_server(running)


def test_a_browser_preflight_allows_the_openai_sdks_headers(cors_server: Server) -> None:
    # The headers OpenAI's SDK sends with a request, as a browser's preflight would ask for them.
    sent: list[httpx.Headers] = []
    with httpx.Client(event_hooks={"request": [lambda request: sent.append(request.headers)]}, timeout=60) as http:
        client = openai.OpenAI(base_url=f"{cors_server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60,
                               http_client=http, default_headers={"Origin": ORIGIN})
        raw = client.chat.completions.with_raw_response.create(model="m", messages=MESSAGES, max_tokens=2)
    assert raw.headers.get("access-control-allow-origin") == ORIGIN
    asked = sorted(name for name in sent[-1] if name.lower() not in SAFELISTED)
    assert "authorization" in asked and any(name.startswith("x-stainless") for name in asked), asked
    preflight = httpx.options(f"{cors_server.url}/v1/chat/completions", timeout=60, headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": ",".join(asked)})
    assert preflight.status_code == 200, preflight.text
    allowed = {h.strip().lower() for h in preflight.headers["access-control-allow-headers"].split(",")}
    assert set(asked) <= allowed, (asked, allowed)
    assert preflight.headers.get("access-control-allow-origin") == ORIGIN


def test_a_body_over_the_limit_is_a_413_a_browser_can_read(cors_server: Server) -> None:
    # Without CORS headers on the 413, the browser hides it: the page sees only a failed fetch.
    client = openai.OpenAI(base_url=f"{cors_server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60,
                           default_headers={"Origin": ORIGIN})
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x" * 8192}], max_tokens=2)
    assert caught.value.status_code == 413, caught.value.body
    assert caught.value.response.headers.get("access-control-allow-origin") == ORIGIN
    foreign = httpx.post(f"{cors_server.url}/v1/completions", content=b"x" * 8192, timeout=60,
                         headers={"Origin": "http://elsewhere.example", "Authorization": f"Bearer {API_KEY}"})
    assert foreign.status_code == 413
    assert "access-control-allow-origin" not in foreign.headers  # still only the origins given

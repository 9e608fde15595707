"""The OpenAI-compatible server end to end: a real server process, the official `openai` client."""
from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

try:
    import httpx
except ImportError:  # the openai client's HTTP library under its newer name
    import httpx2 as httpx  # type: ignore[no-redef]
import jsonschema
import openai
import pytest

import pymlxc

from .conftest import API_KEY, Server, start_server, stop_server

PROMPTS = [f"Request number {i}: tell me about {topic}" for i, topic in enumerate(
    ["cats", "dogs", "the sea", "mountains", "rain", "bread", "music", "stars",
     "rivers", "trains", "clocks", "maps", "salt", "glass", "wind", "paper"])]


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def local(model_dir):
    with pymlxc.load_model(str(model_dir), backend="metal") as model:
        yield model


def test_models_and_health(client: openai.OpenAI, server: Server) -> None:
    assert [m.id for m in client.models.list().data] == [str(server.model_dir)]
    assert server.health()["status"] == "ok"


def test_completion_equals_generate(client: openai.OpenAI, local) -> None:
    want = "".join(t.text for t in local.generate(PROMPTS[0], max_tokens=12))
    got = client.completions.create(model="m", prompt=PROMPTS[0], max_tokens=12, temperature=0)
    assert got.choices[0].text == want
    assert got.choices[0].finish_reason == "length"
    assert got.usage.completion_tokens == 12
    assert got.usage.prompt_tokens == len(local.encode(PROMPTS[0]))


def test_streamed_completion_equals_the_whole(client: openai.OpenAI) -> None:
    whole = client.completions.create(model="m", prompt=PROMPTS[1], max_tokens=16, temperature=0).choices[0].text
    chunks = list(client.completions.create(model="m", prompt=PROMPTS[1], max_tokens=16, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert chunks[-1].usage.completion_tokens == 16
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_equals_model_chat_and_streams(client: openai.OpenAI, local) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
    want = "".join(t.text for t in local.chat(messages, max_tokens=10))
    got = client.chat.completions.create(model="m", messages=messages, max_tokens=10, temperature=0)
    assert got.choices[0].message.content == want and got.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model="m", messages=messages, max_completion_tokens=10,
                                                 temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "length"


def test_sixteen_concurrent_clients_each_get_their_single_generation(client: openai.OpenAI, server: Server,
                                                                      local) -> None:
    # Greedy tokens of the batched decode equal a lone generate's: each row has its own RoPE
    # positions and masks, and the tiny float32 model's top logits are not near ties.
    want = {p: "".join(t.text for t in local.generate(p, max_tokens=24)) for p in PROMPTS}
    got: dict[str, str] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(len(PROMPTS))

    def call(prompt: str, stream: bool) -> None:
        try:
            start.wait()
            if stream:
                parts = client.completions.create(model="m", prompt=prompt, max_tokens=24, temperature=0, stream=True)
                got[prompt] = "".join(c.choices[0].text for c in parts if c.choices)
            else:
                got[prompt] = client.completions.create(model="m", prompt=prompt, max_tokens=24,
                                                        temperature=0).choices[0].text
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=call, args=(p, i % 2 == 0)) for i, p in enumerate(PROMPTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors
    assert got == want
    assert server.health()["peak_rows"] > 1  # they shared decode steps


def test_seed_reproduces_sampling(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        return client.completions.create(model="m", prompt=PROMPTS[2], max_tokens=16, temperature=1.0, top_p=0.95,
                                         seed=seed).choices[0].text

    assert sample(7) == sample(7)
    assert len({sample(7), sample(8), sample(9)}) > 1


def test_stop_string_across_a_token_boundary(client: openai.OpenAI) -> None:
    pieces = [c.choices[0].text for c in client.completions.create(
        model="m", prompt=PROMPTS[3], max_tokens=20, temperature=0, stream=True) if c.choices]
    full = "".join(pieces)
    n = next(i for i in range(3, len(pieces) - 1) if pieces[i] and pieces[i + 1])
    stop = pieces[n][-1] + pieces[n + 1][0]  # spans the boundary between two tokens
    got = client.completions.create(model="m", prompt=PROMPTS[3], max_tokens=20, temperature=0, stop=[stop])
    assert got.choices[0].text == full[: full.index(stop)]
    assert got.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model="m", prompt=PROMPTS[3], max_tokens=20, temperature=0, stop=stop,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == full[: full.index(stop)]


SCHEMA = {"type": "object", "properties": {"size": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "color": {"enum": ["red", "green", "blue"]},
                                           "ok": {"type": "boolean"}},
          "required": ["size", "color", "ok"], "additionalProperties": False}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_output_validates(client: openai.OpenAI, temperature: float) -> None:
    got = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Describe a ball."}], max_tokens=64, temperature=temperature,
        seed=1, response_format={"type": "json_schema", "json_schema": {"name": "ball", "schema": SCHEMA}})
    jsonschema.validate(json.loads(got.choices[0].message.content), SCHEMA)
    assert got.choices[0].finish_reason == "stop"
    plain = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Describe a ball."}],
                                           max_tokens=64, temperature=0, response_format={"type": "json_object"})
    assert isinstance(json.loads(plain.choices[0].message.content), dict)


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}},
                   "required": ["city"], "additionalProperties": False}}}]


def test_tool_call_is_parsed(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Weather in Rome?"}]
    got = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, tool_choice="required",
                                         max_tokens=64, temperature=0)
    choice = got.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in {"Paris", "Rome", "Oslo"}
    streamed = list(client.chat.completions.create(
        model="m", messages=messages, tools=TOOLS, max_tokens=64, temperature=0, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    calls = [tc for c in streamed for tc in (c.choices[0].delta.tool_calls or [])]
    assert [c.function.name for c in calls] == ["get_weather"]
    assert streamed[-1].choices[0].finish_reason == "tool_calls"
    # The answer goes back to the model through its template (tool results included).
    follow = [*messages, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
              {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    assert client.chat.completions.create(model="m", messages=follow, tools=TOOLS, max_tokens=4,
                                          temperature=0).choices[0].finish_reason in ("length", "stop", "tool_calls")


# A whole answer in one token: a tool call, then text. The tiny model's vocabulary gets it as the
# text of its added token "</think>", which a logit bias then makes the model write.
CALL_THEN_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>\nIt is sunny.'


def test_a_streamed_tool_call_keeps_the_text_after_it(model_dir, tmp_path) -> None:
    scripted = shutil.copytree(model_dir, tmp_path / "scripted")
    spec = json.loads((scripted / "tokenizer.json").read_text())
    (added,) = [t for t in spec["added_tokens"] if t["content"] == "</think>"]
    added["content"] = CALL_THEN_TEXT
    (scripted / "tokenizer.json").write_text(json.dumps(spec))
    server = start_server(scripted, log=tmp_path / "scripted.log")
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        body = {"model": "m", "messages": [{"role": "user", "content": "Weather in Rome?"}], "tools": TOOLS,
                "max_tokens": 1, "temperature": 0, "logit_bias": {str(added["id"]): 100}}
        whole = client.chat.completions.create(**body).choices[0]
        assert whole.message.content == "It is sunny."
        assert [c.function.name for c in whole.message.tool_calls] == ["get_weather"]
        streamed = [c.choices[0] for c in client.chat.completions.create(**body, stream=True) if c.choices]
        assert "".join(c.delta.content or "" for c in streamed) == whole.message.content
        streamed_calls = [tc.function.arguments for c in streamed for tc in c.delta.tool_calls or []]
        assert streamed_calls == [c.function.arguments for c in whole.message.tool_calls]
        assert streamed[-1].finish_reason == whole.finish_reason == "tool_calls"
    finally:
        stop_server(server)


def test_logprobs_and_logit_bias(client: openai.OpenAI, local) -> None:
    got = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                         temperature=0, logprobs=True, top_logprobs=3)
    content = got.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)  # greedy picks the top one
    forced = local.encode(" glass")[0]
    biased = client.completions.create(model="m", prompt=PROMPTS[4], max_tokens=3, temperature=0,
                                       logit_bias={str(forced): 100}, logprobs=1)
    assert biased.choices[0].text == local.decode([forced] * 3)


def test_penalties_change_greedy_output(client: openai.OpenAI) -> None:
    plain = client.completions.create(model="m", prompt=PROMPTS[5], max_tokens=30, temperature=0).choices[0].text
    penalised = client.completions.create(model="m", prompt=PROMPTS[5], max_tokens=30, temperature=0,
                                          frequency_penalty=2.0, presence_penalty=2.0).choices[0].text
    assert penalised != plain


def test_disconnect_mid_stream_frees_its_row(server: Server) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    before = server.health()
    body = {"model": "m", "prompt": PROMPTS[6], "max_tokens": 8000, "temperature": 0, "stream": True}
    with (
        httpx.Client(timeout=60) as http,
        http.stream("POST", f"{server.url}/v1/completions", json=body, headers=headers) as response,
    ):
        assert response.status_code == 200
        seen = 0
        for line in response.iter_lines():
            seen += line.startswith("data:")
            if seen >= 5:
                during = server.health()  # before leaving the iterator: that closes the response
                break
        assert during["running"] == 1
    deadline = time.monotonic() + 30
    while (now := server.health())["running"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert now["running"] == 0
    steps = now["steps"]
    time.sleep(0.5)
    after = server.health()
    assert after["steps"] == steps  # nothing decodes for the gone client
    assert after["steps"] - before["steps"] < 7999
    assert after["active_memory_bytes"] < during["active_memory_bytes"]


def test_bad_requests_get_openai_errors(server: Server) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    url = f"{server.url}/v1/chat/completions"
    malformed = httpx.post(url, content=b'{"messages": [', headers=headers)
    assert malformed.status_code == 400 and malformed.json()["error"]["type"] == "invalid_request_error"
    wrong_type = httpx.post(url, json={"messages": [{"role": "user", "content": "x"}], "temperature": "hot"},
                            headers=headers)
    assert wrong_type.status_code == 400 and wrong_type.json()["error"]["param"] == "temperature"
    unknown = httpx.post(url, json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
                                    "some_future_field": {"a": 1}}, headers=headers)
    assert unknown.status_code == 200
    too_many = httpx.post(url, json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 10**6},
                          headers=headers)
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "max_tokens"
    oversize = httpx.post(url, content=b'{"messages": "' + b"x" * 100_000 + b'"}', headers=headers)
    assert oversize.status_code == 413 and "error" in oversize.json()
    bad_schema = httpx.post(url, json={"messages": [{"role": "user", "content": "x"}],
                                       "response_format": {"type": "json_schema", "json_schema": {
                                           "name": "x", "schema": {"type": "no-such-type"}}}}, headers=headers)
    assert bad_schema.status_code == 400
    # Not Unicode text (JSON may carry a lone surrogate): the field named, not a server error.
    for endpoint, body, param in (("completions", '{"prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
                                  ("chat/completions", '{"messages": [{"role": "user", "content": "a\\ud800b"}], '
                                                       '"max_tokens": 2}', "messages")):
        lone = httpx.post(f"{server.url}/v1/{endpoint}", content=body.encode(), headers=headers)
        assert lone.status_code == 400, lone.text
        assert lone.json()["error"]["param"] == param and "surrogate" in lone.json()["error"]["message"]


def test_api_key_is_required(server: Server) -> None:
    wrong = openai.OpenAI(base_url=f"{server.url}/v1", api_key="not-the-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    assert httpx.post(f"{server.url}/v1/completions", json={"prompt": "x"}).status_code == 401


def test_full_queue_answers_429(model_dir, tmp_path) -> None:
    small = start_server(model_dir, "--max-concurrency", "1", "--max-queue", "0", "--max-tokens-limit", "8000",
                         log=tmp_path / "small.log")
    try:
        body = {"model": "m", "prompt": "x", "max_tokens": 8000, "stream": True}
        with (
            httpx.Client(timeout=60) as http,
            http.stream("POST", f"{small.url}/v1/completions", json=body) as busy,
        ):
            assert busy.status_code == 200
            lines = busy.iter_lines()
            next(lines)
            second = http.post(f"{small.url}/v1/completions", json={"prompt": "y", "max_tokens": 2})
            assert second.status_code == 429
            assert second.json()["error"]["type"] == "rate_limit_error"
        deadline = time.monotonic() + 30
        while small.health()["running"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert httpx.post(f"{small.url}/v1/completions", json={"prompt": "y", "max_tokens": 2}).status_code == 200
    finally:
        stop_server(small)


def test_a_recurrent_model_is_served_in_the_batch(tmp_path) -> None:
    """Qwen3-Next's rows join the continuous batch (their recurrent states side by side): requests
    sent together give each its one-process answer, with stop strings and finish reasons, and
    share decode steps."""
    from pymlxc.testing import write_tiny_model

    model_dir = write_tiny_model(tmp_path / "next", "qwen3_next", seed=3)
    with pymlxc.load_model(str(model_dir), backend="metal") as model:
        want = ["".join(t.text for t in model.generate(p, max_tokens=10)) for p in PROMPTS[:4]]
    server = start_server(model_dir, log=tmp_path / "next.log")
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda p: client.completions.create(model="m", prompt=p, max_tokens=10,
                                                                    temperature=0).choices[0], PROMPTS[:4]))
        assert [(c.text, c.finish_reason) for c in got] == [(w, "length") for w in want]
        assert server.health()["peak_rows"] >= 2
        stop = want[1][len(want[1]) // 2:][:3]
        assert stop.strip()  # seed 3's answer has text there
        cut = client.completions.create(model="m", prompt=PROMPTS[1], max_tokens=10, temperature=0, stop=[stop])
        assert (cut.choices[0].text, cut.choices[0].finish_reason) == (want[1][:want[1].find(stop)], "stop")
    finally:
        stop_server(server)


def test_top_p_zero_keeps_only_the_top_token(client: openai.OpenAI) -> None:
    # OpenAI's top_p 0 is the smallest nucleus, the top token; the library's top_p 0 means off.
    greedy = client.completions.create(model="m", prompt=PROMPTS[7], max_tokens=12, temperature=0).choices[0].text
    for seed in (1, 2, 3):
        got = client.completions.create(model="m", prompt=PROMPTS[7], max_tokens=12, temperature=1.0, top_p=0,
                                        seed=seed)
        assert got.choices[0].text == greedy


def _post(server: Server, endpoint: str, body: bytes | dict[str, object]) -> httpx.Response:
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{server.url}/v1/{endpoint}", content=content, headers=headers, timeout=120)


def test_an_unsatisfiable_schema_is_refused_before_generating(server: Server) -> None:
    # {"$ref": "#"} compiles, but no output satisfies it: llguidance fails at its first mask.
    got = _post(server, "chat/completions", {
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}})
    assert got.status_code == 400, got.text
    error = got.json()["error"]
    assert error["param"] == "response_format" and "<state>" not in error["message"]


@pytest.mark.parametrize("bias", ['{"5": NaN}', '{"5": -Infinity}', '{"5": 101}', '{"1_0": 5}', '{" 10": 5}',
                                  '{"-1": 5}'])
def test_a_bad_logit_bias_is_a_400(server: Server, bias: str) -> None:
    # Python's JSON reads NaN and Infinity; int() reads "1_0" as 10 and " 10" too.
    got = _post(server, "completions", f'{{"prompt": "Hi", "max_tokens": 2, "logit_bias": {bias}}}'.encode())
    assert got.status_code == 400, got.text
    assert got.json()["error"]["param"] == "logit_bias"


def test_a_chunked_body_is_limited_as_one_with_a_length(server: Server) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}

    def chunks(size: int) -> Iterator[bytes]:  # no Content-Length: sent chunked
        yield b'{"max_tokens": 2, "temperature": 0, "prompt": "'  # greedy: a sampled end token would end it early
        for _ in range(size // 1000):
            yield b"x " * 500
        yield b'"}'

    big = httpx.post(f"{server.url}/v1/completions", content=chunks(70_000), headers=headers, timeout=60)
    assert big.status_code == 413, big.text
    assert big.json()["error"]["code"] == "request_too_large"
    small = httpx.post(f"{server.url}/v1/completions", content=chunks(2000), headers=headers, timeout=60)
    assert small.status_code == 200 and small.json()["usage"]["completion_tokens"] == 2


def test_a_stop_string_in_the_text_released_at_the_end_stops(client: openai.OpenAI, local) -> None:
    # A character the last token leaves unfinished comes out at the end (as U+FFFD): a stop string
    # that only that text completes still ends the answer with finish_reason "stop".
    for prompt, n in ((p, n) for p in PROMPTS for n in range(2, 17)):
        ids = [t.id for t in local.generate(prompt, max_tokens=n)]
        detokenizer = local.tokenizer.detokenizer()
        body = "".join(detokenizer.add(i) for i in ids)
        tail = detokenizer.finish()
        if tail and body and body[-1] + tail not in body:
            break
    else:
        pytest.skip("no greedy answer of this model ends in an unfinished character")
    stop = body[-1] + tail
    for stream in (False, True):
        if stream:
            chunks = list(client.completions.create(model="m", prompt=prompt, max_tokens=n, temperature=0,
                                                    stop=[stop], stream=True))
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        else:
            choice = client.completions.create(model="m", prompt=prompt, max_tokens=n, temperature=0,
                                               stop=[stop]).choices[0]
            text, finish = choice.text, choice.finish_reason
        assert (text, finish) == (body[:-1], "stop"), stream


def test_echo_puts_the_prompt_before_the_completion(client: openai.OpenAI, server: Server, local) -> None:
    plain = client.completions.create(model="m", prompt=PROMPTS[8], max_tokens=4, temperature=0).choices[0].text
    echoed = client.completions.create(model="m", prompt=PROMPTS[8], max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPTS[8] + plain
    streamed = client.completions.create(model="m", prompt=PROMPTS[8], max_tokens=4, temperature=0, echo=True,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == PROMPTS[8] + plain
    ids = local.encode(PROMPTS[8])
    by_ids = client.completions.create(model="m", prompt=ids, max_tokens=4, temperature=0, echo=True)
    assert by_ids.choices[0].text == local.decode(ids) + plain
    with_logprobs = _post(server, "completions", {"prompt": "Hi", "max_tokens": 2, "echo": True, "logprobs": 1})
    assert with_logprobs.status_code == 400 and with_logprobs.json()["error"]["param"] == "echo"


def test_a_slot_engine_counts_the_prompt_once(local) -> None:
    """A SlotEngine (the mlx_lm backend's; a metal model whose caches cannot join a batch) counts
    the prompt itself: the usage's prompt_tokens is the prompt's length as the model reads it, once,
    whole or streamed, and the context left to the completion is what that length leaves."""
    import asyncio

    from pymlxc.server.app import ServerConfig, create_app
    from pymlxc.server.engine import SlotEngine

    context = 64
    app = create_app(local, ServerConfig(), engine=SlotEngine(local, max_concurrency=1, max_queue=0,
                                                              context_len=context))
    messages = [{"role": "user", "content": "Hello!"}]
    streamed = {"stream": True, "stream_options": {"include_usage": True}}

    async def usages() -> list[tuple[dict[str, int], int]]:
        got = []
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://slot") as c:
            for endpoint, body, length in (
                ("completions", {"prompt": PROMPTS[0]}, len(local.encode(PROMPTS[0]))),
                ("chat/completions", {"messages": messages}, local.prompt_length(messages)),
            ):
                for extra in ({"max_tokens": 3}, {"max_tokens": 3, **streamed}, {}):
                    r = await c.post(f"/v1/{endpoint}", json={"model": "m", "temperature": 0, **body, **extra})
                    assert r.status_code == 200, r.text
                    if extra.get("stream"):
                        chunks = [json.loads(line[6:]) for line in r.text.splitlines()
                                  if line.startswith("data: {")]
                        got.append((chunks[-1]["usage"], length))
                    else:
                        got.append((r.json()["usage"], length))
        return got

    for usage, length in asyncio.run(usages()):
        assert usage["prompt_tokens"] == length
        assert usage["total_tokens"] == length + usage["completion_tokens"]
        assert usage["completion_tokens"] in (3, context - length)


# ---- the mlx_lm backend: one worker slot per request -------------------------------------------------


@pytest.fixture(scope="module")
def mlx_lm_server(model_dir, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    running = start_server(model_dir, "--backend", "mlx_lm", "--context-len", "64", "--max-concurrency", "1",
                           log=tmp_path_factory.mktemp("log") / "mlx_lm.log")
    yield running
    stop_server(running)


def test_mlx_lm_server_counts_the_prompt_and_holds_the_context(mlx_lm_server: Server, local) -> None:
    client = openai.OpenAI(base_url=f"{mlx_lm_server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    got = client.completions.create(model="m", prompt=PROMPTS[0], max_tokens=12, temperature=0)
    assert got.usage.completion_tokens == 12
    assert got.usage.prompt_tokens == len(local.encode(PROMPTS[0]))
    # Without max_tokens the answer ends where the context does.
    whole = client.completions.create(model="m", prompt=PROMPTS[0], temperature=0)
    assert whole.usage.completion_tokens == 64 - got.usage.prompt_tokens
    assert whole.choices[0].finish_reason == "length"
    messages = [{"role": "user", "content": "Hello!"}]
    chat = client.chat.completions.create(model="m", messages=messages, max_tokens=2, temperature=0)
    assert chat.usage.prompt_tokens == local.prompt_length(messages)
    for endpoint, body, param in (("completions", {"prompt": "word " * 100}, "prompt"),
                                  ("chat/completions", {"messages": [{"role": "user", "content": "word " * 100}]},
                                   "messages")):
        long = _post(mlx_lm_server, endpoint, {**body, "max_tokens": 2})
        assert long.status_code == 400, long.text
        assert (long.json()["error"]["code"], long.json()["error"]["param"]) == ("context_length_exceeded", param)


def test_mlx_lm_server_top_p_zero_keeps_only_the_top_token(mlx_lm_server: Server) -> None:
    client = openai.OpenAI(base_url=f"{mlx_lm_server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    greedy = client.completions.create(model="m", prompt=PROMPTS[7], max_tokens=8, temperature=0).choices[0].text
    for seed in (1, 2):
        got = client.completions.create(model="m", prompt=PROMPTS[7], max_tokens=8, temperature=1.0, top_p=0,
                                        seed=seed)
        assert got.choices[0].text == greedy


# Renders what the server's default test template leaves out: a message's name, the call it answers
# and an assistant's calls, so that a field dropped on the way changes the prompt's count.
LABELS_TEMPLATE = (
    "{%- for message in messages %}<|im_start|>{{ message['role'] }}"
    "{%- if message.name %} ({{ message.name }}){%- endif %}"
    "{%- if message.tool_call_id %} [{{ message.tool_call_id }}]{%- endif %}\n{{ message['content'] }}"
    "{%- for call in message.tool_calls or [] %}<tool_call>{{ call.function.name }}"
    " {{ call.function.arguments | tojson }}</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


def test_mlx_lm_server_hands_the_template_every_message_field(tmp_path) -> None:
    from pymlxc.testing import write_tiny_model

    model_dir = write_tiny_model(tmp_path / "labels", "qwen3", seed=3, chat_template=LABELS_TEMPLATE)
    calls = [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]
    history = [{"role": "user", "content": "Weather?", "name": "bob"},
               {"role": "assistant", "content": None, "tool_calls": calls},
               {"role": "tool", "content": "sunny", "tool_call_id": "c1"}]
    bare = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": ""},
            {"role": "tool", "content": "sunny"}]
    with pymlxc.load_model(str(model_dir), backend="metal") as model:
        template_calls = [{**c, "function": {**c["function"], "arguments": {"city": "Oslo"}}} for c in calls]
        want = model.prompt_length([history[0], {**history[1], "content": "", "tool_calls": template_calls},
                                    history[2]])
        assert want > model.prompt_length(bare) + 6  # the labels are rendered: a dropped one would show
    server = start_server(model_dir, "--backend", "mlx_lm", "--max-concurrency", "1", log=tmp_path / "labels.log")
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        got = client.chat.completions.create(model="m", messages=history, max_tokens=2, temperature=0)
        assert got.usage.prompt_tokens == want
        lone = _post(server, "chat/completions",
                     b'{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 2}')
        assert lone.status_code == 400, lone.text
        assert lone.json()["error"]["param"] == "messages" and "surrogate" in lone.json()["error"]["message"]
    finally:
        stop_server(server)


@pytest.mark.parametrize(("endpoint", "body", "param"), [
    ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "logprobs": True}, "logprobs"),
    ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "logprobs": True, "top_logprobs": 2},
     "logprobs"),
    ("completions", {"prompt": "Hi", "logprobs": 1}, "logprobs"),
    ("completions", {"prompt": "Hi", "frequency_penalty": 1.0}, "frequency_penalty"),
    ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "presence_penalty": 1.0},
     "presence_penalty"),
])
def test_mlx_lm_server_refuses_what_it_cannot_compute_naming_the_field(mlx_lm_server: Server, endpoint: str,
                                                                       body: dict[str, object], param: str) -> None:
    # An answer without the log-probabilities asked for would be silently short.
    got = _post(mlx_lm_server, endpoint, {**body, "max_tokens": 2})
    assert got.status_code == 400, got.text
    assert got.json()["error"]["param"] == param, got.text

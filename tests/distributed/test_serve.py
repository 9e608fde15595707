"""`pymlxc serve --distributed` on 2 ranks over the ring (127.0.0.1): rank 0 answers the OpenAI
client with what one process generates. A model that batches runs the continuous batch on every
rank in step: requests sent together share decode steps and each gets its one-process answer;
streams cut short by a stop string, logprobs and constrained output keep the ranks in step; rows of
a model with recurrent layers (Qwen3-Next) share it too. A request every rank refuses is a 400 and
the server goes on; SIGTERM to rank 0 ends both ranks cleanly."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import openai
import pytest

import pymlxc
from pymlxc.launch import free_ports, rank_environments
from pymlxc.testing import write_tiny_model

TESTS = str(Path(__file__).resolve().parents[1])
CLI = f"import sys; sys.path.insert(0, {TESTS!r}); import conftest; from pymlxc.cli import main; sys.exit(main())"
PROMPT = "Hello there, general"
CHAT = [{"role": "user", "content": "hi there"}]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("serve") / "qwen3", "qwen3", seed=4)


@pytest.fixture(scope="module")
def alone(model: Path) -> dict[str, str]:
    with pymlxc.load_model(str(model)) as m:
        return {"text": "".join(t.text for t in m.generate(PROMPT, max_tokens=8)),
                "chat": "".join(t.text for t in m.chat(CHAT, max_tokens=8))}


Served = tuple[openai.OpenAI, list[subprocess.Popen[bytes]]]


def _serve(model: Path, logs: Path) -> Iterator[Served]:
    port = free_ports(1)[0]
    procs = []
    with contextlib.ExitStack() as files:
        for r, env in enumerate(rank_environments(2, "ring", logs)):
            out = files.enter_context(open(logs / f"{r}.out", "wb"))
            err = files.enter_context(open(logs / f"{r}.err", "wb"))
            procs.append(subprocess.Popen(
                [sys.executable, "-c", CLI, "serve", str(model), "--port", str(port), "--distributed", "tensor"],
                env={**os.environ, **env}, stdout=out, stderr=err))
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                dead = [p.returncode for p in procs if p.poll() is not None]
                if dead or time.monotonic() > deadline:
                    pytest.fail(f"the server did not start (ended: {dead}):\n"
                                + (logs / "0.err").read_text()[-3000:] + (logs / "1.err").read_text()[-3000:])
                time.sleep(0.5)
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120), procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()


@pytest.fixture(scope="module")
def served(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    yield from _serve(model, tmp_path_factory.mktemp("logs"))


def _health(client: openai.OpenAI) -> dict[str, int]:
    with urllib.request.urlopen(str(client.base_url).replace("/v1/", "/health"), timeout=10) as reply:
        return json.loads(reply.read())


def test_rank0_answers_as_one_process(served: Served, alone: dict[str, str], model: Path) -> None:
    client, _ = served
    got = client.completions.create(model=str(model), prompt=PROMPT, max_tokens=8, temperature=0)
    assert got.choices[0].text == alone["text"] and alone["text"]
    assert got.choices[0].finish_reason == "length"
    chat = client.chat.completions.create(model=str(model), messages=CHAT, max_tokens=8,
                                          temperature=0)  # type: ignore[arg-type]
    assert chat.choices[0].message.content == alone["chat"]


def test_a_stream_cut_short_keeps_the_ranks_in_step(served: Served, alone: dict[str, str],
                                                    model: Path) -> None:
    client, _ = served
    stop = alone["text"][3:6]
    pieces = [c.choices[0].text for c in client.completions.create(model=str(model), prompt=PROMPT, max_tokens=8,
                                                                    temperature=0, stream=True, stop=[stop])]
    assert "".join(pieces) == alone["text"][: alone["text"].index(stop)]
    again = client.completions.create(model=str(model), prompt=PROMPT, max_tokens=8, temperature=0)
    assert again.choices[0].text == alone["text"]


def test_requests_sent_together_share_the_batch_in_step(served: Served, alone: dict[str, str], model: Path) -> None:
    client, _ = served
    prompts = [f"{PROMPT} {word}" for word in ("one", "two three", "four five six", "seven")]
    with pymlxc.load_model(str(model)) as m:
        want = ["".join(t.text for t in m.generate(p, max_tokens=40)) for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda p: client.completions.create(model=str(model), prompt=p, max_tokens=40,
                                                                temperature=0).choices[0].text, prompts))
    assert got == want
    # They ran as rows of one batch (on rank 0, and so on rank 1: its turns are rank 0's).
    assert _health(client)["peak_rows"] >= 2
    # Sampled with no seed given: rank 0 draws one for every rank. Had the ranks sampled apart,
    # their turn checksums would differ and the server would end: the next request shows it did not.
    for _ in range(3):
        sampled = client.completions.create(model=str(model), prompt=PROMPT, max_tokens=8, temperature=1.0)
        assert sampled.choices[0].finish_reason in ("stop", "length")
    assert client.completions.create(model=str(model), prompt=PROMPT, max_tokens=8,
                                     temperature=0).choices[0].text == alone["text"]


def test_logprobs_and_constrained_output_in_the_batch(served: Served, alone: dict[str, str],
                                                                  model: Path) -> None:
    client, _ = served
    got = client.completions.create(model=str(model), prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2)
    with pymlxc.load_model(str(model)) as m:
        want = [m.classify([PROMPT], return_logits=True)[0]]
    lp = got.choices[0].logprobs
    assert lp is not None and len(lp.token_logprobs or []) == 4 and all(len(t) == 2 for t in lp.top_logprobs or [])
    # The first token's log-probability as one process computes it from its logits.
    logits = np.asarray(want[0].logits, dtype=np.float64)
    first = int(np.argmax(logits))
    expected = logits[first] - np.log(np.sum(np.exp(logits - logits.max()))) - logits.max()
    assert (lp.token_logprobs or [0.0])[0] == pytest.approx(expected, abs=1e-3)
    assert want[0].token.id == first
    # Constrained output: rank 1 compiles the same grammar and masks the same ids, so they stay in step.
    schema = {"type": "object", "properties": {"a": {"enum": [1, 2]}}, "required": ["a"], "additionalProperties": False}
    with ThreadPoolExecutor(2) as pool:
        replies = list(pool.map(lambda _: client.chat.completions.create(
            model=str(model), messages=CHAT, max_tokens=24,  # type: ignore[arg-type]
            response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}), range(2)))
    for reply in replies:
        assert json.loads(reply.choices[0].message.content or "") in ({"a": 1}, {"a": 2})
        assert reply.choices[0].finish_reason == "stop"
    assert client.completions.create(model=str(model), prompt=PROMPT, max_tokens=8,
                                     temperature=0).choices[0].text == alone["text"]


def test_a_refused_request_is_an_error_and_the_server_goes_on(served: Served,
                                                              alone: dict[str, str], model: Path) -> None:
    client, _ = served
    with pytest.raises(openai.BadRequestError, match="token ids must be in"):
        client.completions.create(model=str(model), prompt=[1, 2, 10**6], max_tokens=4)
    # Not Unicode text. (Sent as escaped JSON by hand: the client cannot encode a lone surrogate.)
    body = json.dumps({"model": "m", "prompt": "a\ud800b", "max_tokens": 4}).encode()
    request = urllib.request.Request(f"{client.base_url}completions", body, {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=60)
    assert info.value.code == 400
    again = client.completions.create(model=str(model), prompt=PROMPT, max_tokens=8, temperature=0)
    assert again.choices[0].text == alone["text"]


def test_sigterm_to_rank0_ends_both(served: Served) -> None:
    _, procs = served
    procs[0].send_signal(signal.SIGTERM)
    assert [p.wait(timeout=60) for p in procs] == [0, 0]


# ---------------------------------------------------------------------- recurrent layers

@pytest.fixture(scope="module")
def recurrent(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("serve") / "qwen3_next", "qwen3_next", seed=4,
                            extra_config={"moe_intermediate_size": 64})


def test_recurrent_rows_share_the_batch_in_step(recurrent: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Qwen3-Next on 2 tensor ranks (each with its share of the value heads and of every row's
    recurrent state): requests sent together decode as rows of one batch, each as one process."""
    prompts = [f"{PROMPT} {word}" for word in ("one", "two three", "four five six")]
    with pymlxc.load_model(str(recurrent)) as m:
        want = ["".join(t.text for t in m.generate(p, max_tokens=24)) for p in prompts]
    serving = _serve(recurrent, tmp_path_factory.mktemp("logs"))
    client, procs = next(serving)
    try:
        with ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(lambda p: client.completions.create(model="m", prompt=p, max_tokens=24,
                                                                    temperature=0).choices[0].text, prompts))
        assert got == want
        assert _health(client)["peak_rows"] >= 2
        stop = want[0][3:6]
        pieces = [c.choices[0].text for c in client.completions.create(model="m", prompt=prompts[0], max_tokens=24,
                                                                        temperature=0, stream=True, stop=[stop])]
        assert "".join(pieces) == want[0][: want[0].index(stop)]
        procs[0].send_signal(signal.SIGTERM)
        assert [p.wait(timeout=60) for p in procs] == [0, 0]
    finally:
        serving.close()

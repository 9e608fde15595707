"""`pymlxc serve --distributed` on 2 ranks over the ring (127.0.0.1): rank 0 answers the OpenAI
client with what one process generates, the other rank follows each call; streams cut short by a
stop string and requests sent together keep the ranks in step; a request every rank refuses is a
400 and the server goes on; SIGTERM to rank 0 ends both ranks cleanly."""
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


@pytest.fixture(scope="module")
def served(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    port = free_ports(1)[0]
    logs = tmp_path_factory.mktemp("logs")
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
    with ThreadPoolExecutor(3) as pool:  # queued on rank 0, one call at a time on every rank
        texts = list(pool.map(lambda _: client.completions.create(model=str(model), prompt=PROMPT, max_tokens=8,
                                                                   temperature=0).choices[0].text, range(3)))
    assert texts == [alone["text"]] * 3


def test_a_refused_request_is_an_error_and_the_server_goes_on(served: Served,
                                                              alone: dict[str, str], model: Path) -> None:
    client, _ = served
    with pytest.raises(openai.BadRequestError, match="response_format is not supported"):
        client.chat.completions.create(model=str(model), messages=CHAT, max_tokens=4,  # type: ignore[arg-type]
                                       response_format={"type": "json_object"})
    with pytest.raises(openai.BadRequestError, match="logprobs"):  # refused, not silently dropped
        client.completions.create(model=str(model), prompt=PROMPT, max_tokens=4, logprobs=2)
    # Refused by the model's own checks (not Unicode text), on every rank alike.
    # (Sent as escaped JSON by hand: the client cannot encode a lone surrogate.)
    body = json.dumps({"model": "m", "prompt": "a\ud800b", "max_tokens": 4}).encode()
    request = urllib.request.Request(f"{client.base_url}completions", body, {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=60)
    assert info.value.code == 400 and "lone surrogate" in info.value.read().decode()
    again = client.completions.create(model=str(model), prompt=PROMPT, max_tokens=8, temperature=0)
    assert again.choices[0].text == alone["text"]


def test_sigterm_to_rank0_ends_both(served: Served) -> None:
    _, procs = served
    procs[0].send_signal(signal.SIGTERM)
    assert [p.wait(timeout=60) for p in procs] == [0, 0]

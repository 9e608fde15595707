"""The worker's `inspect_attention` command on the wire: reply fields, array sizes, and refusals."""
from __future__ import annotations

import base64
import re
from typing import Any

import numpy as np

from pymlxc.bridge import protocol as P


def _values(encoded: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(encoded), dtype="<f4")


def test_inspect_attention_reply(loaded_worker: Any) -> None:
    assert loaded_worker.hello["protocol"] == P.PROTOCOL_VERSION >= 2
    reply = loaded_worker.request(cmd="inspect_attention", id="a", prompt="The baker", include_queries=True)
    assert reply["type"] == "result" and reply["cmd"] == "inspect_attention", reply
    n, layers = reply["seq_len"], reply["layers"]
    assert reply["encoding"] == "base64-float32-le" and len(reply["token_ids"]) == n
    assert reply["num_layers"] == len(layers) == 2
    for layer in layers:
        assert _values(layer["keys"]).size == layer["kv_heads"] * n * layer["head_dim"]
        assert _values(layer["queries"]).size == layer["query_heads"] * n * layer["head_dim"]
    by_ids = loaded_worker.request(cmd="inspect_attention", id="b", tokens=reply["token_ids"])
    assert by_ids["layers"][1]["keys"] == layers[1]["keys"] and by_ids["layers"][1]["queries"] is None


def test_inspect_attention_refusals(loaded_worker: Any) -> None:
    for fields in ({}, {"prompt": "x", "tokens": [1]}, {"tokens": [10**7]}):
        reply = loaded_worker.request(cmd="inspect_attention", id="r", **fields)
        assert reply["type"] == "error" and reply["error"] == "bad_field", reply
    for fields, code in (
        ({"tokens": []}, "bad_field"),
        ({"include_queries": 1}, "bad_field"),
        ({"layers": [0]}, "unknown_field"),
    ):
        reply = loaded_worker.request(cmd="inspect_attention", id="r", **fields)
        assert reply["error"] == code, reply


def test_a_prompt_longer_than_the_context_is_refused_before_the_pass(loaded_worker: Any, start_worker: Any,
                                                                    tiny_model: Any) -> None:
    # A 16 MiB line of millions of ids got the worker OOM-killed (then in one pass, whose attention
    # memory grew with the square of the length). Loaded without context_len, the bound is the
    # model's max_position_embeddings (4096 for the tiny model).
    reply = loaded_worker.request(cmd="inspect_attention", id="long", tokens=[1] * 4097)
    assert reply["type"] == "error" and reply["error"] == "context_length_exceeded", reply
    assert reply["message"] == "inspect_attention: the prompt has 4097 tokens, more than the context length of 4096"
    assert (reply["prompt_tokens"], reply["context_len"], reply["item"]) == (4097, 4096, None)
    worker = start_worker()
    assert worker.request(cmd="load", id="l", path=str(tiny_model), context_len=8)["type"] == "result"
    for fields, n in (({"tokens": [1] * 9}, "9"), ({"prompt": "the " * 20}, r"\d+")):
        reply = worker.request(cmd="inspect_attention", id="r", **fields)
        assert reply["error"] == "context_length_exceeded", reply
        assert re.fullmatch(f"inspect_attention: the prompt has {n} tokens, more than the context length of 8",
                            reply["message"]), reply
    reply = worker.request(cmd="inspect_attention", id="ok", tokens=[1] * 8)
    assert reply["type"] == "result" and reply["seq_len"] == 8, reply


def test_a_prompt_in_chunks_gives_the_one_pass_reply(tiny_model: Any, monkeypatch: Any) -> None:
    """The engine runs a prompt through the model INSPECT_STEP tokens at a time (the attention's
    memory grows with the chunk, not the prompt's square); the keys and queries equal one pass's."""
    from pymlxc.bridge import engine as E

    eng = E.Engine(str(tiny_model), None, None, "cpu")
    tokens = [int(t) for t in np.random.default_rng(3).integers(1, eng.vocab_size, size=23)]
    whole = eng.inspect_attention(tokens, include_queries=True)
    monkeypatch.setattr(E, "INSPECT_STEP", 5)
    chunked = eng.inspect_attention(tokens, include_queries=True)
    assert chunked["seq_len"] == whole["seq_len"] == 23
    for a, b in zip(chunked["layers"], whole["layers"], strict=True):
        for field in ("keys", "queries"):
            np.testing.assert_allclose(_values(a[field]), _values(b[field]), rtol=1e-5, atol=1e-5)
        assert _values(a["queries"]).size == a["query_heads"] * 23 * a["head_dim"]
    keys_only = eng.inspect_attention(tokens, include_queries=False)
    assert keys_only["layers"][0]["queries"] is None
    np.testing.assert_allclose(_values(keys_only["layers"][0]["keys"]), _values(whole["layers"][0]["keys"]),
                               rtol=1e-5, atol=1e-5)

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
    # One unchunked pass, whose attention memory grows with the square of the length: a 16 MiB line
    # of millions of ids got the worker OOM-killed. Loaded without context_len, the bound is the
    # model's max_position_embeddings (4096 for the tiny model).
    reply = loaded_worker.request(cmd="inspect_attention", id="long", tokens=[1] * 4097)
    assert reply["type"] == "error" and reply["error"] == "bad_field", reply
    assert reply["message"] == "inspect_attention: the prompt has 4097 tokens, more than the context length of 4096"
    worker = start_worker()
    assert worker.request(cmd="load", id="l", path=str(tiny_model), context_len=8)["type"] == "result"
    for fields, n in (({"tokens": [1] * 9}, "9"), ({"prompt": "the " * 20}, r"\d+")):
        reply = worker.request(cmd="inspect_attention", id="r", **fields)
        assert reply["error"] == "bad_field", reply
        assert re.fullmatch(f"inspect_attention: the prompt has {n} tokens, more than the context length of 8",
                            reply["message"]), reply
    reply = worker.request(cmd="inspect_attention", id="ok", tokens=[1] * 8)
    assert reply["type"] == "result" and reply["seq_len"] == 8, reply

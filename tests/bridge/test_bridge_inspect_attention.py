"""The worker's `inspect_attention` command on the wire: reply fields, array sizes, and refusals."""
from __future__ import annotations

import base64
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

"""`inspect_attention` through the worker (protocol 2): shapes, agreement with the metal backend on the
same checkpoint, token-id prompts, and the refusal of a worker that speaks protocol 1."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import pymlxc
from pymlxc.backends.mlx_lm import MlxLmBackend
from pymlxc.backends.mlx_lm.errors import WorkerError, WorkerReplyError
from pymlxc.options import LoadConfig
from pymlxc.types import AttentionSnapshot

PROMPT = "The baker counted the coins in her drawer before she locked the door."


def test_shapes_and_agreement_with_the_metal_backend(model: Any, tiny_model: Path) -> None:
    config = json.loads((tiny_model / "config.json").read_text())
    snap = model.inspect_attention(PROMPT, include_queries=True)
    assert isinstance(snap, AttentionSnapshot)
    n = len(model.encode(PROMPT))
    assert (snap.architecture, snap.num_layers, snap.num_kv_heads, snap.num_query_heads, snap.seq_len,
            snap.head_dim) == ("llama", config["num_hidden_layers"], config["num_key_value_heads"],
                               config["num_attention_heads"], n, config["head_dim"])
    assert [len(layer) for layer in snap.keys] == [snap.num_kv_heads] * snap.num_layers
    assert [len(layer) for layer in snap.queries] == [snap.num_query_heads] * snap.num_layers
    assert {(a.dtype, a.shape) for layer in snap.keys + snap.queries for a in layer} == {
        (np.dtype(np.float32), (n, snap.head_dim))
    }
    with pymlxc.load_model(str(tiny_model), backend="metal") as metal:
        ours = metal.inspect_attention(PROMPT, include_queries=True)
    assert ours.token_ids == snap.token_ids
    for theirs_layers, ours_layers in ((snap.keys, ours.keys), (snap.queries, ours.queries)):
        for theirs_heads, ours_heads in zip(theirs_layers, ours_layers, strict=True):
            for a, b in zip(theirs_heads, ours_heads, strict=True):
                np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def test_token_ids_and_bad_prompts(model: Any) -> None:
    ids = model.encode(PROMPT)
    by_ids = model.inspect_attention(ids)
    by_text = model.inspect_attention(PROMPT)
    assert by_ids.queries is None and list(by_ids.token_ids) == ids
    assert all(np.array_equal(a, b) for a, b in zip(by_ids.keys[0], by_text.keys[0], strict=True))
    with pytest.raises(WorkerReplyError, match="vocabulary") as caught:
        model.inspect_attention([10**6])
    assert caught.value.code == "bad_field"
    assert model.err() is not None  # the refused request was kept, as every failed call is
    with pytest.raises(ValueError, match="no token ids"):  # a wrong value, as on the metal backend
        model.inspect_attention([])
    assert model.err() is None  # reset by that call, as by every call


def _protocol_1_python(tmp_path: Path) -> Path:
    """A "python" whose worker is fake_worker.py, which announces protocol 1."""
    python = tmp_path / "python-v1"
    fake = Path(__file__).with_name("fake_worker.py")
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{fake}" error "$@"\n')
    python.chmod(0o755)
    return python


def test_a_protocol_1_worker_is_accepted_but_cannot_inspect(tmp_path: Path) -> None:
    python = _protocol_1_python(tmp_path)
    with MlxLmBackend(str(python)).load(str(tmp_path), LoadConfig()) as m:
        assert m.protocol == 1
        with pytest.raises(WorkerError, match="needs protocol 2"):
            m.inspect_attention("x")


def test_an_older_worker_is_not_sent_a_messages_other_keys(tmp_path: Path) -> None:
    # A worker before protocol 4 refuses them ("has unknown key(s)"), which the metal backend renders.
    python = _protocol_1_python(tmp_path)
    with MlxLmBackend(str(python)).load(str(tmp_path), LoadConfig()) as m:
        with pytest.raises(WorkerError, match="a message's keys other than role and content need protocol 4"):
            m.chat([{"role": "user", "content": "x", "name": "bob"}])
        with pytest.raises(WorkerError, match="need protocol 4"):
            m.prompt_length([{"role": "user", "content": "x", "name": "bob"}])
        with pytest.raises(WorkerReplyError, match="fake failure"):  # role and content alone are sent
            list(m.chat([{"role": "user", "content": "x", "name": None}]))

"""A prompt that already starts with the BOS text gets no second BOS, on both backends (mlx-lm's
generate and server add special tokens only when the prompt does not start with it)."""
from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import pymlxc
from pymlxc.backends.mlx_lm import MlxLmBackend
from pymlxc.model import TextModel
from pymlxc.options import LoadConfig
from pymlxc.testing import write_tiny_model

BOS = "<|begin_of_text|>"  # the tiny Llama's


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, TextModel]]:
    path: Path = write_tiny_model(tmp_path_factory.mktemp("bos") / "llama", "llama", seed=3)
    loaded = {
        "metal": pymlxc.load_model(str(path), backend="metal", context_len=1024),
        "mlx_lm": MlxLmBackend(sys.executable, response_timeout=30.0, load_timeout=120.0).load(
            str(path), LoadConfig(context_len=1024)),
    }
    yield loaded
    for m in loaded.values():
        m.close()


@pytest.mark.parametrize("text", ["hi", "The baker went", " spaced"])
def test_a_prompt_with_its_bos_text_is_counted_and_generated_once(models: dict[str, TextModel], text: str) -> None:
    metal, mlx_lm = models["metal"], models["mlx_lm"]
    plain = metal.prompt_length(text)
    bos_id = metal.encode("hi")[0]
    assert metal.encode(BOS + text)[:2] == [bos_id, bos_id]  # encode itself adds what it is told
    for m in (metal, mlx_lm):
        assert m.prompt_length(BOS + text) == plain
    with_bos = [[t.id for t in m.generate(BOS + text, max_tokens=4)] for m in (metal, mlx_lm)]
    assert with_bos[0] == with_bos[1] == [t.id for t in metal.generate(text, max_tokens=4)]
    assert metal.metrics().prompt_tokens == plain

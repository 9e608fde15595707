"""Tiny random models for the training tests, written once per session."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from pymlxc.testing import write_tiny_model

REPEAT_TEXT = "the cat sat on the mat and the dog sat on the log. "


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("llama") / "m", "llama", seed=0)


@pytest.fixture(scope="session")
def qllama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("qllama") / "m", "llama", seed=0, quantize_bits=4)


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("qwen2") / "m", "qwen2", seed=1, hidden_size=96, num_heads=4)


@pytest.fixture()
def repeat_data(tmp_path: Path) -> Path:
    data = tmp_path / "data"
    data.mkdir()
    lines = [json.dumps({"text": REPEAT_TEXT * 2}) for _ in range(8)]
    (data / "train.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (data / "valid.jsonl").write_text(json.dumps({"text": REPEAT_TEXT}) + "\n", encoding="utf-8")
    return data


def load(path: Path):  # noqa: ANN201 - a MetalTextModel
    import pymlxc

    return pymlxc.load_model(str(path), backend="metal")

"""Fixtures of the mlx_lm backend tests: tiny model directories and a loaded model shared per module."""
from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from pymlxc.backends.mlx_lm import MlxLmBackend, MlxLmModel
from pymlxc.options import LoadConfig
from pymlxc.testing import write_tiny_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("mlx-lm-model") / "llama", "llama", seed=0)


@pytest.fixture(scope="session")
def tiny_adapter(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Path:
    """A LoRA adapter in mlx-lm's layout on q_proj and v_proj, with B non-zero so it changes outputs."""
    config = json.loads((tiny_model / "config.json").read_text())
    hidden, heads, kv = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    outs = {"q_proj": hidden, "v_proj": hidden // heads * kv}
    rank, rng = 4, np.random.default_rng(7)
    path = tmp_path_factory.mktemp("adapter")
    weights = {}
    for i in range(config["num_hidden_layers"]):
        for name, out in outs.items():
            prefix = f"model.layers.{i}.self_attn.{name}"
            weights[f"{prefix}.lora_a"] = rng.normal(0, 0.5, (hidden, rank)).astype(np.float32)
            weights[f"{prefix}.lora_b"] = rng.normal(0, 0.5, (rank, out)).astype(np.float32)
    save_file(weights, str(path / "adapters.safetensors"))
    (path / "adapter_config.json").write_text(
        json.dumps(
            {
                "fine_tune_type": "lora",
                "num_layers": config["num_hidden_layers"],
                "lora_parameters": {
                    "rank": rank,
                    "scale": 4.0,
                    "dropout": 0.0,
                    "keys": ["self_attn.q_proj", "self_attn.v_proj"],
                },
            }
        )
    )
    return path


@pytest.fixture(scope="session")
def backend() -> MlxLmBackend:
    return MlxLmBackend(sys.executable, response_timeout=30.0, load_timeout=120.0)


@pytest.fixture(scope="session")
def model(backend: MlxLmBackend, tiny_model: Path) -> Iterator[MlxLmModel]:
    """One loaded model for all these tests: each worker start imports mlx-lm, which takes seconds."""
    with backend.load(str(tiny_model), LoadConfig(context_len=1024)) as loaded:
        yield loaded

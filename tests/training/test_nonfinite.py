"""A training run that diverges stops at the first non-finite loss or update with an error naming the
step, and leaves the model as it was before the call: no adapter if it had none, its adapter's
weights if it had one, and the same greedy tokens."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

import pymlxc
from pymlxc.training import LoRAConfig

from .conftest import load

LORA = LoRAConfig(rank=8, alpha=16, target_keys=("q_proj", "v_proj", "o_proj", "down_proj"))
FAST = dict(batch_size=4, steps_per_report=10, steps_per_eval=10, progress=False)
DIVERGING = dict(learning_rate=1e30, **FAST)  # the first update overflows the adapter's weights
PROMPT = "the cat sat on"


def _greedy(model) -> list[int]:  # noqa: ANN001 - a MetalTextModel
    tokens = [t.id for t in model.generate(PROMPT, max_tokens=8)]
    assert model.err() is None
    return tokens


def _weights(model) -> dict[str, np.ndarray]:  # noqa: ANN001
    return {k: np.array(v) for k, v in model.model.parameters().items()}


def _assert_same(before: dict[str, np.ndarray], after: dict[str, np.ndarray]) -> None:
    assert sorted(before) == sorted(after)
    for k, v in before.items():
        np.testing.assert_array_equal(after[k], v, err_msg=k)


def test_a_diverging_run_stops_and_removes_the_adapter_it_applied(llama_dir: Path, repeat_data: Path,
                                                                  tmp_path: Path) -> None:
    with load(llama_dir) as model:
        tokens, weights = _greedy(model), _weights(model)
        trainable = sorted(model.model.trainable_parameters())
        with pytest.raises(FloatingPointError, match=r"at step \d+") as info:
            pymlxc.train(model, repeat_data, tmp_path / "a", lora=LORA, iters=20, **DIVERGING)
        step = int(re.search(r"at step (\d+)", str(info.value)).group(1))
        assert step <= 2  # the first step whose loss or update is not finite, not the last
        assert model.adapter is None
        _assert_same(weights, _weights(model))
        assert sorted(model.model.trainable_parameters()) == trainable
        assert _greedy(model) == tokens
        # and the model trains normally afterwards
        result = pymlxc.train(model, repeat_data, tmp_path / "b", lora=LORA, iters=2, learning_rate=1e-2, **FAST)
        assert result.steps == 2 and all(np.isfinite(result.step_losses))


def test_a_diverging_run_gives_an_existing_adapter_its_weights_back(llama_dir: Path, repeat_data: Path,
                                                                    tmp_path: Path) -> None:
    with load(llama_dir) as model:
        pymlxc.train(model, repeat_data, tmp_path / "a", lora=LORA, iters=3, learning_rate=1e-2, **FAST)
        adapter = model.adapter
        tokens, weights = _greedy(model), _weights(model)
        assert any("lora" in k for k in weights)
        with pytest.raises(FloatingPointError, match="step"):
            pymlxc.train(model, repeat_data, tmp_path / "b", iters=20, **DIVERGING)
        assert model.adapter is adapter
        _assert_same(weights, _weights(model))
        assert _greedy(model) == tokens

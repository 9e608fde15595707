"""The training loop: the loss falls, runs are reproducible, checkpoints resume exactly."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import pymlxc
import pymlxc.core as mx
from pymlxc.training import LoRAConfig, TrainConfig, TrainReport

from .conftest import load

LORA = LoRAConfig(rank=8, alpha=16, target_keys=("q_proj", "v_proj", "o_proj", "down_proj"))
FAST = dict(batch_size=4, learning_rate=1e-2, steps_per_report=10, steps_per_eval=10, progress=False)


def test_train_is_exported_from_the_package(llama_dir: Path) -> None:
    assert pymlxc.train is pymlxc.training.train
    assert pymlxc.LoRAConfig is LoRAConfig
    with load(llama_dir) as model:
        assert isinstance(model, pymlxc.TrainableModel) and isinstance(model, pymlxc.training.SupportsTraining)
        assert model.num_layers == 2 and model.decode(model.encode("the cat")).endswith("the cat")  # after BOS
        adapter = model.apply_lora()
        assert isinstance(adapter, pymlxc.LoRAAdapter)
        # default config: q_proj and v_proj of every block, rank 8
        assert adapter.total_params() == 2 * (8 * (64 + 64) + 8 * (64 + 32))


def test_train_from_a_model_path(llama_dir: Path, repeat_data: Path, tmp_path: Path) -> None:
    result = pymlxc.train(llama_dir, repeat_data, tmp_path / "ad", iters=2, **FAST)
    assert result.steps == 2 and (tmp_path / "ad" / "adapters.safetensors").is_file()


def test_thirty_steps_halve_the_loss_reproducibly(llama_dir: Path, repeat_data: Path, tmp_path: Path) -> None:
    reports: list[TrainReport] = []
    runs = []
    for i in range(2):
        with load(llama_dir) as model:
            result = pymlxc.train(model, repeat_data, tmp_path / f"run{i}", lora=LORA, iters=30, seed=3,
                                  save_every=10, callback=reports.append, **FAST)
            runs.append(result)
    first, second = runs
    assert len(first.step_losses) == 30
    assert first.step_losses[-1] <= 0.5 * first.step_losses[0], first.step_losses
    assert first.step_losses == second.step_losses  # same seed, same losses, bit for bit
    assert [v for _, v in first.val_losses] == [v for _, v in second.val_losses]
    assert first.val_losses[-1][1] < first.val_losses[0][1]
    assert reports and all(r.tokens_per_sec > 0 for r in reports if r.train_loss is not None)
    saved = mx.load_safetensors(tmp_path / "run0" / "adapters.safetensors")[0]
    assert len(saved) == 2 * 4 * 2 and all(k.endswith((".lora_a", ".lora_b")) for k in saved)
    assert (tmp_path / "run0" / "0000010_adapters.safetensors").is_file()


def test_a_different_seed_gives_different_losses(llama_dir: Path, repeat_data: Path, tmp_path: Path) -> None:
    losses = []
    for seed in (0, 1):
        with load(llama_dir) as model:
            losses.append(pymlxc.train(model, repeat_data, tmp_path / f"s{seed}", lora=LORA, iters=3, seed=seed,
                                       **FAST).step_losses)
    assert losses[0] != losses[1]


def test_resume_continues_exactly(llama_dir: Path, repeat_data: Path, tmp_path: Path) -> None:
    config = TrainConfig(iters=8, save_every=4, **FAST)
    with load(llama_dir) as model:
        straight = pymlxc.train(model, repeat_data, tmp_path / "straight", lora=LORA, config=config).step_losses
    with load(llama_dir) as model:
        pymlxc.train(model, repeat_data, tmp_path / "resumed", lora=LORA, config=config, iters=4)
    state = json.loads((tmp_path / "resumed" / "training_state.json").read_text())
    assert state["step"] == 4 and state["optimizer_step"] == 4
    with load(llama_dir) as model:  # a fresh process would look like this: no adapter yet
        tail = pymlxc.train(model, repeat_data, tmp_path / "resumed", config=config, resume=True).step_losses
    assert tail == straight[4:]
    with pytest.raises(ValueError, match="checkpoint is at step 8"), load(llama_dir) as model:
        pymlxc.train(model, repeat_data, tmp_path / "resumed", config=config, resume=True)


def test_bfloat16_adapters_with_dropout_and_checkpointing_train(llama_dir: Path, repeat_data: Path,
                                                                 tmp_path: Path) -> None:
    lora = LoRAConfig(rank=4, alpha=8, dtype="bfloat16", dropout=0.1)
    losses = []
    for i in range(2):
        with load(llama_dir) as model:
            result = pymlxc.train(model, repeat_data, tmp_path / f"bf{i}", lora=lora, iters=12, grad_checkpoint=True,
                                  max_grad_norm=1.0, lr_schedule="cosine", warmup_steps=2, **FAST)
            assert all(v.dtype == mx.bfloat16 for v in model.adapter.trainable_parameters().values())
            losses.append(result.step_losses)
    assert losses[0] == losses[1]  # dropout masks come from the seed too
    assert np.mean(losses[0][-3:]) < np.mean(losses[0][:3])


def test_valid_split_and_prompt_completion_data(llama_dir: Path, tmp_path: Path) -> None:
    data = tmp_path / "pc.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Q{i}: what sat?", "completion": "the cat sat."}) + "\n"
                            for i in range(10)), encoding="utf-8")
    with load(llama_dir) as model:
        result = pymlxc.train(model, data, tmp_path / "a", lora=LORA, iters=4, valid_split=0.2, **FAST)
    assert result.val_losses and np.isfinite(result.val_losses[-1][1])


def test_training_keeps_the_base_frozen(llama_dir: Path, repeat_data: Path, tmp_path: Path) -> None:
    with load(llama_dir) as model:
        before = {k: np.array(v) for k, v in model.model.parameters().items() if "lora" not in k}
        pymlxc.train(model, repeat_data, tmp_path / "a", lora=LORA, iters=3, **FAST)
        after = {k.replace(".linear.", "."): v for k, v in model.model.parameters().items()}  # wrapped bases
        for k, v in before.items():
            np.testing.assert_array_equal(np.array(after[k]), v)

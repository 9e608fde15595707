"""Every architecture: LoRA trains, and its adapter serves in mlx-lm (and back through PEFT's format)
with the same logits; multimodal wrappers (gemma3, gemma4) get mlx-lm's and transformers' names."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import pymlxc
from pymlxc.testing import ARCHITECTURES, write_tiny_model
from pymlxc.training import LoRAConfig, TrainConfig, Trainer
from pymlxc.training.data import Example, make_batch

from .conftest import load
from .test_interop import PROMPT, _ours, _trained_like


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_adapter_round_trips_through_mlx_lm_and_peft(arch: str, tmp_path: Path) -> None:
    import mlx.core as M
    import mlx_lm
    from safetensors import safe_open

    path = write_tiny_model(tmp_path / "m", arch, seed=0)
    with load(path) as model:
        adapter = model.apply_lora(LoRAConfig(rank=4, alpha=8, target_keys=("q_proj", "v_proj", "o_proj")))
        ids = model.encode(PROMPT)
        trainer = Trainer(model, TrainConfig(learning_rate=1e-3), adapter)
        model.set_grad_checkpoint(True)
        first = trainer.step(make_batch([Example(tuple(ids), 0, "x")], 64))
        model.set_grad_checkpoint(False)
        assert np.isfinite(first)
        _trained_like(model)
        adapter.save(tmp_path / "mlx")
        adapter.save(tmp_path / "peft", format="peft")
        ours = _ours(model, ids)
    ref, _ = mlx_lm.load(str(path), adapter_path=str(tmp_path / "mlx"))
    np.testing.assert_allclose(np.array(ref(M.array([ids]))), ours, rtol=1e-4, atol=1e-4)
    with pymlxc.load_model(str(path), backend="metal", adapter_path=str(tmp_path / "peft")) as model:
        np.testing.assert_allclose(_ours(model, ids), ours, rtol=1e-5, atol=1e-5)
    with safe_open(str(tmp_path / "peft" / "adapter_model.safetensors"), "numpy") as f:
        first_name = sorted(f.keys())[0]
    wrapped = arch in ("gemma3", "gemma4", "qwen3_5", "qwen3_5_moe")
    first = 1 if arch in ("qwen3_next", "qwen3_5", "qwen3_5_moe") else 0  # layer 0 is linear attention there
    assert first_name.startswith(f"base_model.model.model.language_model.layers.{first}." if wrapped
                                 else f"base_model.model.model.layers.{first}.")


def test_fused_multimodal_wrapper_loads_in_mlx_lm(tmp_path: Path) -> None:
    import mlx.core as M
    import mlx_lm

    path = write_tiny_model(tmp_path / "m", "gemma3", seed=0)
    with load(path) as model:
        model.apply_lora(LoRAConfig(rank=4, alpha=8))
        _trained_like(model)
        ids = model.encode(PROMPT)
        adapted = _ours(model, ids)
        out = model.save_fused(tmp_path / "fused", path)
    ref, _ = mlx_lm.load(str(out))
    np.testing.assert_allclose(np.array(ref(M.array([ids]))), adapted, rtol=1e-4, atol=1e-4)
    with load(out) as fused:
        np.testing.assert_allclose(_ours(fused, ids), adapted, rtol=1e-4, atol=1e-4)


def test_resume_on_a_multimodal_wrapper(tmp_path: Path) -> None:
    # its adapters.safetensors carries mlx-lm's `language_model.` names; resuming must not care
    import json

    path = write_tiny_model(tmp_path / "m", "gemma3", seed=0)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": "the cat sat on the mat"}) + "\n" for _ in range(4)))
    options = dict(batch_size=2, learning_rate=1e-3, progress=False, save_every=2)
    with load(path) as model:
        straight = pymlxc.train(model, data, tmp_path / "a", iters=4, **options).step_losses
    with load(path) as model:
        pymlxc.train(model, data, tmp_path / "b", iters=2, **options)
    with load(path) as model:
        tail = pymlxc.train(model, data, tmp_path / "b", iters=4, resume=True, **options).step_losses
    assert tail == straight[2:]
    assert (tmp_path / "b" / "0000002_adapters.safetensors").is_file()

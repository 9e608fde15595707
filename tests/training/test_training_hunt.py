"""LoRA dropout under gradient checkpointing, a refused step that leaves the optimizer as it was,
adapter scales that are no positive number, and GGUF block layers that LoRA cannot wrap."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pymlxc.core as mx
from pymlxc.testing import write_tiny_model
from pymlxc.training import AdapterError, LoRAConfig, TrainConfig, Trainer, masked_cross_entropy
from pymlxc.training.data import Example, make_batch

from .conftest import load

BATCH = make_batch([Example(tuple(range(3, 15)), 4, "a"), Example(tuple(range(40, 49)), 0, "b")], 64)


def _dropout_grads(path: Path, checkpoint: bool, dropout: float, seed: int) -> tuple[float, dict, np.ndarray]:
    """(loss, gradients, the dropout key after the step) of one value_and_grad with LoRA dropout on."""
    with load(path) as model:
        adapter = model.apply_lora(LoRAConfig(rank=4, alpha=8, dropout=dropout), seed=0)
        rng = np.random.default_rng(0)
        params = {k: mx.array(rng.standard_normal(v.shape).astype(np.float32) * 0.1)
                  for k, v in adapter.trainable_parameters().items()}
        adapter.update(params)
        adapter.set_training(True)
        model.set_grad_checkpoint(checkpoint)

        def loss(p: dict) -> mx.Array:
            adapter.update(p)
            return masked_cross_entropy(model.logits(BATCH.inputs), BATCH.targets, BATCH.mask)[0]

        adapter.reseed_dropout(seed)
        value, grads = mx.value_and_grad(loss)(params)
        mx.eval(value, grads)
        return (float(value.item()), {k: np.array(g) for k, g in grads.items()},
                np.array(adapter.dropout_keys.state))


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(dropout=st.sampled_from([0.1, 0.5, 0.9]), seed=st.integers(0, 2**31 - 1))
def test_gradient_checkpointing_takes_gradients_through_the_forward_dropout_masks(
        llama_dir: Path, dropout: float, seed: int) -> None:
    # MLX runs a checkpointed block again in the backward pass; its LoRA dropout drew new masks there,
    # so the gradients belonged to other masks than the loss did.
    plain_loss, plain, plain_key = _dropout_grads(llama_dir, False, dropout, seed)
    ck_loss, ck, ck_key = _dropout_grads(llama_dir, True, dropout, seed)
    assert ck_loss == pytest.approx(plain_loss, rel=1e-6)
    for name, g in plain.items():
        np.testing.assert_allclose(ck[name], g, rtol=1e-4, atol=1e-6, err_msg=name)
    np.testing.assert_array_equal(ck_key, plain_key)  # the keys move on as after one forward pass


def _params(adapter) -> dict[str, np.ndarray]:  # noqa: ANN001
    return {k: np.array(v) for k, v in adapter.trainable_parameters().items()}


@pytest.mark.parametrize("failure", ["overflow", "nan loss"])
def test_a_refused_step_leaves_the_optimizer_as_it_was(llama_dir: Path, failure: str) -> None:
    # The adapter got its weights back, but the optimizer kept the refused step's count and moments
    # (a NaN gradient in them made every later step NaN).
    b1 = make_batch([Example(tuple(range(3, 15)), 0, "a")], 64)
    b2 = make_batch([Example(tuple(range(20, 30)), 0, "b")], 64)
    runs = []
    for refused in (False, True):
        with load(llama_dir) as model:
            adapter = model.apply_lora(LoRAConfig(rank=4))
            trainer = Trainer(model, TrainConfig(learning_rate=1e-2), adapter)
            trainer.step(b1)
            if refused:
                before = _params(adapter)
                if failure == "overflow":
                    trainer.optimizer.learning_rate = 1e39  # the update overflows float32
                    bad = b2
                else:  # a NaN in the logits' path: loss and gradients are NaN
                    bad = b2
                    weights = trainer.params
                    poisoned = {k: (v * float("nan") if k.endswith("lora_a") else v) for k, v in weights.items()}
                    trainer.params = poisoned
                with pytest.raises(FloatingPointError, match="at step 2"):
                    trainer.step(bad)
                if failure == "overflow":
                    trainer.optimizer.learning_rate = 1e-2
                else:
                    trainer.params = weights
                    adapter.update(weights)
                after = _params(adapter)
                for k, v in before.items():
                    np.testing.assert_array_equal(after[k], v, err_msg=k)
                assert trainer.optimizer.step == 1
            loss = trainer.step(b1)
            runs.append((loss, _params(adapter), trainer.optimizer.step))
    (loss_a, params_a, step_a), (loss_b, params_b, step_b) = runs
    assert np.isfinite(loss_b) and loss_b == loss_a and step_b == step_a == 2
    for k, v in params_a.items():
        np.testing.assert_array_equal(params_b[k], v, err_msg=k)


@pytest.fixture(scope="module")
def saved_adapters(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("scales")
    with load(llama_dir) as model:
        model.apply_lora(LoRAConfig(rank=4, target_keys=("q_proj", "v_proj")))
        model.adapter.save(root / "mlx")
        model.adapter.save(root / "peft", format="peft")
    return root


@pytest.mark.parametrize("value", [0, 0.0, -2.0, -1e-9])
@pytest.mark.parametrize("case", ["mlx scale", "peft lora_alpha", "peft alpha_pattern"])
def test_an_adapter_scale_that_is_not_positive_names_the_file_and_key(
        saved_adapters: Path, llama_dir: Path, tmp_path: Path, value: float, case: str) -> None:
    # A zero or negative scale passed the reader and failed in LoRAConfig with "alpha must be a
    # finite number > 0", a ValueError naming neither the file nor the key it came from.
    kind = case.split()[0]
    ad = Path(shutil.copytree(saved_adapters / kind, tmp_path / kind))
    config = json.loads((ad / "adapter_config.json").read_text())
    if case == "mlx scale":
        config["lora_parameters"]["scale"] = value
        key = "'scale'"
    elif case == "peft lora_alpha":
        config["lora_alpha"] = value
        key = "'lora_alpha'"
    else:
        config["alpha_pattern"] = {"model.layers.0.self_attn.q_proj": value}
        key = r"alpha_pattern\['model.layers.0.self_attn.q_proj'\]"
    (ad / "adapter_config.json").write_text(json.dumps(config))
    with load(llama_dir) as model:
        with pytest.raises(AdapterError, match=rf"adapter_config\.json: {key} must be a finite number > 0"):
            model.load_adapter(ad)
        assert model.adapter is None and not any("lora" in k for k in model.model.parameters())


def test_lora_does_not_skip_gguf_block_layers_silently(tmp_path: Path) -> None:
    # A GGUF file of mixed types loads a Q8_0 tensor as a QuantizedLinear and a K-quant as a
    # BlockLinear; apply_lora wrapped the first and left the second out without a word.
    pytest.importorskip("gguf")
    from pymlxc.backends.metal.gguf_layers import QType
    from pymlxc.testing_gguf import export_gguf

    path = write_tiny_model(tmp_path / "m", "llama", seed=0, hidden_size=256, num_heads=4)
    gguf_file = export_gguf(path, tmp_path / "m.gguf", QType.Q8_0, extra_types={"blk.0.attn_v.weight": QType.Q6_K})
    with load(gguf_file) as model:
        with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.v_proj holds GGUF Q6_K blocks"):
            model.apply_lora(LoRAConfig(rank=4, target_keys=("q_proj", "v_proj")))
        assert model.adapter is None and not any("lora" in k for k in model.model.parameters())
        # the layers LoRA can wrap still take an adapter
        adapter = model.apply_lora(LoRAConfig(rank=4, target_keys=("q_proj",)))
        assert adapter.modules == ["model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj"]


def test_a_checkpoint_whose_arrays_and_state_disagree_is_refused(llama_dir: Path, repeat_data: Path,
                                                                   tmp_path: Path) -> None:
    # save_checkpoint replaces training_state.safetensors, then training_state.json: a run stopped
    # between the two left the new weights and moments beside the old step, and resuming took them
    # as that step's (a run that was neither the broken one nor an unbroken one).
    import pymlxc
    from pymlxc.training.trainer import STATE_FILE

    options = dict(batch_size=2, learning_rate=1e-3, progress=False, save_every=2)
    out = tmp_path / "a"
    with load(llama_dir) as model:
        pymlxc.train(model, repeat_data, out, lora=LoRAConfig(rank=4), iters=2, **options)
    old_state = (out / STATE_FILE).read_text()
    with load(llama_dir) as model:
        pymlxc.train(model, repeat_data, out, iters=4, resume=True, **options)
    (out / STATE_FILE).write_text(old_state)  # as if the step-4 save stopped before its last replace
    with load(llama_dir) as model:
        with pytest.raises(ValueError, match=r"training_state\.safetensors holds the weights of step 4, and .*"
                                             r"training_state\.json says 2"):
            pymlxc.train(model, repeat_data, out, iters=6, resume=True, **options)
        assert model.adapter is None

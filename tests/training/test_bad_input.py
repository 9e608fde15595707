"""Deliberate errors: adapters that do not fit, broken configs, bad datasets, bad options."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import pymlxc
import pymlxc.core as mx
from pymlxc.training import AdapterError, DatasetError, LoRAConfig, TrainConfig

from .conftest import load


@pytest.fixture(scope="module")
def llama_adapter(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ad") / "llama_adapter"
    with load(llama_dir) as model:
        model.apply_lora(LoRAConfig(rank=4, target_keys=("q_proj", "v_proj")))
        model.adapter.save(path)
    return path


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_adapter_for_another_architecture(llama_adapter: Path, qwen2_dir: Path, tmp_path: Path) -> None:
    with load(qwen2_dir) as model:
        with pytest.raises(AdapterError, match="trained on a 'llama' model, this is 'qwen2'"):
            model.load_adapter(llama_adapter)
        # without the model_type hint (as mlx-lm writes it) the shapes still give it away
        ad = _copy(llama_adapter, tmp_path / "no_type")
        config = json.loads((ad / "adapter_config.json").read_text())
        del config["model_type"]
        (ad / "adapter_config.json").write_text(json.dumps(config))
        with pytest.raises(AdapterError, match=r"(?s)does not fit.*q_proj: adapter maps 64 -> 64, the layer 96 -> 96"):
            model.load_adapter(ad)
        assert model.adapter is None and not any("lora" in k for k in model.model.parameters())


def test_adapter_with_wrong_shapes_or_names(llama_adapter: Path, llama_dir: Path, tmp_path: Path) -> None:
    tensors, _ = mx.load_safetensors(llama_adapter / "adapters.safetensors")
    bad = _copy(llama_adapter, tmp_path / "bad_rank")
    name = "model.layers.0.self_attn.q_proj.lora_b"
    mx.save_safetensors(bad / "adapters.safetensors", {**tensors, name: mx.zeros((3, 64))})
    with load(llama_dir) as model, pytest.raises(AdapterError, match=r"has lora_a .* and lora_b"):
        model.load_adapter(bad)
    mx.save_safetensors(bad / "adapters.safetensors",
                        {**tensors, "model.layers.7.self_attn.q_proj.lora_a": mx.zeros((64, 4)),
                         "model.layers.7.self_attn.q_proj.lora_b": mx.zeros((4, 64))})
    with (
        load(llama_dir) as model,
        pytest.raises(AdapterError, match=r"model\.layers\.7\.self_attn\.q_proj: no such linear layer"),
    ):
        model.load_adapter(bad)
    mx.save_safetensors(
        bad / "adapters.safetensors", {**tensors, "model.layers.0.self_attn.q_proj.weight": mx.zeros((1,))}
    )
    with load(llama_dir) as model, pytest.raises(AdapterError, match="is not a LoRA weight"):
        model.load_adapter(bad)
    only_a = {k: v for k, v in tensors.items() if not k.endswith("layers.1.self_attn.v_proj.lora_b")}
    mx.save_safetensors(bad / "adapters.safetensors", only_a)
    with (
        load(llama_dir) as model,
        pytest.raises(AdapterError, match=r"'model\.layers\.1\.self_attn\.v_proj' has no lora_b"),
    ):
        model.load_adapter(bad)


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.pop("lora_parameters"), "missing required key 'lora_parameters'"),
    (lambda c: c.pop("num_layers"), "missing required key 'num_layers'"),
    (lambda c: c["lora_parameters"].pop("scale"), "missing required key 'scale'"),
    (lambda c: c["lora_parameters"].pop("rank"), "missing required key 'rank'"),
    (lambda c: c["lora_parameters"].update(rank="8"), "'rank' must be int"),
    (lambda c: c["lora_parameters"].update(rank=16), "has rank 4, the config says 16"),
    (lambda c: c.update(fine_tune_type="dora"), "fine_tune_type 'dora' is not supported"),
])
def test_mlx_adapter_config_errors(llama_adapter: Path, llama_dir: Path, tmp_path: Path, edit, message: str) -> None:  # noqa: ANN001
    ad = _copy(llama_adapter, tmp_path / "ad")
    config = json.loads((ad / "adapter_config.json").read_text())
    edit(config)
    (ad / "adapter_config.json").write_text(json.dumps(config))
    with load(llama_dir) as model, pytest.raises(AdapterError, match=message):
        model.load_adapter(ad)


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.pop("r"), "missing required key 'r'"),
    (lambda c: c.pop("lora_alpha"), "missing required key 'lora_alpha'"),
    (lambda c: c.pop("target_modules"), "missing required key 'target_modules'"),
    (lambda c: c.update(use_dora=True), "use_dora=true is not supported"),
    (lambda c: c.update(peft_type="IA3"), "peft_type 'IA3' is not supported"),
])
def test_peft_adapter_config_errors(llama_adapter: Path, llama_dir: Path, tmp_path: Path, edit, message: str) -> None:  # noqa: ANN001
    with load(llama_dir) as model:
        model.load_adapter(llama_adapter)
        model.adapter.save(tmp_path / "peft", format="peft")
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    edit(config)
    (tmp_path / "peft" / "adapter_config.json").write_text(json.dumps(config))
    with load(llama_dir) as model, pytest.raises(AdapterError, match=message):
        model.load_adapter(tmp_path / "peft")


def test_adapter_directory_problems(llama_dir: Path, tmp_path: Path) -> None:
    with load(llama_dir) as model:
        with pytest.raises(AdapterError, match="no such adapter directory"):
            model.load_adapter(tmp_path / "missing")
        (tmp_path / "empty").mkdir()
        with pytest.raises(AdapterError, match=r"neither adapters\.safetensors"):
            model.load_adapter(tmp_path / "empty")
        (tmp_path / "noconf").mkdir()
        mx.save_safetensors(tmp_path / "noconf" / "adapters.safetensors", {"a.lora_a": mx.zeros((1, 1))})
        with pytest.raises(AdapterError, match=r"no adapter_config\.json"):
            model.load_adapter(tmp_path / "noconf")
        (tmp_path / "noconf" / "adapter_config.json").write_text("{not json")
        with pytest.raises(AdapterError, match=r"adapter_config\.json: malformed JSON"):
            model.load_adapter(tmp_path / "noconf")
    with pytest.raises(AdapterError, match="no such adapter directory"):
        pymlxc.load_model(str(llama_dir), backend="metal", adapter_path=str(tmp_path / "missing"))


def test_one_adapter_at_a_time_and_unknown_keys(llama_dir: Path, llama_adapter: Path) -> None:
    with load(llama_dir) as model:
        with pytest.raises(ValueError, match=r"name no linear layer.*linears in a block: .*self_attn\.q_proj"):
            model.apply_lora(LoRAConfig(target_keys=("query",)))
        with pytest.raises(ValueError, match="num_layers=5 but the model has 2 blocks"):
            model.apply_lora(LoRAConfig(num_layers=5))
        model.apply_lora()
        with pytest.raises(RuntimeError, match="already has an adapter"):
            model.load_adapter(llama_adapter)
        model.remove_adapter()
        assert not any("lora" in k for k in model.model.parameters())
        model.load_adapter(llama_adapter)


@pytest.mark.parametrize("kwargs", [dict(rank=0), dict(alpha=0), dict(target_keys=()), dict(dropout=1.0),
                                    dict(dtype="float16"), dict(num_layers=0)])
def test_bad_lora_config(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        LoRAConfig(**kwargs)


@pytest.mark.parametrize("kwargs", [dict(iters=0), dict(batch_size=0), dict(valid_split=1.0),
                                    dict(lr_schedule="linear"), dict(val_batches=0)])
def test_bad_train_config(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        TrainConfig(**kwargs)


def test_bad_datasets_through_train(llama_dir: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text("")
    with load(llama_dir) as model:
        with pytest.raises(DatasetError, match=r"train\.jsonl: the dataset is empty"):
            pymlxc.train(model, data, tmp_path / "ad", iters=1, progress=False)
        (data / "train.jsonl").write_text('{"text": "fine"}\n{"text": "broken\n')
        with pytest.raises(DatasetError, match=r"train\.jsonl:2: malformed JSON"):
            pymlxc.train(model, data, tmp_path / "ad", iters=1, progress=False)
        (data / "train.jsonl").write_text('{"text": "fine"}\n')
        (data / "valid.jsonl").write_text('{"text": "ok"}\n{"messages": "nope"}\n')
        with pytest.raises(DatasetError, match=r"valid\.jsonl:2: a 'chat' record in a 'text' dataset"):
            pymlxc.train(model, data, tmp_path / "ad", iters=1, progress=False)
        with pytest.raises(FileNotFoundError, match="cannot resume"):
            pymlxc.train(model, data, tmp_path / "nothing", iters=1, resume=True, progress=False)
        (tmp_path / "listed").mkdir()
        (tmp_path / "listed" / "training_state.json").write_text("[1, 2]")
        with pytest.raises(ValueError, match=r"listed/training_state\.json: expected a JSON object, got list"):
            pymlxc.train(model, data, tmp_path / "listed", iters=1, resume=True, progress=False)
        with pytest.raises(TypeError, match=r"unexpected keyword|got an unexpected"):
            pymlxc.train(model, data, tmp_path / "ad", iterations=1)


def test_models_that_cannot_train_are_named() -> None:
    class NotTrainable:
        pass

    with pytest.raises(TypeError, match="NotTrainable cannot be trained here"):
        pymlxc.train(NotTrainable(), "data", progress=False)

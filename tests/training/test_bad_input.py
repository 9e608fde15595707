"""Deliberate errors: adapters that do not fit, broken configs, bad datasets, bad options."""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reliability.hostile_safetensors import (
    CASE_IDS,
    DIMS,
    WRAPPING_DIMS,
    bytes_as_mlx_counts,
    widen_first_dim,
    write_case,
    write_safetensors,
)
from reliability.subproc import run_case

import pymlxc
import pymlxc.core as mx
from pymlxc.training import AdapterError, DatasetError, LoRAConfig, TrainConfig
from pymlxc.training.adapters import read_adapter

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
    # Values that used to escape as raw TypeError/ValueError/OverflowError or load silently as NaN.
    (lambda c: c["lora_parameters"].update(rank=0), "'rank' must be a positive integer rank, not 0"),
    (lambda c: c["lora_parameters"].update(scale=float("nan")), "'scale' must be a finite number, not nan"),
    (lambda c: c["lora_parameters"].update(scale=float("inf")), "'scale' must be a finite number, not inf"),
    (lambda c: c["lora_parameters"].update(scale=10**400), "'scale' must be a finite number"),
    (lambda c: c["lora_parameters"].update(dropout="abc"), "'dropout' must be a number, not 'abc'"),
    (lambda c: c["lora_parameters"].update(dropout=[1]), r"'dropout' must be a number, not \[1\]"),
    (lambda c: c["lora_parameters"].update(dropout=-0.5), "'dropout' must be a finite number >= 0, not -0.5"),
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
    # Values that used to escape as raw errors (ZeroDivisionError, AttributeError, re.error, ...)
    # or change the scales silently (bool("false") is True).
    (lambda c: c.update(r=0), "'r' must be a positive integer rank, not 0"),
    (lambda c: c.update(lora_alpha=float("nan")), "'lora_alpha' must be a finite number, not nan"),
    (lambda c: c.update(lora_dropout="x"), "'lora_dropout' must be a number, not 'x'"),
    (lambda c: c.update(use_rslora="false"), "'use_rslora' must be true or false, not 'false'"),
    (lambda c: c.update(rank_pattern=[1]), "'rank_pattern' must be an object of module patterns"),
    (lambda c: c.update(rank_pattern={"q_proj": "x"}), r"rank_pattern\['q_proj'\] must be a positive integer rank"),
    (lambda c: c.update(rank_pattern={"q_proj": 0}), r"rank_pattern\['q_proj'\] must be a positive integer rank"),
    (lambda c: c.update(alpha_pattern={"(": 3}), "'alpha_pattern' has an invalid pattern '\\('"),
    (lambda c: c.update(alpha_pattern={"q_proj": "x"}), r"alpha_pattern\['q_proj'\] must be a number"),
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


def test_a_deeply_nested_adapter_config_is_named(llama_adapter: Path, llama_dir: Path, tmp_path: Path) -> None:
    """json.loads raises RecursionError (not JSONDecodeError) for deep nesting: still an AdapterError."""
    ad = _copy(llama_adapter, tmp_path / "ad")
    (ad / "adapter_config.json").write_text("[" * 100_000)
    with (
        load(llama_dir) as model,
        pytest.raises(AdapterError, match=r"adapter_config\.json: malformed JSON: nested too deeply"),
    ):
        model.load_adapter(ad)


@pytest.mark.parametrize("dtype", ["int32", "bool_"])
def test_adapter_tensors_must_be_floating(llama_adapter: Path, llama_dir: Path, tmp_path: Path, dtype: str) -> None:
    """An integer or bool lora_a used to be cast and loaded as if it were trained weights."""
    ad = _copy(llama_adapter, tmp_path / "ad")
    tensors, _ = mx.load_safetensors(ad / "adapters.safetensors")
    name = "model.layers.0.self_attn.q_proj.lora_a"
    bad = mx.zeros(tensors[name].shape, getattr(mx, dtype))
    mx.save_safetensors(ad / "adapters.safetensors", {**tensors, name: bad})
    with load(llama_dir) as model:
        with pytest.raises(AdapterError, match=rf"{name} is {dtype.rstrip('_')}, not a floating-point tensor"):
            model.load_adapter(ad)
        assert model.adapter is None


@pytest.fixture(scope="module")
def peft_adapter(llama_adapter: Path, llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ad") / "peft_adapter"
    with load(llama_dir) as model:
        model.load_adapter(llama_adapter)
        model.adapter.save(path, format="peft")
    return path


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fmt=st.sampled_from(["mlx", "peft"]), value=st.sampled_from([np.nan, np.inf, -np.inf]),
       pick=st.floats(0, 1, exclude_max=True), spot=st.floats(0, 1, exclude_max=True))
def test_nan_or_infinity_in_adapter_weights_is_refused_by_name(llama_adapter: Path, peft_adapter: Path,
                                                               llama_dir: Path,
                                                               tmp_path_factory: pytest.TempPathFactory, fmt: str,
                                                               value: float, pick: float, spot: float) -> None:
    """A LoRA weight holding NaN or infinity used to load silently (every output then NaN)."""
    source, weights = (llama_adapter, "adapters.safetensors") if fmt == "mlx" else (
        peft_adapter, "adapter_model.safetensors")
    ad = _copy(source, tmp_path_factory.mktemp("nonfinite") / "ad")
    tensors, metadata = mx.load_safetensors(ad / weights)
    names = sorted(tensors)
    name = names[int(pick * len(names))]
    flat = mx.reshape(tensors[name], (-1,))
    at = mx.arange(flat.shape[0]) == int(spot * flat.shape[0])
    bad = mx.reshape(mx.where(at, mx.array(value, flat.dtype), flat), tensors[name].shape)
    mx.save_safetensors(ad / weights, {**tensors, name: bad}, metadata)
    with load(llama_dir) as model:
        with pytest.raises(AdapterError, match=rf"^{re.escape(str(ad / weights))}: tensor '{re.escape(name)}' "
                                               "holds NaN or infinite values"):
            model.load_adapter(ad)
        assert model.adapter is None and not any("lora" in k for k in model.model.parameters())


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
                                    dict(dtype="float16"), dict(num_layers=0), dict(alpha=float("nan")),
                                    dict(alpha=float("inf"))])
def test_bad_lora_config(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        LoRAConfig(**kwargs)


@pytest.mark.parametrize("kwargs", [dict(iters=0), dict(batch_size=0), dict(valid_split=1.0),
                                    dict(lr_schedule="linear"), dict(val_batches=0)])
def test_bad_train_config(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        TrainConfig(**kwargs)


@pytest.mark.parametrize(("name", "value"), [
    ("learning_rate", float("nan")), ("learning_rate", float("inf")), ("eps", float("nan")), ("eps", 0.0),
    ("weight_decay", float("nan")), ("weight_decay", -0.1), ("max_grad_norm", float("inf")),
    ("max_grad_norm", 0.0), ("betas", (0.9, float("nan"))), ("betas", (1.0, 0.999)), ("betas", (0.9,)),
    ("warmup_steps", -5)])
def test_train_config_numbers_a_step_cannot_use_are_refused_by_name(name: str, value: object) -> None:
    """A NaN learning rate would make every weight NaN at the first step, a negative warmup a
    negative learning rate (training that climbs the loss): refused when the config is made, by name."""
    with pytest.raises(ValueError, match=name):
        TrainConfig(**{name: value})


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


@pytest.fixture(scope="module")
def checkpoint(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(data, an adapter directory with a resumable checkpoint at step 2)."""
    root = tmp_path_factory.mktemp("resume")
    data = root / "data"
    data.mkdir()
    (data / "train.jsonl").write_text("".join(json.dumps({"text": "the cat sat on the mat " * 3}) + "\n"
                                              for _ in range(4)))
    with load(llama_dir) as model:
        pymlxc.train(model, data, root / "ad", lora=LoRAConfig(rank=2), iters=2, batch_size=2, save_every=1,
                     progress=False)
    return data, root / "ad"


def _drop(state: dict, key: str) -> None:
    del state[key]


@pytest.mark.parametrize("edit, message", [
    # Used to escape as KeyError / TypeError / ValueError without the file's name ...
    (lambda s: _drop(s, "lora"), "'lora' must be a LoRA config"),
    (lambda s: s["lora"].update(bogus=1), "'lora' is not a LoRA config: .*bogus"),
    (lambda s: s["lora"].update(target_keys=5), "'lora' must be a LoRA config with a list of target_keys"),
    (lambda s: s.update(step="x"), "'step' must be a step number >= 0, not 'x'"),
    (lambda s: _drop(s, "optimizer_step"), "'optimizer_step' must be a step number >= 0, not None"),
    (lambda s: s.update(train_losses=[1, 2]), r"'train_losses' must be a list of \[step, loss\] pairs"),
    # ... or to be used as they were: a negative step, losses that are no pairs.
    (lambda s: s.update(step=-3), "'step' must be a step number >= 0, not -3"),
    (lambda s: s.update(step=1.5), "'step' must be a step number >= 0, not 1.5"),
    (lambda s: s.update(val_losses="abc"), r"'val_losses' must be a list of \[step, loss\] pairs"),
])
def test_a_damaged_training_state_is_named(checkpoint: tuple[Path, Path], llama_dir: Path, tmp_path: Path,
                                           edit, message: str) -> None:  # noqa: ANN001
    data, good = checkpoint
    ad = _copy(good, tmp_path / "ad")
    state = json.loads((ad / "training_state.json").read_text())
    edit(state)
    (ad / "training_state.json").write_text(json.dumps(state))
    with load(llama_dir) as model:
        with pytest.raises(ValueError, match=r"training_state\.json: " + message):
            pymlxc.train(model, data, ad, iters=4, batch_size=2, resume=True, progress=False)
        assert model.adapter is None


@pytest.mark.parametrize("which, shape, dtype", [
    ("opt", (1,), "float32"),  # broadcast silently into every step's update before
    ("opt", (3, 3), "float32"),  # MLX's broadcast error mid-step before
    ("params", (3, 3), "float32"),  # MLX's matmul error mid-step before
    ("params", None, "int32"),  # cast and trained from before
])
def test_checkpoint_arrays_unlike_the_adapter_are_refused(checkpoint: tuple[Path, Path], llama_dir: Path,
                                                           tmp_path: Path, which: str, shape: tuple | None,
                                                           dtype: str) -> None:
    data, good = checkpoint
    ad = _copy(good, tmp_path / "ad")
    arrays, _ = mx.load_safetensors(ad / "training_state.safetensors")
    name = next(n for n in sorted(arrays) if n.startswith(f"{which}.") and n.endswith(".m" if which == "opt" else "a"))
    arrays = {**arrays, name: mx.zeros(shape or arrays[name].shape, getattr(mx, dtype))}
    mx.save_safetensors(ad / "training_state.safetensors", arrays)
    with load(llama_dir) as model:
        with pytest.raises(ValueError, match=rf"training_state\.safetensors: {re.escape(name)} is {dtype}"):
            pymlxc.train(model, data, ad, iters=4, batch_size=2, resume=True, progress=False)
        assert model.adapter is None


def test_an_intact_checkpoint_still_resumes(checkpoint: tuple[Path, Path], llama_dir: Path, tmp_path: Path) -> None:
    data, good = checkpoint
    ad = _copy(good, tmp_path / "ad")
    with load(llama_dir) as model:
        result = pymlxc.train(model, data, ad, iters=3, batch_size=2, resume=True, progress=False)
    assert result.steps == 3


def test_models_that_cannot_train_are_named() -> None:
    class NotTrainable:
        pass

    with pytest.raises(TypeError, match="NotTrainable cannot be trained here"):
        pymlxc.train(NotTrainable(), "data", progress=False)


@pytest.mark.parametrize("which", ["train", "valid"])
def test_a_prompt_that_fills_max_seq_length_is_named(llama_dir: Path, tmp_path: Path, which: str) -> None:
    """Cut to max_seq_length, such a record kept no completion token: the run trained on 0 tokens
    and reported a loss of 0.0000 (a valid.jsonl of them, a validation loss of nan)."""
    data = tmp_path / "data"
    data.mkdir()
    short = json.dumps({"prompt": "hi", "completion": "yes"})
    long = json.dumps({"prompt": "a long prompt " * 10, "completion": "yes"})
    (data / "train.jsonl").write_text(f"{short}\n{long}\n" if which == "train" else f"{short}\n{short}\n")
    (data / "valid.jsonl").write_text(f"{long}\n" if which == "valid" else f"{short}\n")
    with load(llama_dir) as model:
        with pytest.raises(DatasetError, match=rf"{which}\.jsonl:\d: no token of the record counts in the loss: "
                                               r"its prompt alone is \d+ tokens, and max_seq_length is 24"):
            pymlxc.train(model, data, tmp_path / "ad", iters=2, batch_size=1, max_seq_length=24, progress=False)
        assert model.adapter is None


@pytest.mark.parametrize(("config", "name", "value"), [
    (TrainConfig, "iters", 2.5), (TrainConfig, "iters", True), (TrainConfig, "batch_size", "4"),
    (TrainConfig, "max_seq_length", 64.0), (TrainConfig, "seed", -1), (TrainConfig, "warmup_steps", 1.5),
    (TrainConfig, "learning_rate", "1e-4"), (TrainConfig, "weight_decay", True), (TrainConfig, "betas", ("a", 0.9)),
    (LoRAConfig, "rank", True), (LoRAConfig, "rank", 2.0), (LoRAConfig, "num_layers", 1.5),
    (LoRAConfig, "alpha", "16"), (LoRAConfig, "dropout", False),
])
def test_config_values_of_the_wrong_type_are_refused_by_name(config: type, name: str, value: object) -> None:
    """Bools were taken as 1, floats failed deep in the run (range(2.5)), strings raised a
    comparison's TypeError without the field's name, a negative seed numpy's own error."""
    with pytest.raises(ValueError, match=name):
        config(**{name: value})


def test_numpy_numbers_in_configs_become_plain_ones(llama_dir: Path, repeat_data: Path, tmp_path: Path) -> None:
    """A numpy int64 or float32 passed every step, then failed the checkpoint's json.dumps."""
    config = TrainConfig(iters=np.int64(2), batch_size=np.int32(2), learning_rate=np.float32(1e-3),
                         betas=(np.float32(0.9), 0.99), progress=False)
    assert type(config.iters) is int and type(config.learning_rate) is float and type(config.betas[0]) is float
    lora = LoRAConfig(rank=np.int64(2), alpha=np.float32(4))
    assert type(lora.rank) is int and type(lora.alpha) is float
    with load(llama_dir) as model:
        assert pymlxc.train(model, repeat_data, tmp_path / "ad", lora=lora, config=config).steps == 2


def test_resuming_with_another_lora_config_is_refused(checkpoint: tuple[Path, Path], llama_dir: Path,
                                                       tmp_path: Path) -> None:
    """The checkpoint's adapter (rank 2) resumed and the config asked for was ignored silently."""
    data, good = checkpoint
    ad = _copy(good, tmp_path / "ad")
    with load(llama_dir) as model:
        with pytest.raises(ValueError, match=r"differs from the checkpoint's: rank 4 \(checkpoint: 2\), target_keys"):
            pymlxc.train(model, data, ad, lora=LoRAConfig(rank=4, target_keys=("o_proj",)), iters=3, batch_size=2,
                         resume=True, progress=False)
        assert model.adapter is None
        assert pymlxc.train(model, data, ad, lora=LoRAConfig(rank=2), iters=3, batch_size=2, resume=True,
                            progress=False).steps == 3


def test_cli_resume_takes_the_checkpoints_lora_config(checkpoint: tuple[Path, Path], llama_dir: Path,
                                                      tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`pymlxc lora --resume` without LoRA options resumes the checkpoint's adapter; a LoRA option
    that differs from it is an error, not ignored."""
    from pymlxc.cli import main

    data, good = checkpoint
    ad = _copy(good, tmp_path / "ad")
    args = ["lora", str(llama_dir), "--data", str(data), "--adapter-path", str(ad), "--batch-size", "2", "--resume",
            "-q"]
    assert main([*args, "--iters", "4", "--rank", "8"]) == 1
    assert "rank 8 (checkpoint: 2)" in capsys.readouterr().err
    assert main([*args, "--iters", "3"]) == 0
    saved = json.loads((ad / "training_state.json").read_text())
    assert saved["step"] == 3 and saved["lora"]["rank"] == 2


def test_an_adapter_path_that_is_a_file_is_refused_before_training(llama_dir: Path, repeat_data: Path,
                                                                    tmp_path: Path) -> None:
    """It failed with a bare FileExistsError at the first checkpoint, the steps before it lost."""
    (tmp_path / "ad").write_text("not a directory")
    reports: list[object] = []
    with load(llama_dir) as model, pytest.raises(NotADirectoryError, match=r"adapter path .*ad is not a directory"):
        pymlxc.train(model, repeat_data, tmp_path / "ad", iters=4, batch_size=2, steps_per_report=1,
                     callback=reports.append, progress=False)
    assert reports == []


def test_a_one_step_cosine_run_trains(llama_dir: Path, repeat_data: Path, tmp_path: Path) -> None:
    """Its only step had a learning rate of 0: the run 'succeeded' with the adapter unchanged."""
    with load(llama_dir) as model:
        model.apply_lora(LoRAConfig(rank=2))
        before = {k: np.array(v) for k, v in model.adapter.trainable_parameters().items()}
        pymlxc.train(model, repeat_data, tmp_path / "ad", iters=1, batch_size=2, learning_rate=1e-2,
                     lr_schedule="cosine", progress=False)
        after = model.adapter.trainable_parameters()
        assert any(not np.array_equal(before[k], np.array(after[k])) for k in before)


# ---------------------------------------------------------------------- hostile safetensors files
# Adapter weights and a checkpoint's training state are safetensors files from the user's disk: their
# headers are checked before MLX's reader opens them (pymlxc.safetensors_check), which used to take a
# dimension past int32 as its low 32 bits and fail on others with a message naming no tensor.

_MLX_CONFIG = {"fine_tune_type": "lora", "num_layers": 2, "lora_parameters": {"rank": 2, "scale": 20.0}}
_PEFT_CONFIG = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}


def _adapter_dir(root: Path, fmt: str) -> Path:
    """An adapter directory of `fmt` with its config, its weights file left to the test."""
    root.mkdir(parents=True)
    (root / "adapter_config.json").write_text(json.dumps(_MLX_CONFIG if fmt == "mlx" else _PEFT_CONFIG))
    return root


def _weights(fmt: str) -> str:
    return "adapters.safetensors" if fmt == "mlx" else "adapter_model.safetensors"


@pytest.mark.parametrize("fmt", ["mlx", "peft"])
@pytest.mark.parametrize("case", CASE_IDS)
def test_a_hostile_adapter_weights_file_is_an_adapter_error(tmp_path: Path, case: str, fmt: str) -> None:
    ad = _adapter_dir(tmp_path / "ad", fmt)
    expected = write_case(ad / _weights(fmt), case, "adapter weights file")
    with pytest.raises(AdapterError) as info:
        read_adapter(ad)
    assert str(info.value).startswith(expected), str(info.value)


@pytest.mark.parametrize("fmt", ["mlx", "peft"])
def test_an_adapter_dimension_past_int32_is_refused_not_truncated(llama_adapter: Path, peft_adapter: Path,
                                                                  llama_dir: Path, tmp_path: Path, fmt: str) -> None:
    """A real adapter whose header adds 2**32 to a dimension: MLX used to load it with its old
    shape, so the adapter loaded as if nothing were wrong."""
    ad = _copy(llama_adapter if fmt == "mlx" else peft_adapter, tmp_path / "ad")
    tensors, _ = mx.load_safetensors(ad / _weights(fmt))
    name = sorted(tensors)[0]
    shape = widen_first_dim(ad / _weights(fmt), name)
    with load(llama_dir) as model:
        with pytest.raises(AdapterError, match=rf"^tensor {re.escape(repr(name))} in {re.escape(str(ad))}/"
                                               rf".* has a dimension over 2147483647.*shape {re.escape(str(shape))}"):
            model.load_adapter(ad)
        assert model.adapter is None and not any("lora" in k for k in model.model.parameters())


_RANK = st.sampled_from([2, 2 + 2**32, 2 - 2**32])  # the config's rank 2, as MLX took all three
# Any shapes, and pairs that MLX's reader made fit the config: (in, rank) and (rank, out).
_LORA_A = st.one_of(st.lists(DIMS, max_size=3), st.tuples(WRAPPING_DIMS, _RANK).map(list))
_LORA_B = st.one_of(st.lists(DIMS, max_size=3), st.tuples(_RANK, WRAPPING_DIMS).map(list))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(a=_LORA_A, b=_LORA_B, spare=st.integers(0, 64))
def test_an_adapter_loads_as_its_header_says_or_is_an_adapter_error(tmp_path_factory: pytest.TempPathFactory,
                                                                   a: list[object], b: list[object],
                                                                   spare: int) -> None:
    """A LoRA pair of any shapes, data_offsets sized as MLX counts bytes (so its reader takes
    them): an AdapterError naming the file, or tensors of exactly the header's shapes."""
    ad = _adapter_dir(tmp_path_factory.mktemp("h") / "ad", "mlx")
    size_a, size_b = bytes_as_mlx_counts(a), bytes_as_mlx_counts(b)
    header = {"m.lora_a": {"dtype": "F32", "shape": a, "data_offsets": [0, size_a]},
              "m.lora_b": {"dtype": "F32", "shape": b, "data_offsets": [size_a, size_a + size_b]}}
    write_safetensors(ad / "adapters.safetensors", header, bytes(64 + spare))
    try:
        adapter = read_adapter(ad)
    except AdapterError as exc:
        assert str(ad / "adapters.safetensors") in str(exc)
        return
    assert adapter.tensors["m.lora_a"].shape == tuple(a) and adapter.tensors["m.lora_b"].shape == tuple(b)


def _checkpoint_copy(checkpoint: tuple[Path, Path], tmp_path: Path) -> tuple[Path, Path, Path]:
    """(data, a copy of the checkpoint, its training_state.safetensors)."""
    data, good = checkpoint
    ad = _copy(good, tmp_path / "ad")
    return data, ad, ad / "training_state.safetensors"


def test_a_hostile_training_state_file_is_a_value_error(checkpoint: tuple[Path, Path], llama_dir: Path,
                                                        tmp_path: Path) -> None:
    """Each hostile file in place of training_state.safetensors: a ValueError (what a damaged
    checkpoint raises) naming the file and the tensor; MLX's own error used to escape raw."""
    with load(llama_dir) as model:
        for case in CASE_IDS:
            data, ad, file = _checkpoint_copy(checkpoint, tmp_path / case)
            expected = write_case(file, case, "training state file")
            with pytest.raises(ValueError) as info:
                pymlxc.train(model, data, ad, iters=4, batch_size=2, resume=True, progress=False)
            assert str(info.value).startswith(expected), (case, str(info.value))
            assert model.adapter is None


def test_a_training_state_dimension_past_int32_is_refused(checkpoint: tuple[Path, Path], llama_dir: Path,
                                                          tmp_path: Path) -> None:
    """A moment whose header adds 2**32 to a dimension used to load with its old shape and resume."""
    data, ad, file = _checkpoint_copy(checkpoint, tmp_path)
    name = next(n for n in sorted(mx.load_safetensors(file)[0]) if n.startswith("opt.") and n.endswith(".m"))
    shape = widen_first_dim(file, name)
    with load(llama_dir) as model:
        with pytest.raises(ValueError, match=rf"^tensor {re.escape(repr(name))} in {re.escape(str(file))} has a "
                                             rf"dimension over 2147483647.*shape {re.escape(str(shape))}"):
            pymlxc.train(model, data, ad, iters=4, batch_size=2, resume=True, progress=False)
        assert model.adapter is None


def test_a_missing_training_state_file_is_a_value_error(checkpoint: tuple[Path, Path], llama_dir: Path,
                                                        tmp_path: Path) -> None:
    data, ad, file = _checkpoint_copy(checkpoint, tmp_path)
    file.unlink()
    missing = f"^training state file not found: {re.escape(str(file))}$"
    with load(llama_dir) as model, pytest.raises(ValueError, match=missing):
        pymlxc.train(model, data, ad, iters=4, batch_size=2, resume=True, progress=False)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs (POSIX)")
def test_special_files_as_adapter_weights_or_training_state_are_refused_unread(
        checkpoint: tuple[Path, Path], llama_dir: Path, tmp_path: Path) -> None:
    """A FIFO (which would block MLX's open forever), a directory or a link to /dev/zero where the
    adapter's weights or the training state should be: in a child, so that a hang fails one test,
    each is refused by its reader's error naming the file."""
    kinds = {"fifo": "FIFO (named pipe)", "dir": "directory", "zero": "character device"}

    def plant(file: Path, kind: str) -> None:
        file.unlink(missing_ok=True)
        if kind == "fifo":
            os.mkfifo(file)
        elif kind == "dir":
            file.mkdir()
        else:
            file.symlink_to("/dev/zero")

    adapters, states = [], []
    for kind in kinds:
        ad = _adapter_dir(tmp_path / f"adapter-{kind}", "mlx")
        plant(ad / "adapters.safetensors", kind)
        adapters.append(str(ad))
        data, state_dir, file = _checkpoint_copy(checkpoint, tmp_path / f"state-{kind}")
        plant(file, kind)
        states.append(str(state_dir))
    got = run_case(f"""
import pymlxc
from pymlxc.training.adapters import read_adapter
def attempt(fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
        return "read"
    except Exception as exc:
        return [type(exc).__name__, str(exc)]
out = [attempt(read_adapter, ad) for ad in {adapters!r}]
with pymlxc.load_model({str(llama_dir)!r}, backend="metal") as model:
    out += [attempt(pymlxc.train, model, {str(data)!r}, ad, iters=4, batch_size=2, resume=True, progress=False)
            for ad in {states!r}]
report(out)
""", timeout=300)
    assert got == [["AdapterError", f"adapter weights file {tmp_path / f'adapter-{k}' / 'adapters.safetensors'} "
                                    f"is a {name}, not a regular file"] for k, name in kinds.items()] + [
        ["ValueError", f"training state file {tmp_path / f'state-{k}' / 'ad' / 'training_state.safetensors'} "
                       f"is a {name}, not a regular file"] for k, name in kinds.items()]

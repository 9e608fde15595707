"""Inputs that trained something other than what was asked without a word: a batch larger than
the data, a LoRA config the model's adapter does not have, token ids the model cannot embed, a
validation limited to the shortest examples."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pymlxc
import pymlxc.core as mx
from pymlxc.training import DatasetError, LoRAConfig, TrainConfig, Trainer
from pymlxc.training.data import Example, load_records, tokenize_all

from .conftest import load


def _texts(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"text": f"the cat sat on mat {i}"}) + "\n" for i in range(n)))
    return path


@pytest.mark.parametrize(("batch_size", "valid_split", "message"), [
    (32, None, r"at least batch_size=32 examples, but .*train\.jsonl has only 10"),
    (9, 0.2, r"at least batch_size=9 examples, but .*train\.jsonl \(after holding out 2 for validation, "
             r"valid_split=0\.2\) has only 8"),
])
def test_a_batch_larger_than_the_training_set_is_refused(llama_dir: Path, tmp_path: Path, batch_size: int,
                                                          valid_split: float | None, message: str) -> None:
    """batch_size=32 on 10 examples trained batches of 10 and reported success."""
    data = tmp_path / "data"
    data.mkdir()
    _texts(data / "train.jsonl", 10)
    with load(llama_dir) as model:
        with pytest.raises(DatasetError, match=message):
            pymlxc.train(model, data, tmp_path / "ad", iters=2, batch_size=batch_size, valid_split=valid_split,
                         progress=False)
        assert model.adapter is None and not (tmp_path / "ad").exists()
        assert pymlxc.train(model, data, tmp_path / "ad", iters=1, batch_size=10, progress=False).steps == 1


def test_a_validation_set_smaller_than_a_batch_is_evaluated_whole(llama_dir: Path, tmp_path: Path) -> None:
    """Unlike mlx-lm (which refuses it), a validation set of fewer examples than batch_size is one
    batch of all of them: its loss is the mean over every token of the set, as a larger set's is."""
    data = tmp_path / "data"
    data.mkdir()
    _texts(data / "train.jsonl", 4)
    _texts(data / "valid.jsonl", 3)
    with load(llama_dir) as model:
        result = pymlxc.train(model, data, tmp_path / "ad", lora=LoRAConfig(rank=2), iters=1, batch_size=4,
                              progress=False)
        one = Trainer(model, TrainConfig(batch_size=1), model.adapter)
        whole = Trainer(model, TrainConfig(batch_size=4), model.adapter)
        valid = tokenize_all(load_records(data)[1], model.training_encoder())
        assert whole.evaluate(valid) == pytest.approx(one.evaluate(valid), rel=1e-5)
        assert result.val_losses[0][1] == pytest.approx(whole.evaluate(valid), rel=1e-5)


class _Recorder:
    """Logits of zeros for any input; remembers the rows it was given (first token = example id)."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def logits(self, inputs: mx.Array) -> mx.Array:
        self.seen.extend(int(row[0]) for row in np.array(inputs))
        return mx.zeros((*inputs.shape, 64))


class _NoAdapter:
    def trainable_parameters(self) -> dict:
        return {}

    def update(self, params: dict) -> None:
        pass


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 1000))
def test_a_limited_validation_is_a_seeded_sample_not_the_shortest_examples(seed: int) -> None:
    """val_batches=N evaluated the N batches of the shortest examples, every time: a validation loss
    of the short records only. Now a sample of batches of every length, the same at each evaluation."""
    examples = [Example((i, *range(1, 2 + i)), 0, f"v.jsonl:{i + 1}") for i in range(40)]  # example i: length 2 + i
    model = _Recorder()
    trainer = Trainer(model, TrainConfig(batch_size=2, seed=seed), _NoAdapter())
    trainer.evaluate(examples, num_batches=5)
    first, model.seen = model.seen, []
    trainer.evaluate(examples, num_batches=5)
    assert model.seen == first and len(first) == 10
    shortest = set(range(10))
    assert set(first) != shortest
    model.seen = []
    trainer.evaluate(examples)
    assert sorted(model.seen) == list(range(40))


def test_a_lora_config_unlike_the_models_adapter_is_refused(llama_dir: Path, repeat_data: Path,
                                                             tmp_path: Path) -> None:
    """The model's adapter (rank 2) trained and the rank 16 asked for was ignored without a word."""
    with load(llama_dir) as model:
        adapter = model.apply_lora(LoRAConfig(rank=2))
        with pytest.raises(ValueError, match=r"already has an adapter, .*differs from it: rank 16 \(adapter: 2\)"):
            pymlxc.train(model, repeat_data, tmp_path / "ad", lora=LoRAConfig(rank=16), iters=1, batch_size=2,
                         progress=False)
        assert model.adapter is adapter
        # the adapter's own config, or none, trains it
        assert pymlxc.train(model, repeat_data, tmp_path / "ad", lora=LoRAConfig(rank=2), iters=1, batch_size=2,
                            progress=False).steps == 1
        assert pymlxc.train(model, repeat_data, tmp_path / "ad", iters=1, batch_size=2, progress=False).steps == 1


def test_an_added_token_past_the_models_vocabulary_is_refused(llama_dir: Path, tmp_path: Path) -> None:
    """A tokenizer's added token with no embedding row reached the model: MLX's gather read another
    row, and the loss of that target came from a logit the model does not have. Training 'worked'."""
    model_dir = Path(shutil.copytree(llama_dir, tmp_path / "m"))
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    tokenizer["added_tokens"].append({"id": vocab, "content": "<extra>", "single_word": False, "lstrip": False,
                                      "rstrip": False, "normalized": False, "special": True})
    (model_dir / "tokenizer.json").write_text(json.dumps(tokenizer))
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in ("the cat", "a <extra> b")))
    with pytest.warns(UserWarning, match="added token"):
        model = load(model_dir)
    with model:
        with pytest.raises(DatasetError, match=rf"train\.jsonl:2: token id {vocab} is outside the model's vocabulary"):
            pymlxc.train(model, data, tmp_path / "ad", iters=1, batch_size=2, progress=False)
        assert model.adapter is None

"""Fusing: the fused model's logits equal base + adapter (dense exactly, requantized closely)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import pymlxc.core as mx
from pymlxc.backends.metal.nn import Linear, QuantizedLinear
from pymlxc.cli import main
from pymlxc.training import LoRAConfig

from .conftest import load
from .test_interop import PROMPT, _ours, _trained_like

LORA = LoRAConfig(rank=4, alpha=8, target_keys=("q_proj", "v_proj", "down_proj"))


def _adapted(path: Path, tmp_path: Path) -> tuple[np.ndarray, list[int], Path]:
    with load(path) as model:
        model.apply_lora(LORA)
        _trained_like(model, seed=2)
        model.adapter.save(tmp_path / "ad")
        ids = model.encode(PROMPT)
        return _ours(model, ids), ids, tmp_path / "ad"


def test_fused_dense_model_equals_base_plus_adapter(llama_dir: Path, tmp_path: Path) -> None:
    import mlx.core as M
    import mlx_lm

    adapted, ids, adapter = _adapted(llama_dir, tmp_path)
    with load(llama_dir) as model:
        model.load_adapter(adapter)
        assert model.fuse_adapter() == 2 * 3
        assert model.adapter is None
        in_memory = _ours(model, ids)
        assert not any("lora" in k for k in model.model.parameters())
        assert model.model.trainable_parameters()  # nothing stays frozen in a dense fused model
    np.testing.assert_allclose(in_memory, adapted, rtol=1e-4, atol=1e-4)
    with load(llama_dir) as model:
        model.load_adapter(adapter)
        out = model.save_fused(tmp_path / "fused", llama_dir)
    with load(out) as fused:
        np.testing.assert_allclose(_ours(fused, ids), adapted, rtol=1e-4, atol=1e-4)
    ref, _ = mlx_lm.load(str(out))  # the fused directory is an ordinary model for mlx-lm too
    np.testing.assert_allclose(np.array(ref(M.array([ids]))), adapted, rtol=1e-4, atol=1e-4)


def test_fused_quantized_model_requantizes_or_saves_dense(qllama_dir: Path, tmp_path: Path) -> None:
    adapted, ids, adapter = _adapted(qllama_dir, tmp_path)
    with load(qllama_dir) as model:
        model.load_adapter(adapter)
        out = model.save_fused(tmp_path / "requantized", qllama_dir)
        layer = model.model.layers[0].self_attn.q_proj
        assert isinstance(layer, QuantizedLinear) and layer.bits == 4 and layer.group_size == 32
    assert "quantization" in json.loads((out / "config.json").read_text())
    with load(out) as fused:
        requantized = _ours(fused, ids)
    with load(qllama_dir) as base:
        base_logits = _ours(base, ids)
    # requantizing rounds the fused weights to 4 bits again: nearer the adapted model than the base
    # is, and what mlx-lm's fuse (dequantize=False) makes of the same adapter
    assert np.abs(requantized - adapted).mean() < 0.5 * np.abs(base_logits - adapted).mean()
    import mlx.core as M
    import mlx_lm
    from mlx.utils import tree_unflatten

    ref, _ = mlx_lm.load(str(qllama_dir), adapter_path=str(adapter))
    ref.update_modules(tree_unflatten([(n, m.fuse(dequantize=False)) for n, m in ref.named_modules()
                                       if hasattr(m, "fuse")]))
    np.testing.assert_allclose(requantized, np.array(ref(M.array([ids]))), rtol=1e-4, atol=1e-4)
    with load(qllama_dir) as model:
        model.load_adapter(adapter)
        out = model.save_fused(tmp_path / "dense", qllama_dir, dequantize=True)
        assert isinstance(model.model.layers[0].self_attn.q_proj, Linear)
    config = json.loads((out / "config.json").read_text())
    assert "quantization" not in config and "quantization_config" not in config
    with load(out) as fused:
        assert not any(isinstance(m, QuantizedLinear) for _, m in fused.model.named_modules())
        np.testing.assert_allclose(_ours(fused, ids), adapted, rtol=1e-4, atol=1e-4)
    dense, _ = mlx_lm.load(str(out))
    np.testing.assert_allclose(np.array(dense(M.array([ids]))), adapted, rtol=1e-4, atol=1e-4)


def _state(model) -> tuple[dict, list, list, dict]:  # noqa: ANN001
    """What a failed save must leave alone: the parameters (the very arrays), the module types,
    the trainable names and each module's frozen names."""
    net = model.model
    return (net.parameters(), [(p, type(m)) for p, m in net.named_modules()], sorted(net.trainable_parameters()),
            {p: set(m._frozen) for p, m in net.named_modules()})


def _failing_write(*args, **kwargs) -> None:  # noqa: ANN002, ANN003
    raise OSError("No space left on device")


@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("dequantize", [False, True])
@pytest.mark.parametrize("failure", ["a file in the way", "a failed write", "no adapter"])
def test_a_failed_save_leaves_the_model_as_it_was(llama_dir: Path, qllama_dir: Path, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch, quantized: bool,
                                                  dequantize: bool, failure: str) -> None:
    """save_fused used to fuse (and dequantize) the model before writing: a save that then failed
    left the user's model fused, its adapter gone."""
    from pymlxc.backends.metal import training

    source = qllama_dir if quantized else llama_dir
    with load(source) as model:
        if failure != "no adapter":
            model.apply_lora(LORA)
            _trained_like(model, seed=3)
        adapter = model.adapter
        ids = model.encode(PROMPT)
        logits, before = _ours(model, ids), _state(model)
        out = tmp_path / "fused"
        if failure == "a file in the way":
            out.write_text("not a directory")
            error, match = NotADirectoryError, "is not a directory"
        else:
            monkeypatch.setattr(training, "write_replacing", _failing_write)
            error, match = OSError, "No space left on device"
        with pytest.raises(error, match=match):
            model.save_fused(out, source, dequantize=dequantize)
        after = _state(model)
        assert after[0].keys() == before[0].keys() and all(after[0][k] is v for k, v in before[0].items())
        assert after[1:] == before[1:]
        assert model.adapter is adapter
        if adapter is not None:
            assert adapter.total_params() > 0  # still attached and usable
        np.testing.assert_array_equal(_ours(model, ids), logits)
        monkeypatch.undo()
        saved = model.save_fused(tmp_path / "fused-ok", source, dequantize=dequantize)  # and it still saves
        assert (saved / "model.safetensors").is_file() and model.adapter is None


def test_cli_lora_then_fuse(
    llama_dir: Path, repeat_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = main(["lora", str(llama_dir), "--data", str(repeat_data), "--adapter-path", str(tmp_path / "ad"),
               "--iters", "4", "--batch-size", "2", "--learning-rate", "1e-3", "--rank", "4", "--steps-per-report", "2",
               "--export-peft", str(tmp_path / "peft")])
    assert rc == 0
    err = capsys.readouterr().err
    # Off a terminal the progress bar is silent; the closing line still reports the run.
    assert "done: 4 steps" in err and "trained tok/s" in err and "\r" not in err
    assert (tmp_path / "ad" / "adapters.safetensors").is_file() and (
        tmp_path / "peft" / "adapter_model.safetensors"
    ).is_file()
    rc = main(["fuse", str(llama_dir), "--adapter-path", str(tmp_path / "ad"), "--save-path", str(tmp_path / "fused"),
               "--quiet"])
    assert rc == 0 and (tmp_path / "fused" / "model.safetensors").is_file()
    assert (tmp_path / "fused" / "tokenizer.json").is_file()
    with load(tmp_path / "fused") as fused, load(llama_dir) as model:
        model.load_adapter(tmp_path / "ad")
        ids = model.encode(PROMPT)
        np.testing.assert_allclose(_ours(fused, ids), _ours(model, ids), rtol=1e-4, atol=1e-4)
    assert mx  # keep the import for type checkers

"""Adapters move between pymlxc, mlx-lm and PEFT with the same logits."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import pymlxc
import pymlxc.core as mx
from pymlxc.training import LoRAConfig

from .conftest import load

PROMPT = "the cat sat on the mat"


def _trained_like(model, seed: int = 0) -> None:  # noqa: ANN001
    """Give the adapter non-zero B (as training would), so that it changes the logits."""
    rng = np.random.default_rng(seed)
    params = model.adapter.trainable_parameters()
    model.adapter.update({k: mx.array(rng.standard_normal(v.shape).astype(np.float32) * 0.2, v.dtype)
                          if k.endswith("lora_b") else v for k, v in params.items()})


def _ours(model, ids: list[int]) -> np.ndarray:  # noqa: ANN001
    return np.array(model.logits(mx.array([ids])).astype(mx.float32))


@pytest.mark.parametrize("quantized", [False, True])
def test_adapter_saved_here_serves_in_mlx_lm(
    llama_dir: Path, qllama_dir: Path, tmp_path: Path, quantized: bool
) -> None:
    import mlx.core as M
    import mlx_lm

    path = qllama_dir if quantized else llama_dir
    with load(path) as model:
        model.apply_lora(LoRAConfig(rank=4, alpha=12, target_keys=("q_proj", "v_proj", "gate_proj"), num_layers=1))
        _trained_like(model)
        model.adapter.save(tmp_path / "ad")
        ids = model.encode(PROMPT)
        ours = _ours(model, ids)
    config = json.loads((tmp_path / "ad" / "adapter_config.json").read_text())
    assert config["fine_tune_type"] == "lora" and config["num_layers"] == 1
    assert config["lora_parameters"]["scale"] == 3.0 and config["lora_parameters"]["rank"] == 4
    names = sorted(mx.load_safetensors(tmp_path / "ad" / "adapters.safetensors")[0])
    assert "model.layers.1.self_attn.q_proj.lora_a" in names and not any(".layers.0." in n for n in names)
    ref_model, _ = mlx_lm.load(str(path), adapter_path=str(tmp_path / "ad"))
    ref = np.array(ref_model(M.array([ids])))
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("keys", [["self_attn.q_proj", "mlp.down_proj"], None])
def test_adapter_written_by_mlx_lm_serves_here(llama_dir: Path, tmp_path: Path, keys: list[str] | None) -> None:
    import mlx.core as M
    import mlx_lm
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.tuner.utils import linear_to_lora_layers

    ref_model, _ = mlx_lm.load(str(llama_dir))
    ref_model.freeze()
    lora_parameters = {"rank": 4, "scale": 5.0, "dropout": 0.0, **({"keys": keys} if keys else {})}
    linear_to_lora_layers(ref_model, 2, lora_parameters)
    M.random.seed(7)
    params = tree_flatten(ref_model.trainable_parameters())
    ref_model.update(tree_unflatten([(k, M.random.normal(v.shape) * 0.2 if k.endswith("lora_b") else v)
                                     for k, v in params]))
    ad = tmp_path / "mlx_adapter"
    ad.mkdir()
    M.save_safetensors(str(ad / "adapters.safetensors"), dict(tree_flatten(ref_model.trainable_parameters())))
    (ad / "adapter_config.json").write_text(json.dumps(
        {"fine_tune_type": "lora", "num_layers": 2, "lora_parameters": lora_parameters}))
    with pymlxc.load_model(str(llama_dir), backend="metal", adapter_path=str(ad)) as model:
        ids = model.encode(PROMPT)
        ref = np.array(ref_model(M.array([ids])))
        np.testing.assert_allclose(_ours(model, ids), ref, rtol=1e-4, atol=1e-4)
        assert model.adapter.config.rank == 4 and model.adapter.config.alpha == pytest.approx(20.0)
        n_layers = len(model.adapter.modules)
    assert n_layers == (4 if keys else 2 * 7)


def _peft_adapter(path: Path, base: dict[str, np.ndarray], modules: list[str], r: int, alpha: float,
                  seed: int = 0, **config: object) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    tensors, factors = {}, {}
    for m in modules:
        out_dims, in_dims = base[f"{m}.weight"].shape
        a = (rng.standard_normal((r, in_dims)) * 0.1).astype(np.float32)
        b = (rng.standard_normal((out_dims, r)) * 0.1).astype(np.float32)
        tensors[f"base_model.model.{m}.lora_A.weight"] = a
        tensors[f"base_model.model.{m}.lora_B.weight"] = b
        factors[m] = (a, b)
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": r, "lora_alpha": alpha, "lora_dropout": 0.0, "bias": "none",
        "target_modules": sorted({m.rsplit(".", 1)[1] for m in modules}), "task_type": "CAUSAL_LM", **config}))
    return factors


@pytest.mark.parametrize("rslora", [False, True])
def test_peft_adapter_gives_the_logits_computed_by_hand(llama_dir: Path, tmp_path: Path, rslora: bool) -> None:
    base = load_file(str(llama_dir / "model.safetensors"))
    modules = [f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ("q_proj", "v_proj")]
    modules.append("model.layers.1.mlp.up_proj")
    r, alpha = 4, 8.0
    factors = _peft_adapter(tmp_path / "peft", base, modules, r, alpha, use_rslora=rslora)
    scale = alpha / (np.sqrt(r) if rslora else r)
    # by hand: one layer, W x + scale * B A x
    x = np.random.default_rng(3).standard_normal((2, base[f"{modules[0]}.weight"].shape[1])).astype(np.float32)
    with pymlxc.load_model(str(llama_dir), backend="metal", adapter_path=str(tmp_path / "peft")) as model:
        from pymlxc.backends.metal.lora import get_module

        layer = get_module(model.model, modules[0])
        a, b = factors[modules[0]]
        expected = x @ base[f"{modules[0]}.weight"].T + scale * (x @ a.T) @ b.T
        np.testing.assert_allclose(np.array(layer(mx.array(x))), expected, rtol=1e-5, atol=1e-5)
        ids = model.encode(PROMPT)
        adapted = _ours(model, ids)
    # by hand for the whole model: W' = W + scale * B A in a copy of the checkpoint
    merged = dict(base)
    for m, (a, b) in factors.items():
        merged[f"{m}.weight"] = (base[f"{m}.weight"] + scale * b @ a).astype(np.float32)
    by_hand = tmp_path / "by_hand"
    shutil.copytree(llama_dir, by_hand)
    save_file(merged, str(by_hand / "model.safetensors"), metadata={"format": "pt"})
    with load(by_hand) as model:
        np.testing.assert_allclose(adapted, _ours(model, ids), rtol=1e-4, atol=1e-4)


def test_peft_round_trip_and_quantized_base(qllama_dir: Path, tmp_path: Path) -> None:
    with load(qllama_dir) as model:
        model.apply_lora(LoRAConfig(rank=2, alpha=6, target_keys=("k_proj", "o_proj")))
        _trained_like(model, seed=5)
        ids = model.encode(PROMPT)
        ours = _ours(model, ids)
        model.adapter.save(tmp_path / "peft", format="peft")
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["r"] == 2 and config["lora_alpha"] == 6 and config["target_modules"] == ["k_proj", "o_proj"]
    tensors = load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
    a = tensors["base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight"]
    b = tensors["base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight"]
    assert a.shape == (2, 64) and b.shape[1] == 2  # (r, in) and (out, r)
    with pymlxc.load_model(str(qllama_dir), backend="metal", adapter_path=str(tmp_path / "peft")) as model:
        np.testing.assert_allclose(_ours(model, ids), ours, rtol=1e-5, atol=1e-5)


def test_peft_rank_and_alpha_patterns(llama_dir: Path, tmp_path: Path) -> None:
    base = load_file(str(llama_dir / "model.safetensors"))
    path = tmp_path / "peft"
    rng = np.random.default_rng(0)
    tensors = {}
    for m, r in [("model.layers.0.self_attn.q_proj", 2), ("model.layers.1.self_attn.q_proj", 6)]:
        out_dims, in_dims = base[f"{m}.weight"].shape
        tensors[f"base_model.model.{m}.lora_A.weight"] = rng.standard_normal((r, in_dims)).astype(np.float32)
        tensors[f"base_model.model.{m}.lora_B.weight"] = rng.standard_normal((out_dims, r)).astype(np.float32)
    path.mkdir()
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"],
        "rank_pattern": {"layers.1.self_attn.q_proj": 6}, "alpha_pattern": {"layers.1.self_attn.q_proj": 3}}))
    with load(llama_dir) as model:
        adapter = model.load_adapter(path)
        assert adapter.scales() == {"model.layers.0.self_attn.q_proj": 2.0, "model.layers.1.self_attn.q_proj": 0.5}
        with pytest.raises(Exception, match="one rank and one scale"):
            adapter.save(tmp_path / "as_mlx")
        adapter.save(tmp_path / "again", format="peft")
    again = json.loads((tmp_path / "again" / "adapter_config.json").read_text())
    assert again["rank_pattern"] == {"model.layers.1.self_attn.q_proj": 6}
    assert again["alpha_pattern"] == {"model.layers.1.self_attn.q_proj": 3.0}

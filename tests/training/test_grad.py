"""Gradients of the LoRA loss: central finite differences in float64, value_and_grad against vjp
and jvp, gradient checkpointing, and a frozen quantized base (QLoRA)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import pymlxc.core as mx
from pymlxc.training import LoRAConfig, masked_cross_entropy
from pymlxc.training.data import Example, make_batch

from .conftest import load


def f64(x: np.ndarray) -> mx.Array:
    return mx.array(x, mx.float64)


BATCH = make_batch([Example(tuple(range(3, 15)), 4, "a"), Example(tuple(range(40, 49)), 0, "b")], 64)


def _float64_model(path: Path, seed: int = 0):  # noqa: ANN202
    model = load(path)
    net = model.model
    net.update({k: v.astype(mx.float64) for k, v in net.parameters().items()})
    adapter = model.apply_lora(LoRAConfig(rank=4, alpha=8, target_keys=("q_proj", "v_proj", "down_proj")), seed=seed)
    # B starts at zero (so dL/dA = 0); give it values so that both factors have gradients
    params = adapter.trainable_parameters()
    rng = np.random.default_rng(seed)
    adapter.update({k: mx.array(rng.standard_normal(v.shape) * 0.1 if k.endswith("lora_b") else np.array(v), mx.float64)
                    for k, v in params.items()})
    return model, adapter


def _loss_fn(model, adapter):  # noqa: ANN001, ANN202
    def loss(params: dict) -> mx.Array:
        adapter.update(params)
        value, _ = masked_cross_entropy(model.logits(BATCH.inputs), BATCH.targets, BATCH.mask)
        return value

    return loss


def test_lora_layer_gradients_match_central_differences_exactly() -> None:
    # One LoRA layer over a dense and a quantized base, all float64 ops: tight agreement.
    from pymlxc.backends.metal import nn
    from pymlxc.backends.metal.lora import LoRALinear

    rng = np.random.default_rng(0)
    dense = nn.Linear(64, 32)
    dense.weight = f64(rng.standard_normal((32, 64)) * 0.1)
    x = f64(rng.standard_normal((3, 64)))
    target = f64(rng.standard_normal((3, 32)))
    layer = LoRALinear(dense, rank=4, scale=2.0)
    params = {"lora_a": f64(rng.standard_normal((64, 4)) * 0.1), "lora_b": f64(rng.standard_normal((4, 32)) * 0.1)}

    def loss(p: dict) -> mx.Array:
        layer.update(p)
        return mx.sum(mx.square(layer(x) - target))

    _, grads = mx.value_and_grad(loss)(params)
    eps = 1e-6
    for name in params:
        base = np.array(params[name])
        numeric = np.zeros_like(base)
        for idx in np.ndindex(base.shape):
            plus, minus = base.copy(), base.copy()
            plus[idx] += eps
            minus[idx] -= eps
            numeric[idx] = (loss({**params, name: f64(plus)}).item()
                            - loss({**params, name: f64(minus)}).item()) / (2 * eps)
        np.testing.assert_allclose(np.array(grads[name]), numeric, rtol=1e-6, atol=1e-7)


def _five_point(loss, params: dict, name: str, idx: tuple, h: float) -> float:  # noqa: ANN001
    """(-L(+2h) + 8 L(+h) - 8 L(-h) + L(-2h)) / 12h: truncation error O(h^4)."""
    base = np.array(params[name])
    values = []
    for k in (2, 1, -1, -2):
        moved = base.copy()
        moved[idx] += k * h
        values.append(loss({**params, name: f64(moved)}).item())
    return (-values[0] + 8 * values[1] - 8 * values[2] + values[3]) / (12 * h)


NAMES = ["model.layers.0.self_attn.q_proj.lora_a", "model.layers.1.mlp.down_proj.lora_b",
         "model.layers.1.self_attn.v_proj.lora_a", "model.layers.0.self_attn.v_proj.lora_b"]


def test_lora_gradients_of_the_model_match_central_differences(llama_dir: Path) -> None:
    # float64 weights, but MLX's CPU exp/sigmoid/cos (and the rms_norm/rope kernels) round like
    # float32, so the loss carries ~1e-7 of noise: a wide five-point stencil (h = 0.03) keeps both
    # that noise and the truncation error near 1e-5 of the gradient.
    model, adapter = _float64_model(llama_dir)
    params = adapter.trainable_parameters()
    loss = _loss_fn(model, adapter)
    value, grads = mx.value_and_grad(loss)(params)
    assert value.dtype == mx.float64
    rng = np.random.default_rng(1)
    for name in NAMES:
        g = np.array(grads[name])
        largest = np.unravel_index(np.argmax(np.abs(g)), g.shape)
        assert abs(g[largest]) > 1e-2
        for idx in [largest] + [tuple(int(rng.integers(0, s)) for s in g.shape) for _ in range(2)]:
            numeric = _five_point(loss, params, name, idx, 3e-2)
            assert g[idx] == pytest.approx(numeric, rel=2e-4, abs=2e-6), (name, idx)


def test_value_and_grad_agrees_with_vjp_and_jvp(llama_dir: Path) -> None:
    model, adapter = _float64_model(llama_dir, seed=2)
    params = adapter.trainable_parameters()
    names = list(params)
    loss = _loss_fn(model, adapter)
    value, grads = mx.value_and_grad(loss)(params)

    def flat(*arrays: mx.Array) -> mx.Array:
        return loss(dict(zip(names, arrays, strict=True)))

    outs, vjps = mx.vjp(flat, [params[n] for n in names], [mx.array(1.0, mx.float64)])
    assert outs[0].item() == pytest.approx(value.item(), rel=1e-12)
    for n, v in zip(names, vjps, strict=True):
        np.testing.assert_allclose(np.array(v), np.array(grads[n]), rtol=1e-10, atol=1e-14)
    rng = np.random.default_rng(3)
    tangents = [f64(rng.standard_normal(params[n].shape)) for n in names]
    _, jvps = mx.jvp(flat, [params[n] for n in names], tangents)
    directional = sum(float((np.array(grads[n]) * np.array(t)).sum()) for n, t in zip(names, tangents, strict=True))
    assert jvps[0].item() == pytest.approx(directional, rel=1e-6)


def test_gradient_checkpointing_gives_the_same_gradients(llama_dir: Path) -> None:
    model, adapter = _float64_model(llama_dir, seed=4)
    params = adapter.trainable_parameters()
    loss = _loss_fn(model, adapter)
    v1, g1 = mx.value_and_grad(loss)(params)
    model.set_grad_checkpoint(True)
    try:
        v2, g2 = mx.value_and_grad(loss)(params)
    finally:
        model.set_grad_checkpoint(False)
    assert v2.item() == pytest.approx(v1.item(), rel=1e-12)
    for k in g1:
        np.testing.assert_allclose(np.array(g2[k]), np.array(g1[k]), rtol=1e-9, atol=1e-14)
    assert type(model.model.layers[0]).__call__ is not None and not hasattr(
        type(model.model.layers[0]), "_checkpoint_base"
    )


def test_qlora_trains_only_the_adapter(qllama_dir: Path) -> None:
    model = load(qllama_dir)
    before = model.logits(BATCH.inputs)
    adapter = model.apply_lora(LoRAConfig(target_keys=("q_proj", "v_proj", "gate_proj")))
    np.testing.assert_array_equal(np.array(model.logits(BATCH.inputs)), np.array(before))  # B = 0
    params = adapter.trainable_parameters()
    assert params and all(k.endswith(("lora_a", "lora_b")) for k in params)
    assert "model.layers.0.self_attn.q_proj.linear.scales" in model.model.parameters()
    _, grads = mx.value_and_grad(_loss_fn(model, adapter))(params)
    assert any(np.abs(np.array(g)).max() > 0 for k, g in grads.items() if k.endswith("lora_b"))

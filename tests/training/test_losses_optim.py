"""Losses and AdamW against numpy and mlx (the reference implementation)."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pymlxc.core as mx
from pymlxc.training import AdamW, clip_grad_norm, cross_entropy, global_norm, masked_cross_entropy, mse
from pymlxc.training.optim import cosine_schedule


def _np_ce(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    logits = logits.astype(np.float64)
    m = logits.max(-1, keepdims=True)
    lse = (m + np.log(np.exp(logits - m).sum(-1, keepdims=True)))[..., 0]
    return lse - np.take_along_axis(logits, targets[..., None], -1)[..., 0]


def test_cross_entropy_matches_numpy_and_is_stable_for_huge_logits() -> None:
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((2, 5, 11)).astype(np.float32) * 1e4  # exp would overflow
    targets = rng.integers(0, 11, (2, 5))
    got = np.array(cross_entropy(mx.array(logits), mx.array(targets)))
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, _np_ce(logits, targets), rtol=1e-5, atol=1e-2)


def test_cross_entropy_bfloat16_logits_computed_in_float32() -> None:
    logits = mx.array(np.random.default_rng(1).standard_normal((3, 7)).astype(np.float32)).astype(mx.bfloat16)
    out = cross_entropy(logits, mx.array([0, 3, 6]), reduction="mean")
    assert out.dtype == mx.float32


def test_masked_cross_entropy_ignores_masked_positions() -> None:
    rng = np.random.default_rng(2)
    logits = rng.standard_normal((2, 4, 9)).astype(np.float32)
    targets = rng.integers(0, 9, (2, 4))
    mask = np.array([[0, 1, 1, 0], [1, 1, 0, 0]], dtype=bool)
    loss, n = masked_cross_entropy(mx.array(logits), mx.array(targets), mx.array(mask))
    assert int(n.item()) == 4
    np.testing.assert_allclose(loss.item(), _np_ce(logits, targets)[mask].mean(), rtol=1e-5)
    # changing a masked-out logit changes nothing
    logits2 = logits.copy()
    logits2[0, 0] += 100.0
    loss2, _ = masked_cross_entropy(mx.array(logits2), mx.array(targets), mx.array(mask))
    assert loss2.item() == pytest.approx(loss.item())


def test_masked_cross_entropy_all_masked_is_zero_not_nan() -> None:
    loss, n = masked_cross_entropy(mx.zeros((1, 3, 4)), mx.zeros((1, 3), mx.int32), mx.zeros((1, 3), mx.bool_))
    assert loss.item() == 0.0 and n.item() == 0


def test_cross_entropy_shape_mismatch_raises() -> None:
    with pytest.raises(ValueError, match="targets shape"):
        cross_entropy(mx.zeros((2, 3, 4)), mx.zeros((2, 4), mx.int32))


def test_mse() -> None:
    a, b = np.arange(6.0).reshape(2, 3), np.ones((2, 3))
    assert mse(mx.array(a), mx.array(b)).item() == pytest.approx(((a - b) ** 2).mean())
    assert mse(mx.array(a), mx.array(b), reduction="sum").item() == pytest.approx(((a - b) ** 2).sum())
    with pytest.raises(ValueError, match="reduction"):
        mse(mx.array(a), mx.array(b), reduction="max")  # type: ignore[arg-type]


def _tree(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {"a": rng.standard_normal((3, 4)).astype(np.float32), "b": rng.standard_normal(5).astype(np.float32)}


def test_adamw_matches_mlx_reference() -> None:
    import mlx.core as M
    import mlx.optimizers as O

    rng = np.random.default_rng(3)
    p0 = _tree(rng)
    grads = [_tree(rng) for _ in range(4)]
    ours = AdamW(learning_rate=0.05, weight_decay=0.1)
    params = {k: mx.array(v) for k, v in p0.items()}
    ref = O.AdamW(learning_rate=0.05, weight_decay=0.1, bias_correction=True)
    ref_params = {k: M.array(v) for k, v in p0.items()}
    for g in grads:
        params = ours.update(params, {k: mx.array(v) for k, v in g.items()})
        ref_params = ref.apply_gradients({k: M.array(v) for k, v in g.items()}, ref_params)
    for k in p0:
        np.testing.assert_allclose(np.array(params[k]), np.array(ref_params[k]), rtol=1e-5, atol=1e-6)
    assert ours.step == 4


def test_adamw_defaults() -> None:
    opt = AdamW()
    assert (opt.learning_rate, opt.betas, opt.eps, opt.weight_decay) == (1e-5, (0.9, 0.999), 1e-8, 0.01)
    with pytest.raises(ValueError):
        AdamW(betas=(1.0, 0.9))


def test_adamw_weight_decay_is_decoupled() -> None:
    # zero gradient: Adam's step is 0, only the decay moves the weight: p * (1 - lr * wd)
    opt = AdamW(learning_rate=0.1, weight_decay=0.5)
    p = opt.update({"w": mx.array([2.0])}, {"w": mx.array([0.0])})
    assert p["w"].item() == pytest.approx(2.0 * (1 - 0.05))


def test_bfloat16_parameters_keep_a_float32_master_copy() -> None:
    opt = AdamW(learning_rate=1e-5, weight_decay=0.0)
    p = {"w": mx.ones((4,), mx.bfloat16)}
    for _ in range(50):
        p = opt.update(p, {"w": mx.ones((4,), mx.bfloat16)})
    assert p["w"].dtype == mx.bfloat16
    master = opt.state["w"]["master"]
    assert master.dtype == mx.float32
    assert master[0].item() == pytest.approx(1.0 - 50 * 1e-5, rel=1e-4)  # each step moved it by ~lr


def test_clip_grad_norm() -> None:
    g = {"a": mx.array([3.0, 0.0]), "b": [mx.array([4.0])]}
    assert global_norm(g).item() == pytest.approx(5.0)
    clipped, norm = clip_grad_norm(g, 1.0)
    assert norm.item() == pytest.approx(5.0)
    assert global_norm(clipped).item() == pytest.approx(1.0, rel=1e-5)
    same, _ = clip_grad_norm(g, 10.0)
    assert same["a"][0].item() == pytest.approx(3.0)


def test_optimizer_state_round_trip() -> None:
    opt = AdamW(learning_rate=0.1)
    p = opt.update({"x.y": mx.ones((2,))}, {"x.y": mx.ones((2,))})
    state = opt.state_dict()
    other = AdamW(learning_rate=0.1)
    other.load_state_dict(state, opt.step)
    a = opt.update(p, {"x.y": mx.ones((2,))})
    b = other.update(p, {"x.y": mx.ones((2,))})
    np.testing.assert_array_equal(np.array(a["x.y"]), np.array(b["x.y"]))


@settings(max_examples=100, deadline=None)
@given(total=st.integers(1, 50), warmup=st.integers(0, 60), end=st.sampled_from([0.0, 0.1]))
def test_cosine_schedule_gives_every_step_a_rate(total: int, warmup: int, end: float) -> None:
    """The decay reached `end` at the last step: with end 0 that step learned nothing, and a run of
    one step (iters=1) trained nothing at all. Now the first step after warmup takes the peak and
    every step of the run a rate above `end`, falling."""
    lr = cosine_schedule(1.0, total, warmup, end)
    rates = [lr(step) for step in range(1, total + 1)]
    warming, decay = rates[:warmup], rates[warmup:]
    assert all(r > 0 for r in warming) and all(r > end for r in decay)
    if decay:
        assert decay[0] == 1.0 and all(a >= b for a, b in itertools.pairwise(decay))

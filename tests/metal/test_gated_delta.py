"""Gated DeltaNet's pieces: the one-token step, gates and q/k normalisation bit for bit against
mlx-lm's on the CPU; the chunked (parallel) prefill against the token-by-token recurrence for
varied shapes, padding, splits and keys that are nearly alike; the RecurrentCache (kept states,
prefixes, padding, files); the prompt cache's choice of a kept state; and the fused kernels: the
CUDA source compiled by nvcc for the shapes and types models use, the check-once comparison with
its fallback and warning. (The kernels themselves run only on a GPU: not here.)"""
from __future__ import annotations

import importlib
import shutil
import subprocess
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pymlxc.core as mx
from pymlxc.backends.metal.cache import KVCache
from pymlxc.backends.metal.kernels import gated_delta as kernels
from pymlxc.backends.metal.models import gated_delta as gd
from pymlxc.backends.metal.prompt_cache import PromptCache, restorable
from pymlxc.backends.metal.recurrent_cache import MAX_SNAPSHOTS, RecurrentCache, RecurrentCacheError

mlx = importlib.import_module("mlx.core")
ref_gd = importlib.import_module("mlx_lm.models.gated_delta")

FAST = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def inputs(rng: np.random.Generator, b: int, t: int, hk: int, hv: int, dk: int, dv: int) -> dict[str, np.ndarray]:
    return {
        "q": rng.normal(size=(b, t, hk, dk)).astype(np.float32),
        "k": rng.normal(size=(b, t, hk, dk)).astype(np.float32),
        "v": rng.normal(size=(b, t, hv, dv)).astype(np.float32),
        "a": rng.normal(size=(b, t, hv)).astype(np.float32),
        "b": rng.normal(size=(b, t, hv)).astype(np.float32),
        "A_log": np.log(rng.uniform(1, 16, hv)).astype(np.float32),
        "dt_bias": rng.normal(size=hv).astype(np.float32),
        "state": rng.normal(size=(b, hv, dv, dk)).astype(np.float32),
    }


def ours(x: dict[str, np.ndarray], dk: int) -> dict[str, Any]:
    q, k = gd.normalize_qk(mx.array(x["q"]), mx.array(x["k"]), dk)
    a, A_log, dt = mx.array(x["a"]), mx.array(x["A_log"]), mx.array(x["dt_bias"])
    return {"q": q, "k": k, "v": mx.array(x["v"]), "g": gd.decay(A_log, a, dt), "log_g": gd.log_decay(A_log, a, dt),
            "beta": mx.sigmoid(mx.array(x["b"])), "state": mx.array(x["state"])}


shapes = st.tuples(st.integers(1, 2), st.integers(1, 2), st.sampled_from([1, 2]), st.sampled_from([8, 32]),
                   st.sampled_from([4, 16]), st.integers(0, 2**31 - 1))


# ---------------------------------------------------------------------- against mlx-lm, bit for bit

@FAST
@given(shapes)
def test_gates_norms_and_step_equal_mlx_lm(shape: tuple[int, ...]) -> None:
    b, hk, ratio, dk, dv, seed = shape
    hv = hk * ratio
    x = inputs(np.random.default_rng(seed), b, 1, hk, hv, dk, dv)
    mine = ours(x, dk)
    rq, rk = ref_gd.normalize_qk(mlx.array(x["q"]), mlx.array(x["k"]), inv_scale=dk**-0.5, eps=1e-6)
    np.testing.assert_array_equal(np.asarray(mine["q"]), np.array(rq))
    np.testing.assert_array_equal(np.asarray(mine["k"]), np.array(rk))
    rg = ref_gd.compute_g(mlx.array(x["A_log"]), mlx.array(x["a"]), mlx.array(x["dt_bias"]))
    np.testing.assert_array_equal(np.asarray(mine["g"]), np.array(rg))
    # The one-token step of decoding: mlx-lm's ops path (what it runs on the CPU).
    y, s = gd.recurrent(mine["q"], mine["k"], mine["v"], mine["g"], mine["beta"], mine["state"])
    ry, rs = ref_gd.gated_delta_ops(rq, rk, mlx.array(x["v"]), rg, mlx.sigmoid(mlx.array(x["b"])),
                                    mlx.array(x["state"]))
    np.testing.assert_array_equal(np.asarray(y), np.array(ry))
    np.testing.assert_array_equal(np.asarray(s), np.array(rs))


# ---------------------------------------------------------------------- chunked against the recurrence

def both(mine: dict[str, Any], mask: Any = None) -> tuple[np.ndarray, ...]:
    y1, s1 = gd.recurrent(mine["q"], mine["k"], mine["v"], mine["g"], mine["beta"], mine["state"], mask)
    y2, s2 = gd.chunked(mine["q"], mine["k"], mine["v"], mine["log_g"], mine["beta"], mine["state"], mask)
    return np.asarray(y1), np.asarray(y2), np.asarray(s1), np.asarray(s2)


@FAST
@given(shapes, st.integers(1, 150))
def test_chunked_equals_the_recurrence(shape: tuple[int, ...], t: int) -> None:
    b, hk, ratio, dk, dv, seed = shape
    mine = ours(inputs(np.random.default_rng(seed), b, t, hk, hk * ratio, dk, dv), dk)
    y1, y2, s1, s2 = both(mine)
    np.testing.assert_allclose(y2, y1, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(s2, s1, atol=2e-5, rtol=1e-4)


@FAST
@given(shapes, st.integers(2, 90), st.data())
def test_chunked_in_two_calls_equals_one(shape: tuple[int, ...], t: int, data: st.DataObject) -> None:
    b, hk, ratio, dk, dv, seed = shape
    mine = ours(inputs(np.random.default_rng(seed), b, t, hk, hk * ratio, dk, dv), dk)
    cut = data.draw(st.integers(1, t - 1))
    y, s = gd.chunked(mine["q"], mine["k"], mine["v"], mine["log_g"], mine["beta"], mine["state"])
    part = {k: v[:, :cut] if k != "state" else v for k, v in mine.items()}
    rest = {k: v[:, cut:] if k != "state" else v for k, v in mine.items()}
    ya, sa = gd.chunked(part["q"], part["k"], part["v"], part["log_g"], part["beta"], part["state"])
    yb, sb = gd.chunked(rest["q"], rest["k"], rest["v"], rest["log_g"], rest["beta"], sa)
    np.testing.assert_allclose(np.concatenate([np.asarray(ya), np.asarray(yb)], axis=1), np.asarray(y), atol=2e-5,
                               rtol=1e-4)
    np.testing.assert_allclose(np.asarray(sb), np.asarray(s), atol=2e-5, rtol=1e-4)


@FAST
@given(shapes, st.integers(1, 100), st.data())
def test_padding_leaves_the_state_alone(shape: tuple[int, ...], t: int, data: st.DataObject) -> None:
    """Left padding: row i's first pads[i] tokens do nothing; its state and real outputs are those
    of its real tokens alone, from a zero state."""
    b, hk, ratio, dk, dv, seed = shape
    mine = ours(inputs(np.random.default_rng(seed), b, t, hk, hk * ratio, dk, dv), dk)
    mine["state"] = mx.zeros(mine["state"].shape)
    pads = data.draw(st.lists(st.integers(0, t - 1), min_size=b, max_size=b))
    mask = mx.array(np.arange(t)[None, :] >= np.array(pads)[:, None])
    _y1, y2, s1, s2 = both(mine, mask)
    np.testing.assert_allclose(s2, s1, atol=2e-5, rtol=1e-4)
    for row, pad in enumerate(pads):
        alone = {k: (v[row:row + 1, pad:] if k != "state" else v[row:row + 1]) for k, v in mine.items()}
        ya, sa = gd.chunked(alone["q"], alone["k"], alone["v"], alone["log_g"], alone["beta"], alone["state"])
        np.testing.assert_allclose(y2[row, pad:], np.asarray(ya)[0], atol=2e-5, rtol=1e-4)
        np.testing.assert_allclose(s2[row], np.asarray(sa)[0], atol=2e-5, rtol=1e-4)


def test_chunked_is_stable_for_alike_keys() -> None:
    """64 nearly equal keys, writes near 1 and almost no decay: the triangular system's Neumann
    terms grow binomially there; the block inverse does not."""
    rng = np.random.default_rng(4)
    x = inputs(rng, 1, 256, 1, 2, 32, 8)
    x["k"] = (np.repeat(x["k"][:, :1], 256, axis=1) + 1e-3 * x["k"]).astype(np.float32)
    mine = ours(x, 32)
    mine["beta"] = mx.full(mine["beta"].shape, 0.99)
    weak = mx.full(mine["g"].shape, -1e-4)
    mine["g"], mine["log_g"] = mx.exp(weak), weak
    y1, y2, s1, s2 = both(mine)
    assert np.isfinite(y2).all()
    np.testing.assert_allclose(y2, y1, atol=1e-4, rtol=1e-3)
    np.testing.assert_allclose(s2, s1, atol=1e-4, rtol=1e-3)


# ---------------------------------------------------------------------- the cache

def _arrays(n: int) -> tuple[Any, Any]:
    return mx.full((1, 3, 8), float(n)), mx.full((1, 2, 4, 8), float(n))


def test_cache_keeps_states_at_multi_token_updates() -> None:
    c = RecurrentCache()
    assert c.prefix(1) is None and c.restorable(5) == 0 and c.empty()
    for n in (4, 1, 1, 3, 5, 2, 6):
        c.update(*_arrays(c.offset + n), n)
    assert c.offset == 22 and c.size() == 22
    kept = [4, 9, 14, 16, 22][-MAX_SNAPSHOTS:]  # ends of the multi-token updates, the latest ones
    assert [m for m in range(23) if c.prefix(m) is not None] == kept
    assert c.restorable(21) == 16 and c.restorable(100) == 22 and c.restorable(5) == 0
    p = c.prefix(14)
    assert p is not None and p.offset == 14 and float(p.recurrent[0, 0, 0, 0].item()) == 14.0
    assert p.restorable(100) == 14 and p.prefix(9) is not None
    p.update(*_arrays(99), 1)
    assert c.prefix(14) is not None and float(c.recurrent[0, 0, 0, 0].item()) == 22.0  # the original is untouched
    assert not c.is_trimmable() and c.trim(3) == 0 and c.offset == 22
    assert c.nbytes == MAX_SNAPSHOTS * (96 + 256)  # the current state is the last kept one: counted once
    with pytest.raises(TypeError, match="linear-attention"):
        c.update_and_fetch(mx.zeros((1,)), mx.zeros((1,)))
    c.free()
    assert c.offset == 0 and c.state == ()


def test_cache_padding_mask_and_no_prefix() -> None:
    c = RecurrentCache()
    assert c.token_mask(3) is None
    c.left_padding = mx.array([0, 2], dtype=mx.int32)
    np.testing.assert_array_equal(np.asarray(c.token_mask(3)), [[True, True, True], [False, False, True]])
    c.update(*_arrays(3), 3)
    np.testing.assert_array_equal(np.asarray(c.token_mask(1)), [[True], [True]])
    assert c.prefix(3) is None  # a padded batch's state is no prompt's


def test_cache_file_state_round_trip_and_checks() -> None:
    c = RecurrentCache()
    for n in (5, 4, 1):
        c.update(*_arrays(c.offset + n), n)
    meta, convs, states = c.file_state()
    assert meta == (10, 5, 9) and convs.shape == (3, 1, 3, 8) and states.shape == (3, 1, 2, 4, 8)
    like = RecurrentCache()
    like.update(*_arrays(0), 1)
    back = RecurrentCache.from_file(convs, states, meta, 10, like)
    assert back.offset == 10 and back.restorable(9) == 9 and float(back.prefix(5).conv[0, 0, 0].item()) == 5.0
    with pytest.raises(RecurrentCacheError, match="for 11 tokens"):
        RecurrentCache.from_file(convs, states, meta, 11, like)
    with pytest.raises(RecurrentCacheError, match="do not precede"):
        RecurrentCache.from_file(convs, states, (10, 9, 5), 10, like)
    with pytest.raises(RecurrentCacheError, match="the state has shape"):
        RecurrentCache.from_file(convs, states[..., :4], meta, 10, like)
    with pytest.raises(RecurrentCacheError, match="nothing to save"):
        RecurrentCache().file_state()


def test_prompt_cache_restores_at_the_longest_kept_state() -> None:
    pc = PromptCache()
    rec, kv = RecurrentCache(), KVCache()
    for n in (8, 8, 1, 1):
        rec.update(*_arrays(rec.offset + n), n)
        kv.update_and_fetch(mx.zeros((1, 1, n, 4)), mx.zeros((1, 1, n, 4)))
    tokens = list(range(18))
    assert restorable([rec, kv], 17) == 16 and restorable([kv], 17) == 17
    assert pc.store(tokens, [rec, kv])
    found = pc.lookup([*tokens[:12], 99, 98], limit=13)
    assert found is not None and found[1] == 8
    assert [c.offset for c in found[0]] == [8, 8]
    assert pc.lookup([99, *tokens], limit=10) is None


# ---------------------------------------------------------------------- kernels

def test_kernels_are_off_on_the_cpu() -> None:
    assert kernels.device_kind() is None
    assert kernels.ready((32, 16, 2, 4, 1), mx.float32, gd.recurrent) is None
    assert kernels.applies(128, 128, 16, 32) and not kernels.applies(16, 8, 1, 2) and not kernels.applies(64, 8, 3, 4)


def _ops(q: Any, k: Any, v: Any, g: Any, beta: Any, state: Any) -> tuple[Any, Any]:
    return gd.recurrent(q, k, v, g, beta, state)


def test_compare_accepts_an_agreeing_kernel() -> None:
    assert kernels.compare("cuda", (32, 8, 1, 2, 3), mx.float32, _ops, runner=lambda kind, *a: _ops(*a)) is None
    assert kernels.compare("metal", (64, 8, 2, 4, 1), mx.bfloat16, _ops,
                           runner=lambda kind, *a: _ops(*a)) is None


def test_compare_names_a_disagreement() -> None:
    def wrong(kind: str, q: Any, k: Any, v: Any, g: Any, beta: Any, s: Any) -> tuple[Any, Any]:
        return _ops(q, k, v * 1.01, g, beta, s)

    why = kernels.compare("metal", (32, 8, 1, 2, 1), mx.float32, _ops, runner=wrong)
    assert why is not None and why.startswith("it differs from MLX operations (y: largest difference")


def test_a_failing_kernel_falls_back_to_the_ops(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where MLX's device claims CUDA but the kernel cannot run (here: the CPU), the check at
    prefill warns once, keeps its verdict, and decoding gives the operations' logits."""
    from pymlxc.backends.metal.loader import load_weights_and_config
    from pymlxc.testing import write_tiny_model

    model = load_weights_and_config(write_tiny_model(tmp_path / "m", "qwen3_5")).model
    ids = mx.array([[20, 30, 40, 50]], dtype=mx.int32)

    def decode() -> np.ndarray:
        cache = model.make_cache()
        model(ids, cache)
        return np.asarray(model(mx.array([[60]], dtype=mx.int32), cache))

    expected = decode()
    kernels._checks.forget()  # noqa: SLF001 - a fresh process's verdicts
    monkeypatch.setattr(kernels, "device_kind", lambda: "cuda")
    try:
        with pytest.warns(RuntimeWarning, match="the gated delta kernel is not used: it cannot run here"):
            got = decode()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once: the verdict is kept
            again = decode()
        assert list(kernels._checks.known().values()) == [False]  # noqa: SLF001
    finally:
        kernels._checks.forget()  # noqa: SLF001
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(again, expected)


CUDA_PRELUDE = """#include <cuda_fp16.h>
#include <cuda_bf16.h>
"""


def _cuda_unit(name: str, dtype: str, dk: int, dv: int, hk: int, hv: int, t: int) -> str:
    """The kernel as MLX's cuda_kernel writes it: template arguments as constexprs and type aliases,
    one const pointer per input and one pointer per output."""
    return (f"namespace {name} {{\nusing InT = {dtype};\nconstexpr int Dk = {dk};\nconstexpr int Dv = {dv};\n"
            f"constexpr int Hk = {hk};\nconstexpr int Hv = {hv};\nconstexpr int T = {t};\n"
            "__global__ void pymlxc_gated_delta(const InT* q, const InT* k, const InT* v, const float* g,\n"
            "    const float* beta, const float* state_in, InT* y, float* state_out) {\n"
            f"{kernels.CUDA_SOURCE}\n}}\n}}\n")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (the CUDA toolkit) to compile the source")
def test_cuda_source_compiles(tmp_path: Path) -> None:
    units = [("f32", "float", 128, 128, 16, 32, 1), ("bf16", "__nv_bfloat16", 128, 128, 16, 64, 1),
             ("f16", "__half", 64, 32, 2, 4, 7), ("next", "__nv_bfloat16", 128, 128, 16, 32, 1)]
    source = CUDA_PRELUDE + "".join(_cuda_unit(*u) for u in units)
    (tmp_path / "gated_delta.cu").write_text(source)
    done = subprocess.run(["nvcc", "-arch=sm_90", "--ptx", "-o", str(tmp_path / "out.ptx"),
                           str(tmp_path / "gated_delta.cu")], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    ptx = (tmp_path / "out.ptx").read_text()
    assert ptx.count(".entry") == len(units) and "shfl.sync.bfly" in ptx

"""pymlxc's prefill attention kernel (backends/metal/kernels/prefill_attention.py) and its choice.

Everywhere: the launch covers every query position of every head; the kernel takes causal chunks of
2-byte floats, head sizes 64-128 in steps of 16, GQA groups of 1-64 heads, up to MAX_PAIRS pairs; a
marked attention module sends exactly those chunks to it (here a stand-in on MLX's attention
records them), not decode steps, explicit masks, traces of gradients or larger chunks, and the
tokens stay those of MLX's attention; a left-padded group reaches its padded form with the rows'
pads; marking off CUDA or with the switch off marks nothing.

On CUDA (MLX's CUDA build): the kernel's output is float64's within the dtype's rounding for chunk
and cache lengths on both sides of a block and a key tile, q a view of joint heads and keys views of
a longer buffer, and so is its padded form over left-padded rows; its check passes; a model's
prefill through it gives MLX's greedy tokens.
"""
from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pymlxc
import pymlxc.core as mx
from pymlxc.backends.metal import generate as loops
from pymlxc.backends.metal import kernel_choice, nn
from pymlxc.backends.metal.cache import LeftPaddedMask
from pymlxc.backends.metal.kernels import prefill_attention as kernel
from pymlxc.backends.metal.loader import load_weights_and_config
from pymlxc.backends.metal.models import base
from pymlxc.backends.metal.sample import greedy
from pymlxc.testing import write_tiny_model

ON_CUDA = mx.cuda_available() and mx.default_device().type == "gpu"
cuda_only = pytest.mark.skipif(not ON_CUDA, reason="the kernel needs MLX's CUDA build (run on the GPU machine)")

GROUPS = st.sampled_from([(32, 8), (16, 8), (8, 8), (32, 4), (14, 2), (28, 4), (12, 2), (40, 8), (8, 1), (32, 1),
                          (64, 1), (12, 4)])


@given(batch=st.integers(1, 3), q_len=st.integers(2, 600), group=GROUPS, head_dim=st.sampled_from(kernel.HEAD_DIMS))
def test_the_launch_covers_every_position(batch: int, q_len: int, group: tuple[int, int], head_dim: int) -> None:
    heads, kv_heads = group
    if not kernel.applies(q_len, q_len, heads, kv_heads, head_dim, 2):
        return
    geo = kernel.launch(batch, q_len, heads, kv_heads, head_dim, mx.bfloat16, 0.125)
    assert geo["threadgroup"] == (kernel.THREADS, 1, 1) and geo["grid"][0] % kernel.THREADS == 0
    template = dict(geo["template"])
    assert (template["HQ"], template["HKV"], template["D"]) == (heads, kv_heads, head_dim)
    # The blocks as the kernel's source takes them apart (P = BM / REP positions a block, block index
    # -> position tile, key/value head, batch row): every (row, head, position) once.
    per_block = kernel.VECTORS // (heads // kv_heads)
    tiles = -(-q_len // per_block)
    seen = []
    for blk in range(geo["grid"][0] // kernel.THREADS):
        pt, rest = blk % tiles, blk // tiles
        h, b = rest % kv_heads, rest // kv_heads
        seen += [(b, h, p) for p in range(pt * per_block, min((pt + 1) * per_block, q_len))]
    assert sorted(seen) == [(b, h, p) for b in range(batch) for h in range(kv_heads) for p in range(q_len)]


def test_what_the_kernel_takes() -> None:
    assert kernel.applies(128, 128, 32, 8, 64, 2) and kernel.applies(128, 8192, 32, 8, 128, 2)
    assert not kernel.applies(129, 8192, 32, 8, 64, 2)  # more than MAX_PAIRS pairs
    assert not kernel.applies(1, 100, 32, 8, 64, 2)  # one query: the decode's kernels
    assert not kernel.applies(20, 10, 32, 8, 64, 2)  # more queries than keys
    assert kernel.applies(20, 20, 32, 8, 96, 2) and kernel.applies(20, 20, 28, 4, 80, 2)
    assert not kernel.applies(20, 20, 32, 8, 72, 2) and not kernel.applies(20, 20, 32, 8, 256, 2)
    assert not kernel.applies(20, 20, 32, 8, 64, 4)  # float32
    assert kernel.applies(20, 20, 32, 1, 64, 2) and kernel.applies(20, 20, 64, 1, 128, 2)
    assert kernel.applies(20, 20, 12, 4, 64, 2)  # groups of 3: 21 positions a block, a vector left empty
    assert not kernel.applies(20, 20, 30, 8, 64, 2) and not kernel.applies(20, 20, 128, 1, 64, 2)


@settings(max_examples=25, deadline=None)
@given(q_len=st.integers(1, 20), extra=st.integers(0, 20), group=GROUPS, seed=st.integers(0, 2**16))
def test_the_reference_is_mlx_causal_attention(q_len: int, extra: int, group: tuple[int, int], seed: int) -> None:
    """The float64 reference the kernel's check and tests measure it by is MLX's own causal attention
    (bottom-right aligned, grouped heads), here in float32 on the CPU."""
    heads, kv_heads = group
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((1, h, n, 16)).astype(np.float32)
               for h, n in ((heads, q_len), (kv_heads, q_len + extra), (kv_heads, q_len + extra)))
    want = np.asarray(mx.fast.scaled_dot_product_attention(mx.array(q), mx.array(k), mx.array(v), scale=0.25,
                                                           mask="causal" if q_len > 1 else None))
    got = kernel_choice.causal_attention_reference(*(a.astype(np.float64) for a in (q, k, v)), 0.25)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@settings(max_examples=25, deadline=None)
@given(q_len=st.integers(2, 20), extra=st.integers(0, 20), group=GROUPS, data=st.data())
def test_the_padded_reference_is_mlx_attention_under_the_left_padded_mask(q_len: int, extra: int,
                                                                         group: tuple[int, int], data: Any) -> None:
    """With `starts`, the reference is MLX's attention under `generate.left_padded_mask`'s boolean mask
    (padded queries seeing only themselves), and that mask carries its pads for the kernel."""
    heads, kv_heads = group
    t = q_len + extra
    pads = data.draw(st.lists(st.integers(0, t), min_size=1, max_size=3))
    rng = np.random.default_rng(len(pads) * 1000 + t)
    q, k, v = (rng.standard_normal((len(pads), h, n, 16)).astype(np.float32)
               for h, n in ((heads, q_len), (kv_heads, t), (kv_heads, t)))
    starts = mx.array(np.array(pads, np.int32))
    mask = loops.left_padded_mask(starts, extra, q_len)
    assert isinstance(mask, LeftPaddedMask) and mask.starts is starts
    assert not isinstance(loops.left_padded_mask(starts, extra, q_len, window=4), LeftPaddedMask)
    assert not isinstance(mx.logical_not(mask), LeftPaddedMask)  # derived masks are plain arrays
    want = np.asarray(mx.fast.scaled_dot_product_attention(mx.array(q), mx.array(k), mx.array(v), scale=0.25,
                                                           mask=mask))
    got = kernel_choice.causal_attention_reference(*(a.astype(np.float64) for a in (q, k, v)), 0.25, pads)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def _mlx_form(q: Any, k: Any, v: Any, scale: float, starts: Any = None) -> Any:
    """What the kernel computes, by MLX's attention: causal, or under the left-padded mask of `starts`."""
    n = q.shape[2]
    mask = "causal" if starts is None else loops.left_padded_mask(starts, k.shape[2] - n, n)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_checks_pass_mlx_attention_and_fail_a_wrong_one(dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The load-time checks (causal and padded) with MLX's attention standing in for the kernel: it
    passes both within their bounds, and a form that ignores the padding, or the causal order, fails
    with the case named."""
    dt = getattr(mx, dtype)
    monkeypatch.setattr(kernel_choice, "prefill_attention", _mlx_form)
    assert kernel_choice._compare_prefill_attention(dt, 64, 8, 2, 0.125) is None  # noqa: SLF001
    assert kernel_choice._compare_padded_prefill_attention(dt, 64, 8, 2, 0.125) is None  # noqa: SLF001
    monkeypatch.setattr(kernel_choice, "prefill_attention",
                        lambda q, k, v, scale, starts=None: _mlx_form(q, k, v, scale))
    why = kernel_choice._compare_padded_prefill_attention(dt, 64, 8, 2, 0.125)  # noqa: SLF001
    assert why is not None and "left-padded rows" in why
    monkeypatch.setattr(kernel_choice, "prefill_attention", lambda q, k, v, scale, starts=None:
                        mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=None))
    why = kernel_choice._compare_prefill_attention(dt, 64, 8, 2, 0.125)  # noqa: SLF001
    assert why is not None and "queries over" in why


@pytest.fixture
def llama(tmp_path: Any):
    path = write_tiny_model(tmp_path / "llama", "llama", num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2,
                            dtype="float16")
    with load_weights_and_config(path) as loaded:
        yield loaded.model


def test_marked_modules_send_causal_chunks_to_the_kernel(llama: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A marked model's causal chunks (prefill, op by op) reach the kernel's entry, its one-token
    steps and its gradients' traces do not; the greedy tokens are those of MLX's attention."""
    prompt = [int(i) for i in np.random.default_rng(0).integers(16, 500, size=30)]
    want = list(loops.generate_ids(llama, prompt, cache=llama.make_cache(None), max_tokens=6, sampler=greedy))
    calls: list[tuple[int, int]] = []

    def stand_in(q: Any, k: Any, v: Any, scale: float) -> Any:
        calls.append((q.shape[2], k.shape[2]))
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal")

    monkeypatch.setattr(base, "prefill_attention", stand_in)
    for m in nn.prefill_attention_modules(llama):
        monkeypatch.setitem(m.__dict__, "prefill_kernel", True)
    got = list(loops.generate_ids(llama, prompt, cache=llama.make_cache(None), max_tokens=6, sampler=greedy,
                                  prefill_step=16))
    assert got == want
    # Two chunks through layer 0 (the last layer's queries need no attention but the last one's, a
    # single query); no decode step.
    assert calls == [(16, 16), (14, 30)]
    calls.clear()
    with kernel_choice.mlx_kernels_only():
        llama(mx.array([prompt], dtype=mx.int32), cache=llama.make_cache(None))
    assert calls == []
    long = mx.array([prompt * 35], dtype=mx.int32)  # 1050 x 1050 pairs: past MAX_PAIRS
    mx.eval(llama(long, cache=llama.make_cache(None)))
    assert calls == []


def test_a_left_padded_group_reaches_the_padded_form(llama: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch of prompts of several lengths, left-padded (`classify_ids`, as the server's grouped
    prefill pads them), sends each layer's attention to the kernel's padded form with the rows' pads;
    the ids and logits stay those of MLX's attention under the boolean mask."""
    prompts = [[int(i) for i in np.random.default_rng(n).integers(16, 500, size=n)] for n in (30, 9, 21)]
    want, want_logits = loops.classify_ids(llama, prompts, sampler=greedy, return_logits=True)
    calls: list[tuple[int, int, list[int]]] = []

    def stand_in(q: Any, k: Any, v: Any, scale: float, starts: Any = None) -> Any:
        calls.append((q.shape[2], k.shape[2], [] if starts is None else np.asarray(starts).tolist()))
        return _mlx_form(q, k, v, scale, starts)

    monkeypatch.setattr(base, "prefill_attention", stand_in)
    for m in nn.prefill_attention_modules(llama):
        monkeypatch.setitem(m.__dict__, "prefill_kernel", True)
    passed: list[tuple[Any, ...]] = []  # the padded form's verdict as the attention asks it
    monkeypatch.setattr(base, "padded_prefill_attention_passed", lambda *key: passed.append(key) or True)
    got, got_logits = loops.classify_ids(llama, prompts, sampler=greedy, return_logits=True)
    assert got == want
    np.testing.assert_array_equal(np.asarray(got_logits), np.asarray(want_logits))
    # Layer 0 of the group (the last layer attends for the last position alone: one query), its rows
    # padded to the longest prompt, in the group's order.
    assert [(n, t) for n, t, _ in calls] == [(30, 30)] and sorted(calls[0][2]) == [0, 9, 21]
    attn = nn.prefill_attention_modules(llama)[0]
    assert passed == [(mx.float16, attn.head_dim, attn.n_heads, attn.n_kv_heads, attn.scale)]
    # Without that verdict (the form's check failed, or never ran here) the group keeps MLX's attention.
    calls.clear()
    monkeypatch.setattr(base, "padded_prefill_attention_passed", lambda *key: False)
    assert loops.classify_ids(llama, prompts, sampler=greedy) == (want, None) and calls == []


def test_the_schedulers_grouped_prefill_reaches_the_padded_form(tmp_path: Any,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The server's grouped prefill (`Scheduler._prefill_group`: prompts that arrive together, one
    left-padded pass) sends its layers' attention to the padded form with the rows' pads, and each
    row's tokens stay those of its prompt generated alone."""
    from pymlxc.backends.metal.batching import Collector, Request, SamplingParams  # noqa: PLC0415

    path = write_tiny_model(tmp_path / "llama", "llama", num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2,
                            dtype="float16", seed=5)
    prompts = [[int(i) for i in np.random.default_rng(n).integers(16, 500, size=n)] for n in (12, 5, 20)]
    params = SamplingParams(max_tokens=5)
    calls: list[list[int]] = []

    def stand_in(q: Any, k: Any, v: Any, scale: float, starts: Any = None) -> Any:
        calls.append([] if starts is None else np.asarray(starts).tolist())
        return _mlx_form(q, k, v, scale, starts)

    def run(scheduler: Any, group: list[list[int]]) -> list[list[int]]:
        collectors = [Collector() for _ in group]
        scheduler.submit_all([Request(p, params, c) for p, c in zip(group, collectors, strict=True)], bounded=False)
        assert all(c.wait(120) for c in collectors)
        return [c.tokens() for c in collectors]

    with pymlxc.load_model(str(path), backend="metal", prompt_cache_entries=0) as model:
        scheduler = model.scheduler()
        alone = [run(scheduler, [p])[0] for p in prompts]
        monkeypatch.setattr(base, "prefill_attention", stand_in)
        monkeypatch.setattr(base, "padded_prefill_attention_passed", lambda *key: True)
        for m in nn.prefill_attention_modules(model.model):
            monkeypatch.setitem(m.__dict__, "prefill_kernel", True)
        assert run(scheduler, prompts) == alone
        assert scheduler.grouped == len(prompts)
    padded = [c for c in calls if c]
    assert padded and all(sorted(c) == [0, 8, 15] for c in padded)


def test_an_explicit_mask_keeps_mlx_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    called: list[Any] = []
    monkeypatch.setattr(base, "prefill_attention", lambda *a: called.append(a))
    q = mx.ones((1, 4, 8, 64), dtype=mx.bfloat16)
    k = mx.ones((1, 2, 8, 64), dtype=mx.bfloat16)
    mask = mx.ones((8, 8), dtype=mx.bool_)
    base.attention(q, k, k, scale=0.125, mask=mask, kernel=True)
    base.attention(q, k, k, scale=0.125, mask=None, kernel=True)
    base.attention(q, k, k, scale=0.125, mask="causal", kernel=False)
    assert called == []
    base.attention(q, k, k, scale=0.125, mask="causal", kernel=True)
    assert len(called) == 1


def test_marking(llama: Any) -> None:
    """Every layer's attention module is found; switched off, marking clears the flags; switched on,
    the modules are marked where the kernel's check passes (CUDA), and where it cannot run (a CPU)
    the check says why in a RuntimeWarning and nothing is marked."""
    modules = nn.prefill_attention_modules(llama)
    assert len(modules) == len(llama.layers) == 2
    for m in modules:
        m.__dict__["prefill_kernel"] = True
    assert not nn.mark_prefill_attention(llama, False, mx.bfloat16)
    assert not any(m.prefill_kernel for m in modules)
    key = ("prefill_attention", str(mx.bfloat16), 64, 4, 2, 64 ** -0.5)  # kernel_choice.prefill_attention_ready's
    asked_before = key in kernel_choice.prefill_attention_checks.known()  # a verdict is asked once a process
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        marked = nn.mark_prefill_attention(llama, True, mx.bfloat16)
    assert marked is ON_CUDA and all(m.prefill_kernel is ON_CUDA for m in modules)
    assert kernel_choice.prefill_attention_checks.known()[key] is ON_CUDA
    if not ON_CUDA and not asked_before:
        assert any("prefill attention is not used" in str(w.message) for w in caught)
    nn.mark_prefill_attention(llama, False, mx.bfloat16)


@cuda_only
@settings(max_examples=40, deadline=None)
@given(batch=st.integers(1, 2), q_len=st.integers(2, 140), extra=st.integers(0, 300), group=GROUPS,
       head_dim=st.sampled_from(kernel.HEAD_DIMS), dtype=st.sampled_from(["bfloat16", "float16"]),
       seed=st.integers(0, 2**16))
def test_the_kernel_is_float64s_attention(batch: int, q_len: int, extra: int, group: tuple[int, int], head_dim: int,
                                          dtype: str, seed: int) -> None:
    _check_kernel(batch, q_len, extra, group, head_dim, dtype, seed)


def _check_kernel(batch: int, q_len: int, extra: int, group: tuple[int, int], head_dim: int, dtype: str,
                  seed: int) -> None:
    """The kernel on q a view of joint heads and keys and values views of longer buffers, against
    float64 on the same values."""
    heads, kv_heads = group
    t = q_len + extra
    if not kernel.applies(q_len, t, heads, kv_heads, head_dim, 2):
        return
    rng = np.random.default_rng(seed)
    dt = getattr(mx, dtype)
    joint = mx.array(rng.standard_normal((batch, heads + kv_heads, q_len, head_dim)).astype(np.float32)).astype(dt)
    buffers = [mx.array(rng.standard_normal((batch, kv_heads, t + 7, head_dim)).astype(np.float32)).astype(dt)
               for _ in range(2)]
    q = mx.slice(joint, [0, kv_heads, 0, 0], [batch, heads + kv_heads, q_len, head_dim], [1, 1, 1, 1])
    k, v = (mx.slice(a, [0, 0, 0, 0], [batch, kv_heads, t, head_dim], [1, 1, 1, 1]) for a in buffers)
    scale = head_dim ** -0.5
    got = np.asarray(kernel_choice.prefill_attention(q, k, v, scale).astype(mx.float32))
    qf, kf, vf = (np.asarray(a.astype(mx.float32)).astype(np.float64) for a in (q, k, v))
    want = kernel_choice.causal_attention_reference(qf, kf, vf, scale)
    assert got.shape == want.shape == (batch, heads, q_len, head_dim)
    # The output's rounding and that of the probabilities (the type's, for the second product).
    unit = 2.0 ** -8 if dtype == "bfloat16" else 2.0 ** -10
    np.testing.assert_array_less(np.abs(got - want), unit * (np.abs(want) + np.abs(vf).max()) + 1e-6)


@cuda_only
@settings(max_examples=30, deadline=None)
@given(q_len=st.integers(2, 140), extra=st.integers(0, 200), group=GROUPS, head_dim=st.sampled_from(kernel.HEAD_DIMS),
       dtype=st.sampled_from(["bfloat16", "float16"]), data=st.data())
def test_the_padded_form_is_float64s_attention(q_len: int, extra: int, group: tuple[int, int], head_dim: int,
                                               dtype: str, data: Any) -> None:
    """Left-padded rows (padding up to any key, past the chunk's first query too) against float64."""
    heads, kv_heads = group
    t = q_len + extra
    if not kernel.applies(q_len, t, heads, kv_heads, head_dim, 2):
        return
    pads = data.draw(st.lists(st.integers(0, t), min_size=1, max_size=3))
    rng = np.random.default_rng(t * 7 + len(pads))
    dt = getattr(mx, dtype)
    q, k, v = (mx.array(rng.standard_normal((len(pads), h, n, head_dim)).astype(np.float32)).astype(dt)
               for h, n in ((heads, q_len), (kv_heads, t), (kv_heads, t)))
    scale = head_dim ** -0.5
    got = np.asarray(kernel_choice.prefill_attention(q, k, v, scale, mx.array(np.array(pads, np.int32)))
                     .astype(mx.float32))
    qf, kf, vf = (np.asarray(a.astype(mx.float32)).astype(np.float64) for a in (q, k, v))
    want = kernel_choice.causal_attention_reference(qf, kf, vf, scale, pads)
    unit = 2.0 ** -8 if dtype == "bfloat16" else 2.0 ** -10
    np.testing.assert_array_less(np.abs(got - want), unit * (np.abs(want) + np.abs(vf).max()) + 1e-6)


# (batch, queries, keys, query heads, key/value heads, head size, dtype): groups of 3, 5, 6 and 7 (vectors
# left empty in each block), every head size, chunks over longer caches.
CASES = [(1, 37, 37, 28, 4, 128, "bfloat16"), (2, 100, 333, 12, 4, 80, "float16"), (1, 64, 64, 12, 2, 96, "bfloat16"),
         (1, 129, 200, 40, 8, 112, "bfloat16"), (1, 5, 70, 64, 1, 64, "float16"), (1, 128, 128, 32, 8, 64, "bfloat16"),
         (2, 70, 70, 14, 2, 64, "bfloat16"), (1, 300, 900, 32, 8, 128, "bfloat16")]


@cuda_only
@pytest.mark.parametrize(("batch", "q_len", "kv_len", "heads", "kv_heads", "head_dim", "dtype"), CASES)
def test_the_kernel_at_named_shapes(batch: int, q_len: int, kv_len: int, heads: int, kv_heads: int, head_dim: int,
                                    dtype: str) -> None:
    _check_kernel(batch, q_len, kv_len - q_len, (heads, kv_heads), head_dim, dtype, q_len + kv_len)


@cuda_only
def test_the_check_passes_and_a_prefill_keeps_mlx_tokens(tmp_path: Any) -> None:
    assert kernel_choice.prefill_attention_ready(mx.bfloat16, 64, 32, 8, 0.125)
    assert kernel_choice.padded_prefill_attention_ready(mx.bfloat16, 64, 32, 8, 0.125)
    assert kernel_choice.padded_prefill_attention_passed(mx.bfloat16, 64, 32, 8, 0.125)
    path = write_tiny_model(tmp_path / "llama", "llama", num_layers=2, hidden_size=512, num_heads=8, num_kv_heads=2,
                            dtype="float16")
    with load_weights_and_config(path) as loaded:
        model = loaded.model
        marked = nn.prefill_attention_modules(model)
        assert marked and all(m.prefill_kernel for m in marked)  # auto on CUDA, at load
        prompt = [int(i) for i in np.random.default_rng(1).integers(16, 500, size=90)]
        got = list(loops.generate_ids(model, prompt, cache=model.make_cache(None), max_tokens=8, sampler=greedy))
        for m in marked:
            m.__dict__["prefill_kernel"] = False
        want = list(loops.generate_ids(model, prompt, cache=model.make_cache(None), max_tokens=8, sampler=greedy))
        assert got == want

"""The fused residual add + RMSNorm CUDA kernel (backends/metal/kernels/add_rms_norm.py) and its use in the
segmented decode (backends/metal/decode/segments.py) and Gemma's whole-step graph (graph_fusions.py).

Everywhere: the launch geometry follows MLX's `rms_norm` dispatch (the kernel reproduces MLX's
`rms_norm_small` in its aligned and unaligned forms, so it may only stand in where MLX would run
that one); the setting is read by name; off CUDA the segments keep MLX's kernels, and a forced
setting there warns and keeps them too; with the kernel replaced by MLX's two ops, the segments
that use it give the uncompiled loop's tokens (the restructured residual stream is right).

On CUDA: the kernel equals MLX's add and rms_norm bit for bit, and models decoded with it keep the
uncompiled loop's greedy tokens.
"""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pymlxc.core as mx
from pymlxc.backends.metal.decode import segments
from pymlxc.backends.metal.decode.decoder import CompiledDecoder
from pymlxc.backends.metal.kernels import add_rms_norm as cuda_norm

from .cuda_decode_helpers import (
    ON_CUDA,
    check_the_setting_is_read_by_name,
    cuda_only,
    greedy_ids,
    plan_flags,
    stand_in_for_add_norm,
    stood_in_decoder,
    tiny_models,
)

# Row lengths MLX's aligned rms_norm_small serves, with its (threads, 16-byte loads per thread).
ALIGNED = {512: (64, 1), 1024: (128, 1), 1536: (64, 3), 2048: (128, 2), 2560: (64, 5), 3072: (128, 3),
           4096: (128, 4), 5120: (128, 5), 8192: (128, 8)}
# Row lengths its unaligned form serves (loads past the row read zeros): Gemma-3-1B's 1152 among them.
UNALIGNED = {64: (64, 1), 256: (64, 1), 520: (128, 1), 1000: (128, 1), 1032: (128, 2), 1152: (128, 2),
             6000: (128, 6)}


@pytest.fixture
def tiny(tmp_path: Path):
    models = tiny_models(tmp_path)
    load = next(models)
    yield lambda arch, hidden=512: load(arch, hidden_size=hidden)
    next(models, None)


def test_geometry_follows_mlx_rms_norm_dispatch() -> None:
    for d, want in {**ALIGNED, **UNALIGNED}.items():
        assert cuda_norm.geometry(d) == want, d
    # MLX's large-row kernel, and rows whose last 16-byte vector would be partial: not ours to replace.
    for d in (9216, 10240, 16384, 1001, 2044):
        assert cuda_norm.geometry(d) is None, d
    assert cuda_norm.applies(2048, mx.bfloat16) and cuda_norm.applies(2048, mx.float16)
    assert cuda_norm.applies(1152, mx.bfloat16)
    assert not cuda_norm.applies(2048, mx.float32) and not cuda_norm.applies(2001, mx.bfloat16)


def test_the_decoder_reads_the_setting_by_name(tiny, monkeypatch: pytest.MonkeyPatch, switches: Any) -> None:
    check_the_setting_is_read_by_name(tiny("llama"), switches, "PYMLXC_FUSED_NORM", "fused_norm", "fused_norm")


@pytest.mark.skipif(ON_CUDA, reason="off CUDA only: there the kernel cannot run")
def test_off_cuda_the_segments_keep_mlx_kernels(tiny, monkeypatch: pytest.MonkeyPatch, switches: Any) -> None:
    model = tiny("llama")
    blocks = segments.plan(model)
    assert blocks is not None
    assert not segments.use_fused_norm(model, blocks, "auto")
    assert not segments.use_fused_norm(model, blocks, "0")
    cuda_norm.checks.forget()  # a fresh check
    with pytest.warns(RuntimeWarning, match="fused add"):
        assert not segments.use_fused_norm(model, blocks, "1")
    switches.env("PYMLXC_FUSED_NORM", "1")
    decoder = CompiledDecoder(model, "segmented")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the check's verdict is cached: no second warning
        assert greedy_ids(model, decoder) == greedy_ids(model, None)
    assert plan_flags(decoder, "fused_norm") == {False}
    decoder.close()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_segments_with_the_fused_step_keep_the_tokens(tiny, monkeypatch: pytest.MonkeyPatch, arch: str) -> None:
    """The kernel stood in for by MLX's own two ops: the segments that call it give the tokens of
    the uncompiled loop, so the residual stream (the sum output kept, the normed one projected) is
    wired right. (A wrong wiring changes the tokens of these random models.)"""
    model = tiny(arch)
    calls = stand_in_for_add_norm(monkeypatch)
    monkeypatch.setattr(segments, "use_fused_norm", lambda *a: True)
    decoder = stood_in_decoder(model, "fused_norm")
    if plan_flags(decoder, "attention") == {"kernel"}:  # the whole step as one graph: twice per layer
        assert len(calls) == 2 * len(model.layers)
    else:  # traced once each: the middle segment adds twice (after attention, after the MLP), the last too
        assert len(calls) == 4
    decoder.close()


# ---------------------------------------------------------------------- on CUDA

@cuda_only
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(d=st.sampled_from(sorted({**ALIGNED, **UNALIGNED})), rows=st.integers(1, 5),
       dtype=st.sampled_from(["bfloat16", "float16"]), eps=st.sampled_from([1e-5, 1e-6]),
       scale=st.sampled_from([0.01, 1.0, 30.0]), seed=st.integers(0, 2**16))
def test_the_kernel_equals_mlx_add_and_rms_norm_bit_for_bit(d: int, rows: int, dtype: str, eps: float, scale: float,
                                                             seed: int) -> None:
    rng = np.random.default_rng(seed)
    t = getattr(mx, dtype)
    a, b = (mx.array((rng.standard_normal((rows, 1, d)) * scale).astype(np.float32)).astype(t) for _ in range(2))
    w = mx.array(rng.standard_normal(d).astype(np.float32)).astype(t)
    got = cuda_norm.add_rms_norm(a, b, w, eps)
    want = cuda_norm.unfused(a, b, w, eps)
    for g, e in zip(got, want, strict=True):
        assert g.shape == e.shape and g.dtype == e.dtype
        np.testing.assert_array_equal(np.asarray(g.astype(mx.float32)), np.asarray(e.astype(mx.float32)))


@cuda_only
@pytest.mark.parametrize("arch,hidden", [("llama", 1024), ("qwen3", 512)])
def test_decoding_with_the_kernel_keeps_the_tokens(tiny, arch: str, hidden: int) -> None:
    model = tiny(arch, hidden)
    want = greedy_ids(model, None, n=24)
    decoder = CompiledDecoder(model, "segmented")
    assert greedy_ids(model, decoder, n=24) == want
    assert plan_flags(decoder, "fused_norm") == {True}
    decoder.close()

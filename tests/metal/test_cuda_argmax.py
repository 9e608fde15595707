"""Greedy's argmax as two CUDA kernels (backends/metal/kernels/argmax.py) in the segmented decode.

Everywhere: the setting is read by name; off CUDA the segments keep MLX's argmax, and a forced
setting there warns and keeps it too; with the kernels stood in for by MLX's argmax, the segments
that call them give the uncompiled loop's tokens.

On CUDA: the kernels give MLX's argmax index for any row (ties across slices, -inf rows, NaN), and
models decoded with them keep the uncompiled loop's greedy tokens.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pymlxc.core as mx
from pymlxc.backends.metal import generate as loops
from pymlxc.backends.metal.decode import segments
from pymlxc.backends.metal.decode.decoder import CompiledDecoder
from pymlxc.backends.metal.kernels import argmax as cuda_argmax
from pymlxc.backends.metal.sample import greedy

from .cuda_decode_helpers import (
    ON_CUDA,
    check_a_forced_setting_keeps_mlx_kernels,
    check_the_setting_is_read_by_name,
    cuda_only,
    greedy_ids,
    plan_flags,
    stood_in_decoder,
    tiny_models,
)


@pytest.fixture
def tiny(tmp_path: Path):
    models = tiny_models(tmp_path)
    load = next(models)
    yield lambda arch="llama", bits=None: load(arch, quantize_bits=bits, vocab_size=3000)
    next(models, None)


def test_slices_and_types() -> None:
    assert cuda_argmax.slices(1) == 1 and cuda_argmax.slices(1024) == 1 and cuda_argmax.slices(1025) == 2
    assert cuda_argmax.slices(128256) == 126 and cuda_argmax.slices(262144) == cuda_argmax.MAX_SLICES
    assert all(cuda_argmax.applies(t) for t in (mx.bfloat16, mx.float16, mx.float32))
    assert not cuda_argmax.applies(mx.int32)


def test_the_decoder_reads_the_setting_by_name(tiny, monkeypatch: pytest.MonkeyPatch, switches: Any) -> None:
    check_the_setting_is_read_by_name(tiny(), switches, "PYMLXC_CUDA_ARGMAX", "cuda_argmax", "cuda_argmax")


@pytest.mark.skipif(ON_CUDA, reason="off CUDA only: there the kernels cannot run")
def test_off_cuda_the_segments_keep_mlx_argmax(tiny, monkeypatch: pytest.MonkeyPatch, switches: Any) -> None:
    model = tiny()
    assert not segments.use_cuda_argmax(model, "auto")
    assert not segments.use_cuda_argmax(model, "0")
    cuda_argmax.checks.forget()  # a fresh check
    with pytest.warns(RuntimeWarning, match="CUDA argmax"):
        assert not segments.use_cuda_argmax(model, "1")
    check_a_forced_setting_keeps_mlx_kernels(model, switches, "PYMLXC_CUDA_ARGMAX", "cuda_argmax")


@pytest.mark.parametrize("bits", [None, 4])
def test_segments_calling_the_kernels_keep_the_tokens(tiny, monkeypatch: pytest.MonkeyPatch, bits: int | None) -> None:
    """The kernels stood in for by MLX's argmax: the last segment calls them on the step's logits
    [B, vocab] (traced once) and returns their int32 ids, and the tokens are the uncompiled loop's.
    A sampler other than greedy never reaches them."""
    model = tiny("llama", bits)
    shapes = []

    def stand_in(logits: Any) -> Any:
        shapes.append(tuple(logits.shape))
        return greedy(logits)

    monkeypatch.setattr(cuda_argmax, "argmax", stand_in)
    monkeypatch.setattr(segments, "use_cuda_argmax", lambda *a: True)
    decoder = stood_in_decoder(model, "cuda_argmax")
    assert shapes == [(1, 3000)]
    from pymlxc.backends.metal.sample import make_sampler

    sampler = make_sampler(temperature=0.8, key=1)
    prompt = [3, 4, 5, 6]
    got = list(loops.generate_ids(model, prompt, cache=model.make_cache(None), max_tokens=6,
                                  sampler=sampler, decoder=decoder))
    assert len(got) == 6 and len(shapes) == 1
    decoder.close()


# ---------------------------------------------------------------------- on CUDA

@cuda_only
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(v=st.integers(1, 300_000), rows=st.integers(1, 3), dtype=st.sampled_from(["bfloat16", "float16", "float32"]),
       ties=st.lists(st.integers(0, 299_999), max_size=4), special=st.sampled_from(["none", "ninf", "nan"]),
       seed=st.integers(0, 2**16))
def test_the_kernels_give_mlx_argmax(v: int, rows: int, dtype: str, ties: list[int], special: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    x = rng.normal(0, 3, (rows, v)).astype(np.float32)
    places = [t % v for t in ties]
    if places:
        x[0, places] = x.max() + 1.0  # one maximum at several places, maybe in different slices
    if special == "ninf":
        x[-1, :] = -np.inf
    elif special == "nan":
        x[-1, places or [0]] = np.nan
    logits = mx.array(x).astype(getattr(mx, dtype))
    got = np.asarray(cuda_argmax.argmax(logits))
    want = np.asarray(mx.argmax(logits, axis=-1).astype(mx.int32))
    np.testing.assert_array_equal(got, want)


@cuda_only
@pytest.mark.parametrize("bits", [None, 4])
def test_decoding_with_the_kernels_keeps_the_tokens(tiny, bits: int | None) -> None:
    model = tiny("llama", bits)
    want = greedy_ids(model, None, n=24)
    decoder = CompiledDecoder(model, "segmented")
    assert greedy_ids(model, decoder, n=24) == want
    assert plan_flags(decoder, "cuda_argmax") == {True}
    decoder.close()

"""Q6_K weights of linear layers rearranged into planes for the CUDA kernel (`gguf_blocks.to_planes`,
`gguf_layers.use_planes`): the layout, its inverse, the layers' products on either layout, the loader's
setting, and on CUDA the planes kernel against the file-layout kernel bit for bit."""
from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pymlxc.core as mx
import pymlxc.settings as pymlxc_settings
from pymlxc.backends.metal import distributed, gguf_layers, kernel_choice
from pymlxc.backends.metal import generate as loops
from pymlxc.backends.metal.gguf_layers import BlockEmbedding, BlockLinear
from pymlxc.backends.metal.kernels import gguf_blocks
from pymlxc.backends.metal.loader import load_weights_and_config
from pymlxc.backends.metal.sample import greedy
from pymlxc.testing import write_tiny_model

from .cuda_decode_helpers import cuda_only
from .gguf_export import export_gguf


@pytest.fixture(autouse=True)
def _quiet() -> None:
    warnings.simplefilter("ignore", DeprecationWarning)


def planes_by_hand(blocks: np.ndarray) -> np.ndarray:
    """The planes layout written out: per block u (row-major), lane s's 16 ql bytes are
    ql[64 h + 8 j .. + 8] then ql[64 h + 32 + 8 j .. + 8] (s = 4 h + j); then every qh, scales, d."""
    u = blocks.reshape(-1, 210)
    ql = np.empty((u.shape[0], 128), np.uint8)
    for s in range(8):
        h, j = s >> 2, s & 3
        ql[:, 16 * s:16 * s + 8] = u[:, 64 * h + 8 * j:64 * h + 8 * j + 8]
        ql[:, 16 * s + 8:16 * s + 16] = u[:, 64 * h + 32 + 8 * j:64 * h + 32 + 8 * j + 8]
    flat = np.concatenate([ql.reshape(-1), u[:, 128:192].reshape(-1), u[:, 192:208].reshape(-1),
                           u[:, 208:].reshape(-1)])
    return flat.reshape(blocks.shape)


@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 40), nb=st.integers(1, 9), seed=st.integers(0, 2**32 - 1), data=st.data())
def test_planes_are_the_lanes_bytes_and_give_the_blocks_back(n: int, nb: int, seed: int, data: Any) -> None:
    blocks = gguf_blocks.random_blocks(np.random.default_rng(seed), (n, nb), Q.Q6_K)
    planes = gguf_blocks.to_planes(mx.array(blocks))
    np.testing.assert_array_equal(np.asarray(planes), planes_by_hand(blocks))
    np.testing.assert_array_equal(np.asarray(gguf_blocks.from_planes(planes)), blocks)
    start = data.draw(st.integers(0, n - 1))
    stop = data.draw(st.integers(start + 1, n))
    np.testing.assert_array_equal(np.asarray(gguf_blocks.from_planes(planes, start, stop)), blocks[start:stop])


def planes_values(planes: np.ndarray, start: int, stop: int) -> np.ndarray:
    """`pymlxc_gguf::planes_values8` (CUDA_PLANES_HEADER) transcribed, as the lookup kernel runs it over
    rows start..stop (a prefill chunk): rows of planes [N, NB, 210] as float32 values."""
    n_rows, nb = planes.shape[:2]
    w = planes.reshape(-1)
    units = n_rows * nb
    out = np.empty(((stop - start) * nb, 256), np.float32)
    for unit in range((stop - start) * nb):
        u = start * nb + unit
        for lane in range(32):
            p0 = lane * 8
            n, k, at, s = p0 >> 7, (p0 & 127) >> 5, p0 & 31, p0 >> 4  # the source's n, k, l, s
            ql = u * 128 + 16 * (4 * n + (at >> 3)) + 8 * (k & 1)
            qh = units * 128 + u * 64 + 32 * n + at
            d = np.float32(w[units * 208 + u * 2:units * 208 + u * 2 + 2].view(np.float16)[0])
            dl = d * np.float32(w[units * 192 + u * 16 + s:units * 192 + u * 16 + s + 1].view(np.int8)[0])
            for i in range(8):
                q = ((int(w[ql + i]) >> (4 * (k >> 1))) & 15) | (((int(w[qh + i]) >> (2 * k)) & 3) << 4)
                out[unit, p0 + i] = dl * (np.float32(q) - np.float32(32))
    return out.reshape(stop - start, nb * 256)


@settings(max_examples=6, deadline=None)
@given(n=st.integers(1, 6), nb=st.integers(1, 3), seed=st.integers(0, 2**32 - 1), data=st.data())
def test_the_planes_lookup_of_a_range_reads_the_reference_values(n: int, nb: int, seed: int, data: Any) -> None:
    """The CUDA planes lookup's indexing over a range of rows, replayed in numpy, gives gguf's
    reference values."""
    blocks = gguf_blocks.random_blocks(np.random.default_rng(seed), (n, nb), Q.Q6_K)
    planes = np.asarray(gguf_blocks.to_planes(mx.array(blocks)))
    start = data.draw(st.integers(0, n - 1))
    stop = data.draw(st.integers(start + 1, n))
    want = gguf.quants.dequantize(blocks[start:stop].reshape(stop - start, -1), Q.Q6_K)
    np.testing.assert_array_equal(planes_values(planes, start, stop), want.reshape(stop - start, -1))


@settings(max_examples=10, deadline=None)
@given(n=st.integers(1, 30), nb=st.integers(1, 4), seed=st.integers(0, 2**32 - 1), data=st.data())
def test_rows_taken_from_planes_are_the_blocks_rows(n: int, nb: int, seed: int, data: Any) -> None:
    blocks = gguf_blocks.random_blocks(np.random.default_rng(seed), (n, nb), Q.Q6_K)
    ids = np.array(data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=12)), np.int32)
    planes = gguf_blocks.to_planes(mx.array(blocks))
    np.testing.assert_array_equal(np.asarray(gguf_blocks.take_planes(planes, mx.array(ids))), blocks[ids])
    # CUDA_LOOKUP_PLANES_SOURCE's rows: unit j of the output reads unit ids[j / NB] NB + j % NB.
    values = np.concatenate([planes_values(np.asarray(planes), int(i), int(i) + 1) for i in ids])
    want = gguf.quants.dequantize(blocks[ids].reshape(len(ids), -1), Q.Q6_K)
    np.testing.assert_array_equal(values, want)


def test_only_q6k_blocks_have_planes() -> None:
    with pytest.raises(ValueError, match="210 bytes"):
        gguf_blocks.to_planes(mx.zeros((4, 2, 84), mx.uint8))
    x = mx.zeros((1, 1, 256), mx.float16)
    with pytest.raises(ValueError, match="one Q6_K matrix on CUDA"):
        gguf_blocks.matvec(x, mx.zeros((1, 3, 1, 84), mx.uint8), mx.zeros((1,), mx.int32), Q.Q2_K, "cuda",
                           planes=True)


def _pair(n: int, nb: int, seed: int) -> tuple[BlockLinear, BlockLinear]:
    """Two BlockLinear layers of the same Q6_K weights: the file's layout and the planes."""
    blocks = mx.array(gguf_blocks.random_blocks(np.random.default_rng(seed), (n, nb), Q.Q6_K))
    file_layer, planes_layer = BlockLinear(nb * 256, n, Q.Q6_K), BlockLinear(nb * 256, n, Q.Q6_K)
    file_layer.weight = blocks
    planes_layer.weight = gguf_blocks.to_planes(blocks)
    planes_layer.planes = True
    return file_layer, planes_layer


@pytest.mark.parametrize("rows", [1, 3, 40])
def test_a_layer_computes_the_same_from_either_layout(rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode rows and prefill chunks (five chunks of rows, each from its slice of the planes)."""
    monkeypatch.setattr(gguf_layers, "chunk_weights", lambda: 48 * 512)
    file_layer, planes_layer = _pair(230, 2, 5)
    x = mx.array(np.random.default_rng(6).standard_normal((1, rows, 512)).astype(np.float32)).astype(mx.float16)
    np.testing.assert_array_equal(np.asarray(planes_layer(x)), np.asarray(file_layer(x)))
    with kernel_choice.mlx_kernels_only():
        np.testing.assert_array_equal(np.asarray(planes_layer(x)), np.asarray(file_layer(x)))


def test_a_planes_lookup_that_cannot_run_warns_and_the_rows_go_through_blocks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the planes' lookup kernel fails its check (here the CPU: MLX cannot build a CUDA
    kernel), it warns once, naming the fallback, and a prefill chunk reads its rows back into blocks."""
    if gguf_blocks.planes_lookup_ready(mx.float32):
        pytest.skip("the kernel runs here; tested below")
    monkeypatch.setattr(gguf_blocks, "planes_ready", lambda dtype: True)
    gguf_blocks.planes_checks.forget()
    try:
        file_layer, planes_layer = _pair(70, 2, 8)
        x = mx.array(np.random.default_rng(9).standard_normal((12, 512)).astype(np.float32))
        with pytest.warns(RuntimeWarning, match="Q6_K planes is not used: it cannot run here.*the file's block layout"):
            got = np.asarray(planes_layer(x))
        np.testing.assert_array_equal(got, np.asarray(file_layer(x)))
        assert gguf_blocks.planes_checks.known() == {("cuda", "lookup", str(mx.float32)): False}
    finally:
        gguf_blocks.planes_checks.forget()


def _q6k_file(tmp_path: Path, tied: bool = False) -> Path:
    model_dir = write_tiny_model(tmp_path / "hf", "llama", seed=3, hidden_size=256, intermediate_size=512,
                                 num_layers=2, tie_word_embeddings=tied)
    types = {"blk.0.attn_v.weight": Q.Q6_K, "blk.0.ffn_down.weight": Q.Q6_K, "token_embd.weight": Q.Q6_K}
    if not tied:
        types["output.weight"] = Q.Q6_K
    return export_gguf(model_dir, tmp_path / "m.gguf", Q.Q4_K, extra_types=types)


def _weights(model: Any) -> dict[str, np.ndarray]:
    return {name: np.asarray(m.weight) for name, m in model.named_modules()
            if isinstance(m, BlockLinear | BlockEmbedding)}


def _loaded(path: Path, planes: str) -> Any:
    chosen = dataclasses.replace(pymlxc_settings.current(), cuda_q6k_planes=planes)
    return load_weights_and_config(path, settings=chosen)


@pytest.mark.parametrize(("tied", "lookup"), [(False, False), (False, True), (True, True)])
def test_the_loader_rearranges_q6k_layers_and_file_layout_undoes_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tied: bool, lookup: bool) -> None:
    """With the kernels taken as ready at load (this machine may have none), PYMLXC_CUDA_Q6K_PLANES=1
    gives the Q6_K linear layers (value, down, an untied output head) planes, and the token embedding
    too where the lookup kernel is ready (a tied head then reads them). The logits (through MLX ops
    here: the layers trust the load-time checks, so the kernels stay out) are those of the file's
    layout; `file_layout` (before a tensor-parallel split) restores the bytes."""
    monkeypatch.setattr(gguf_blocks, "planes_ready", lambda dtype: True)
    monkeypatch.setattr(gguf_blocks, "planes_lookup_ready", lambda dtype: lookup)
    path = _q6k_file(tmp_path, tied)
    off = _loaded(path, "0")
    on = _loaded(path, "1")
    flags = {name: m.planes for name, m in on.model.named_modules() if isinstance(m, BlockLinear | BlockEmbedding)}
    want_flags = {"model.layers.0.self_attn.v_proj": True, "model.layers.0.mlp.down_proj": True,
                  "model.embed_tokens": lookup}
    if not tied:
        want_flags["lm_head"] = True
    assert flags == want_flags
    assert not any(getattr(m, "planes", False) for _, m in off.model.named_modules())
    ids = mx.array(np.array([[3, 17, 200, 99, 5, 41]], np.int32))
    with kernel_choice.mlx_kernels_only():
        np.testing.assert_array_equal(np.asarray(on.model(ids)), np.asarray(off.model(ids)))
    want = _weights(off.model)
    assert distributed._file_layout(on.model) == sum(want_flags.values())
    got = _weights(on.model)
    assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want)
    assert distributed._file_layout(on.model) == 0
    on.free()
    off.free()


def test_without_the_kernel_nothing_is_rearranged(tmp_path: Path) -> None:
    """On a machine where the planes kernel is not ready (a CPU), the setting's 1 changes nothing."""
    if gguf_blocks.planes_ready(mx.float16):
        pytest.skip("the planes kernel is ready here")
    loaded = _loaded(_q6k_file(tmp_path), "1")
    assert not any(m.planes for _, m in loaded.model.named_modules() if isinstance(m, BlockLinear))
    loaded.free()


def test_a_load_checks_the_kernels_for_its_own_dtype_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The load-time checks compile every template they run (a second or more each on a fresh H100):
    a model that computes in float16 checks the block, planes and lookup kernels for float16 alone,
    each once. (The kernels are taken as passing here and never run: the checks are replaced.)"""
    asked: list[tuple[str, Any]] = []

    def passes(*what: Any) -> None:
        asked.append(what)

    monkeypatch.setattr(gguf_blocks, "device_kind", lambda: "cuda")
    monkeypatch.setattr(gguf_blocks, "_compare", lambda kind, qtype, dtype: passes("blocks", Q(qtype).name, dtype))
    monkeypatch.setattr(gguf_blocks, "_compare_planes", lambda dtype: passes("planes", dtype))
    monkeypatch.setattr(gguf_blocks, "_compare_planes_lookup", lambda dtype: passes("lookup", dtype))
    gguf_blocks.checks.forget()
    gguf_blocks.planes_checks.forget()
    try:
        chosen = dataclasses.replace(pymlxc_settings.current(), cuda_q6k_planes="1")
        loaded = load_weights_and_config(_q6k_file(tmp_path), settings=chosen, dtype="float16")
        assert sorted(asked, key=str) == [("blocks", "Q6_K", mx.float16), ("lookup", mx.float16),
                                          ("planes", mx.float16)]
        assert {key[-1] for key in gguf_blocks.checks.known()} == {str(mx.float16)}
        assert loaded.model.model.embed_tokens.planes  # the lookup kernel's verdict for float16 was used
        loaded.free()
    finally:
        gguf_blocks.checks.forget()  # the replaced checks' verdicts, in this process and the cache
        gguf_blocks.planes_checks.forget()


# ---------------------------------------------------------------------- on CUDA

@cuda_only
# Few shapes: NVRTC compiles each (dtype, rows of x, rows a warp, warps) once, about a second each.
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 300), nb=st.integers(1, 12), m=st.sampled_from([1, 4, 8]), pairs=st.integers(1, 3),
       dtype=st.sampled_from(["float32", "float16", "bfloat16"]), seed=st.integers(0, 1000),
       warps=st.sampled_from([None, 1, 2, 4]), rows=st.sampled_from([None, 1, 2, 4]))
def test_the_planes_kernel_is_the_file_kernel_bit_for_bit(n: int, nb: int, m: int, pairs: int, dtype: str, seed: int,
                                                         warps: int | None, rows: int | None) -> None:
    rng = np.random.default_rng(seed)
    blocks = mx.array(gguf_blocks.random_blocks(rng, (1, n, nb), Q.Q6_K))
    planes = mx.expand_dims(gguf_blocks.to_planes(blocks[0]), 0)
    x = mx.array(rng.standard_normal((pairs, m, nb * 256)).astype(np.float32)).astype(getattr(mx, dtype))
    idx = mx.zeros((pairs,), mx.int32)
    want = gguf_blocks.matvec(x, blocks, idx, Q.Q6_K, "cuda", rows_per_warp=rows, warps=warps)
    got = gguf_blocks.matvec(x, planes, idx, Q.Q6_K, "cuda", rows_per_warp=rows, warps=warps, planes=True)
    np.testing.assert_array_equal(np.asarray(got.astype(mx.float32)), np.asarray(want.astype(mx.float32)))


@cuda_only
@pytest.mark.parametrize("shape", [(512, 8), (2048, 32), (1024, 56)])
def test_the_planes_kernel_at_llama_shapes(shape: tuple[int, int]) -> None:
    """Llama-3.2-1B's value and down projections and a 14336-wide down projection's blocks, one row of x."""
    n, nb = shape
    rng = np.random.default_rng(n)
    blocks = mx.array(gguf_blocks.random_blocks(rng, (1, n, nb), Q.Q6_K))
    planes = mx.expand_dims(gguf_blocks.to_planes(blocks[0]), 0)
    x = mx.array(rng.standard_normal((1, 1, nb * 256)).astype(np.float32)).astype(mx.bfloat16)
    idx = mx.zeros((1,), mx.int32)
    want = gguf_blocks.matvec(x, blocks, idx, Q.Q6_K, "cuda")
    got = gguf_blocks.matvec(x, planes, idx, Q.Q6_K, "cuda", planes=True)
    np.testing.assert_array_equal(np.asarray(got.astype(mx.float32)), np.asarray(want.astype(mx.float32)))


@cuda_only
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 200), nb=st.integers(1, 12), dtype=st.sampled_from(["float32", "float16", "bfloat16"]),
       seed=st.integers(0, 1000), data=st.data())
def test_a_range_of_planes_rows_is_the_blocks_bit_for_bit(n: int, nb: int, dtype: str, seed: int, data: Any) -> None:
    """Rows of planes read by the lookup kernel (a prefill chunk's) against the block kernel on the same rows."""
    assert gguf_blocks.planes_lookup_ready(getattr(mx, dtype))
    blocks = mx.array(gguf_blocks.random_blocks(np.random.default_rng(seed), (n, nb), Q.Q6_K))
    planes = gguf_blocks.to_planes(blocks)
    start = data.draw(st.integers(0, n - 1))
    stop = data.draw(st.integers(start + 1, n))
    want = gguf_blocks.dequantize(blocks[start:stop], Q.Q6_K, getattr(mx, dtype), "cuda")
    got = gguf_blocks.lookup_planes(planes, mx.arange(start, stop, dtype=mx.int32), getattr(mx, dtype))
    np.testing.assert_array_equal(np.asarray(got.astype(mx.float32)), np.asarray(want.astype(mx.float32)))


@cuda_only
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_the_planes_lookup_is_the_blocks_bit_for_bit(dtype: str) -> None:
    """Token rows read from planes (repeats, any order, the last row) against the block kernel."""
    assert gguf_blocks.planes_lookup_ready(getattr(mx, dtype))
    rng = np.random.default_rng(4)
    blocks = mx.array(gguf_blocks.random_blocks(rng, (300, 8), Q.Q6_K))
    ids = mx.array(np.array([299, 0, 7, 7, 123, 299], np.int32))
    want = gguf_blocks.dequantize(mx.take(blocks, ids, axis=0), Q.Q6_K, getattr(mx, dtype), "cuda")
    got = gguf_blocks.lookup_planes(gguf_blocks.to_planes(blocks), ids, getattr(mx, dtype))
    np.testing.assert_array_equal(np.asarray(got.astype(mx.float32)), np.asarray(want.astype(mx.float32)))


@cuda_only
@pytest.mark.parametrize("tied", [False, True])
def test_a_file_decodes_the_same_tokens_with_planes(tmp_path: Path, tied: bool) -> None:
    """On CUDA the loader's default rearranges the Q6_K layers (a tied head's embedding too); greedy
    tokens equal those of the file's layout and of MLX's ops."""
    path = _q6k_file(tmp_path, tied)
    on, off = _loaded(path, "auto"), _loaded(path, "0")
    head = (lambda m: m.model.embed_tokens) if tied else (lambda m: m.lm_head)
    assert head(on.model).planes and not head(off.model).planes
    prompt = [3, 17, 200, 99, 5]
    runs = []
    for loaded in (on, off):
        model = loaded.model
        runs.append(list(loops.generate_ids(model, prompt, cache=model.make_cache(64), sampler=greedy, max_tokens=12)))
    with kernel_choice.mlx_kernels_only():
        model = on.model
        runs.append(list(loops.generate_ids(model, prompt, cache=model.make_cache(64), sampler=greedy, max_tokens=12)))
    assert runs[0] == runs[1] == runs[2] and len(runs[0]) == 12
    on.free()
    off.free()

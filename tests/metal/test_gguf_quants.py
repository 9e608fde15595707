"""GGUF tensor types kept quantized: each type's blocks against the `gguf` package's reference
dequantization (random valid blocks), tiny models of every type and of llama-quantize-like mixed
recipes against a twin checkpoint holding the reference dequantization of the very blocks written,
memory after load against the file's tensor bytes, read-only files, and the MoE architectures.

Tolerances (logits of these tiny random models have a standard deviation near 0.6): the GGUF
models are loaded with dtype="float32", as their float32 twins compute (a quantized file computes in
float16 by default: test_gguf_dtype.py holds that path to the twins), and differ from them only by
summation order and, for Q4_K and Q5_K, their scales rounded to float16 (docs/gguf.md).
"""
from __future__ import annotations

import json
import stat
import threading
import tracemalloc
import warnings
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.constants import GGML_QUANT_SIZES
from hypothesis import given, settings
from hypothesis import strategies as st

import pymlxc
import pymlxc.core as mx
from pymlxc.backends.metal import nn
from pymlxc.backends.metal.formats import gguf_quants
from pymlxc.backends.metal.formats.gguf import GGUFError, gguf_config, read_gguf
from pymlxc.backends.metal.formats.gguf_quants import (
    AFFINE_BITS,
    BLOCK_TYPES,
    EXACT_AFFINE,
    QuantError,
    affine_parts,
    dequantize_blocks,
    pack_bits,
    repack_affine,
)
from pymlxc.backends.metal.gguf_layers import BlockEmbedding, BlockLinear, BlockSwitchLinear
from pymlxc.backends.metal.loader import load_weights_and_config
from pymlxc.backends.metal.models.switch_layers import QuantizedSwitchLinear
from pymlxc.testing import write_tiny_model
from pymlxc.testing_gguf import encode_k

from .gguf_export import export_gguf

IDS = [[3, 17, 260, 99, 5, 301, 42, 8, 150, 77, 2, 400]]
QUANT_TYPES = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)
# Logit tolerances against the twin, by how the type is kept (measured maxima: 0.002, 0.004, 0.011).
ATOL = {**dict.fromkeys(BLOCK_TYPES, 0.01), **dict.fromkeys(EXACT_AFFINE, 0.015), Q.Q4_K: 0.03, Q.Q5_K: 0.03}
MEMORY_BOUND = 1.12  # loaded bytes / the file's tensor bytes
F16_FIELDS = {  # byte offsets of the float16 fields (d, dmin / m) in each block
    Q.Q4_0: (0,), Q.Q5_0: (0,), Q.Q8_0: (0,), Q.Q4_1: (0, 2), Q.Q5_1: (0, 2), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2),
    Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q6_K: (208,)}


@pytest.fixture(autouse=True)
def _quiet() -> None:
    warnings.simplefilter("ignore", DeprecationWarning)


def random_blocks(qtype: Q, n: int, seed: int, exponent: int) -> np.ndarray:
    """n valid blocks: random bytes, with finite float16 scales of magnitude about 2^exponent."""
    rng = np.random.default_rng(seed)
    _, size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (n, size), dtype=np.uint8)
    for at in F16_FIELDS[qtype]:
        d = rng.uniform(0.5, 1.0, n) * 2.0**exponent * rng.choice([-1.0, 1.0], n)
        blocks[:, at:at + 2] = d.astype(np.float16).reshape(n, 1).view(np.uint8)
    return blocks


# ---------------------------------------------------------------------- per type, per block

@settings(max_examples=60, deadline=None)
@given(qtype=st.sampled_from(sorted(AFFINE_BITS)), seed=st.integers(0, 2**32 - 1), exponent=st.integers(-24, 1),
       rows=st.integers(1, 3), blocks_per_row=st.integers(1, 3))
def test_affine_repack_against_the_reference(qtype: Q, seed: int, exponent: int, rows: int,
                                             blocks_per_row: int) -> None:
    """Legacy types bit-exact; Q4_K/Q5_K within the float16 rounding of their scales and biases:
    |w' - w| <= (2^-11 + 2^-22)(|scale| q + |bias|) + 2^-25 (q + 1)."""
    _, size = GGML_QUANT_SIZES[qtype]
    data = random_blocks(qtype, rows * blocks_per_row, seed, exponent).reshape(rows, blocks_per_row * size)
    ref = gguf.quants.dequantize(data, qtype)
    packed, scales, biases = repack_affine(data, qtype, "t")
    assert scales.dtype == biases.dtype == np.float16 and scales.shape[-1] == ref.shape[-1] // 32
    got = np.array(mx.dequantize(mx.array(packed), mx.array(scales.astype(np.float32)),
                                 mx.array(biases.astype(np.float32)), 32, AFFINE_BITS[qtype]))
    if qtype in EXACT_AFFINE:
        np.testing.assert_array_equal(got, ref)
        return
    q, s, b = affine_parts(data.reshape(-1, size), qtype)
    q = q.reshape(rows, -1, 32).astype(np.float64)
    s, b = np.abs(s.reshape(rows, -1, 1)).astype(np.float64), np.abs(b.reshape(rows, -1, 1)).astype(np.float64)
    bound = (2.0**-11 + 2.0**-22) * (s * q + b) + 2.0**-25 * (q + 1)
    assert np.all(np.abs(got.reshape(rows, -1, 32) - ref.reshape(rows, -1, 32)) <= bound)


@settings(max_examples=40, deadline=None)
@given(qtype=st.sampled_from(BLOCK_TYPES), seed=st.integers(0, 2**32 - 1), exponent=st.integers(-20, 1),
       lead=st.sampled_from([(1,), (3,), (2, 2)]), blocks_per_row=st.integers(1, 3))
def test_block_dequantization_is_the_reference(qtype: Q, seed: int, exponent: int, lead: tuple[int, ...],
                                               blocks_per_row: int) -> None:
    _, size = GGML_QUANT_SIZES[qtype]
    n = int(np.prod(lead)) * blocks_per_row
    data = random_blocks(qtype, n, seed, exponent)
    ref = gguf.quants.dequantize(data.reshape(*lead, blocks_per_row * size), qtype)
    got = np.array(dequantize_blocks(mx.array(data.reshape(*lead, blocks_per_row, size)), qtype))
    np.testing.assert_array_equal(got, ref)


def test_a_scale_float16_cannot_hold_is_an_error() -> None:
    data = random_blocks(Q.Q8_0, 4, 0, 0)
    data[2, :2] = np.array([1000.0], np.float16).view(np.uint8)  # bias -128 d = -128000
    with pytest.raises(QuantError, match=r"tensor 'blk\.0\.x\.weight' \(Q8_0\): row 2, group 0 .*float16"):
        repack_affine(data, Q.Q8_0, "blk.0.x.weight")


# ---------------------------------------------------------------------- parallel conversion

PARALLEL_TYPES = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K)


def _small_chunks(monkeypatch: pytest.MonkeyPatch, weights: int) -> None:
    """Chunks of `weights` weights at most (and no floor), so that small tensors split into several."""
    monkeypatch.setattr(gguf_quants, "_MIN_CHUNK_WEIGHTS", 1)
    monkeypatch.setattr(gguf_quants, "_CHUNK_WEIGHTS", weights)


def _written(qtype: Q, rows: int, cols: int, seed: int) -> np.ndarray:
    """Rows of blocks as the `gguf` package (legacy types) or the test writer (K-quants) encode them."""
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    return encode_k(w, qtype) if qtype in (Q.Q4_K, Q.Q5_K) else gguf.quants.quantize(w, qtype)


def _stream_packed(q: np.ndarray, bits: int) -> np.ndarray:
    """MLX's packing spelled out: each value's bits, low first, one stream per row, read as uint32."""
    stream = ((q[..., None] >> np.arange(bits, dtype=np.uint8)) & 1).reshape(q.shape[0], -1)
    return np.packbits(stream, axis=-1, bitorder="little").view("<u4")


@pytest.mark.parametrize("bits", [4, 5, 8])
def test_pack_bits_is_the_bit_stream(bits: int) -> None:
    q = np.random.default_rng(bits).integers(0, 1 << bits, (5, 96), dtype=np.uint8)
    np.testing.assert_array_equal(pack_bits(q, bits), _stream_packed(q, bits))


@pytest.mark.parametrize("qtype", PARALLEL_TYPES, ids=lambda q: q.name)
def test_parallel_repack_is_bit_identical_to_serial(qtype: Q, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks repacked on a pool, 19 rows each (the last one 15: 300 is no multiple), give the bits
    of one serial pass; so does a row order taken chunk by chunk against the rows copied first."""
    data = _written(qtype, 300, 512, seed=int(qtype))
    serial = repack_affine(data, qtype, "t")  # 300 x 512 weights: one chunk by default
    order = np.random.default_rng(1).permutation(300)
    reordered = repack_affine(np.ascontiguousarray(data[order]), qtype, "t")
    _small_chunks(monkeypatch, 32 * 512)
    threads: set[str] = set()
    parts = gguf_quants.affine_parts

    def recorded(*args: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        threads.add(threading.current_thread().name)
        return parts(*args)

    monkeypatch.setattr(gguf_quants, "affine_parts", recorded)
    with ThreadPoolExecutor(max_workers=4, thread_name_prefix="chunks") as pool:
        parallel = repack_affine(data, qtype, "t", pool=pool)
        parallel_reordered = repack_affine(data, qtype, "t", rows=order, pool=pool)
    assert threads and all(t.startswith("chunks") for t in threads), threads  # the pool did the chunks
    for got, want in ((parallel, serial), (parallel_reordered, reordered)):
        for g, w in zip(got, want, strict=True):
            assert g.dtype == w.dtype and g.shape == w.shape
            assert g.tobytes() == w.tobytes()
    # Not equal by construction: the row order changes the result.
    assert parallel_reordered[0].tobytes() != parallel[0].tobytes()


def test_the_first_corrupt_block_in_row_order_is_named_whatever_the_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Several chunks corrupt, each at once on the pool: the error is the one a serial pass raises
    (the first bad row and group), also through a row order."""
    data = _written(Q.Q8_0, 300, 256, seed=5)  # 8 blocks of 34 bytes a row
    for row, block in ((250, 6), (97, 3), (98, 1), (40, 7)):
        data[row, block * 34:block * 34 + 2] = np.array([30000.0], np.float16).view(np.uint8)
    with pytest.raises(QuantError) as serial:
        repack_affine(data, Q.Q8_0, "blk.3.ffn_up.weight")
    assert "row 40, group 7" in str(serial.value)
    order = np.arange(300)[::-1].copy()  # row 250 comes first: row 49 of the result
    _small_chunks(monkeypatch, 16 * 256)
    with ThreadPoolExecutor(max_workers=4) as pool:
        for _ in range(5):  # whichever chunk finishes first
            with pytest.raises(QuantError) as parallel:
                repack_affine(data, Q.Q8_0, "blk.3.ffn_up.weight", pool=pool)
            assert str(parallel.value) == str(serial.value)
            with pytest.raises(QuantError, match=r"tensor 'blk\.3\.ffn_up\.weight' \(Q8_0\): row 49, group 6 "):
                repack_affine(data, Q.Q8_0, "blk.3.ffn_up.weight", rows=order, pool=pool)


def test_a_file_converted_in_parallel_loads_the_serial_arrays(tiny: Callable[[str], Path], tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A whole file (Llama's q/k rows re-ordered, every repacked type beside Q6_K blocks): the pool's
    arrays, each tensor in several chunks, are the arrays of a serial read."""
    from pymlxc.backends.metal.formats import gguf_tensors

    extra = {"blk.0.attn_q.weight": Q.Q4_1, "blk.0.attn_k.weight": Q.Q5_0, "blk.1.attn_q.weight": Q.Q5_1,
             "blk.1.attn_k.weight": Q.Q8_0, "blk.0.ffn_up.weight": Q.Q4_K, "blk.1.ffn_down.weight": Q.Q5_K,
             "blk.0.ffn_gate.weight": Q.Q6_K}
    path, _ = export(tiny("llama"), tmp_path, Q.Q4_0, extra)
    reader = read_gguf(path)
    config = gguf_config(reader)

    def arrays(workers: int) -> dict[str, bytes]:
        monkeypatch.setattr(gguf_tensors, "convert_workers", lambda: workers)
        weights = gguf_tensors.read_tensors(reader, "llama", config, mx.float32)
        return {k: np.array(v).tobytes() for k, v in weights.arrays.items()}

    serial = arrays(1)
    _small_chunks(monkeypatch, 12 * 256)  # 256 inputs a row: 12 rows a chunk, a 256-row matrix ends with 4
    assert arrays(4) == serial


def test_a_corrupt_tensor_is_named_before_later_ones_converted_at_once(tiny: Callable[[str], Path], tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Two corrupt tensors one after the other, the second's chunks queued while the first is
    finished: the error names the first, and its row in the loaded (q rows un-permuted) order."""
    from pymlxc.backends.metal.formats import gguf_tensors

    path, _ = export(tiny("llama"), tmp_path, Q.Q8_0)
    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    names = [t.name for t in reader.tensors]
    first = "blk.0.attn_q.weight"
    later = names[names.index(first) + 1]
    assert tensors[later].tensor_type == Q.Q8_0 and len(tensors[later].shape) == 2, later
    data = bytearray(path.read_bytes())
    spots = {first: (200, 5), later: (3, 0)}  # (file row, block)
    for name, (row, block) in spots.items():
        t = tensors[name]
        at = int(t.data_offset) + row * int(t.n_bytes) // int(t.shape[1]) + block * 34
        data[at:at + 2] = np.array([30000.0], np.float16).tobytes()
    del reader, tensors
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    heads = json.loads((tiny("llama") / "config.json").read_text())["num_attention_heads"]
    loaded_row = int(np.argsort(gguf_tensors.unpermute_order(256, heads))[200])
    assert loaded_row != 200
    monkeypatch.setattr(gguf_tensors, "convert_workers", lambda: 4)
    _small_chunks(monkeypatch, 16 * 256)
    for _ in range(3):
        with pytest.raises(GGUFError, match=rf"{bad}: tensor 'blk\.0\.attn_q\.weight' \(Q8_0\): "
                                            rf"row {loaded_row}, group 5 "):
            load_weights_and_config(bad)


# ---------------------------------------------------------------------- tiny models

def tiny_dims(arch: str) -> dict[str, object]:
    """Widths that are multiples of the K-quants' 256-value super-blocks."""
    extra: dict[str, object] = {}
    if arch.endswith("_moe") or arch == "gemma4":
        extra["moe_intermediate_size"] = 256
    if arch == "qwen2_moe":
        extra["shared_expert_intermediate_size"] = 256
    return {"hidden_size": 256, "intermediate_size": 256, "extra_config": extra or None}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    root = tmp_path_factory.mktemp("tiny256")
    cache: dict[str, Path] = {}

    def make(arch: str) -> Path:
        if arch not in cache:
            cache[arch] = write_tiny_model(root / arch, arch, seed=3, **tiny_dims(arch))  # type: ignore[arg-type]
        return cache[arch]

    return make


def export(src: Path, root: Path, qtype: Q, extra: Mapping[str, Q] | None = None) -> tuple[Path, Path]:
    """(the GGUF file alone in a folder, its twin checkpoint of reference-dequantized weights)."""
    (root / "gguf").mkdir(parents=True)
    return export_gguf(src, root / "gguf" / "m.gguf", qtype, extra_types=extra, twin=root / "twin"), root / "twin"


def logits_and_model(path: Path, ids: list[list[int]] = IDS,
                     dtype: str = "float32") -> tuple[np.ndarray, dict[str, type], float]:
    """Logits of `ids` computed in `dtype`, the type of each layer by module path, and loaded bytes /
    file tensor bytes as loaded by default (dtype "auto": an asked-for float32 widens F16 tensors)."""
    with load_weights_and_config(path, dtype=dtype) as loaded:
        out = np.array(loaded.model(mx.array(ids)).astype(mx.float32))
        kinds = {p: type(m) for p, m in loaded.model.named_modules()}
    ratio = 0.0
    if path.suffix == ".gguf":
        with load_weights_and_config(path) as loaded:
            ratio = loaded.nbytes / sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)
    return out, kinds, ratio


def _expected_kind(qtype: Q) -> type:
    return BlockLinear if qtype in BLOCK_TYPES else nn.QuantizedLinear


@pytest.mark.parametrize("qtype", QUANT_TYPES)
def test_every_type_loads_quantized_with_the_reference_logits(qtype: Q, tiny: Callable[[str], Path],
                                                             tmp_path: Path) -> None:
    path, twin = export(tiny("llama"), tmp_path, qtype)
    got, kinds, ratio = logits_and_model(path)
    want, _, _ = logits_and_model(twin)
    np.testing.assert_allclose(got, want, atol=ATOL[qtype], rtol=0)
    for module in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj", "lm_head"):
        assert kinds[module] is _expected_kind(qtype), module
    assert kinds["model.embed_tokens"] is (BlockEmbedding if qtype in BLOCK_TYPES else nn.QuantizedEmbedding)
    assert ratio <= (1.0 + 1e-3 if qtype in BLOCK_TYPES else MEMORY_BOUND), ratio
    if qtype in AFFINE_BITS:
        with load_weights_and_config(path) as loaded:
            layer = loaded.model.layers[0].self_attn.q_proj
            assert (layer.bits, layer.group_size, layer.scales.dtype) == (AFFINE_BITS[qtype], 32, mx.float16)


def _recipe(main: Q, layers: int, **overrides: Q) -> dict[str, Q]:
    """Per-tensor types in the manner of llama-quantize's mixes: the output and embedding in Q6_K,
    attn_v and ffn_down of some layers one step up."""
    out = {"output.weight": Q.Q6_K, "token_embd.weight": overrides.pop("embd", main)}
    for i in range(layers):
        if i % 2 == 0:
            out[f"blk.{i}.attn_v.weight"] = overrides.get("up", Q.Q6_K)
            out[f"blk.{i}.ffn_down.weight"] = overrides.get("up", Q.Q6_K)
    return out


@pytest.mark.parametrize("arch,main,extra", [
    ("llama", Q.Q4_K, {"up": Q.Q6_K}),        # Q4_K_M
    ("llama", Q.Q3_K, {"up": Q.Q5_K}),        # Q3_K_L
    ("qwen2", Q.Q2_K, {"up": Q.Q4_K}),        # Q2_K (attention in Q3_K/Q4_K)
    ("gemma3", Q.Q5_K, {"up": Q.Q6_K}),       # Q5_K_M
    ("qwen3", Q.Q4_0, {"embd": Q.Q6_K}),      # llama.cpp's default Q4_0: a tied Q6_K embedding
    ("gemma2", Q.Q5_1, {"up": Q.Q8_0}),
])
def test_mixed_recipes(arch: str, main: Q, extra: dict[str, Q], tiny: Callable[[str], Path], tmp_path: Path) -> None:
    src = tiny(arch)
    types = _recipe(main, 2, **dict(extra))
    if arch in ("qwen3", "gemma3", "gemma2"):
        types.pop("output.weight")  # tied: the embedding is the output head
    path, twin = export(src, tmp_path, main, types)
    got, kinds, ratio = logits_and_model(path)
    want, _, _ = logits_and_model(twin)
    np.testing.assert_allclose(got, want, atol=max(ATOL[t] for t in (main, *types.values())), rtol=0)
    assert ratio <= MEMORY_BOUND, ratio
    assert kinds["model.layers.0.mlp.down_proj"] is _expected_kind(types["blk.0.ffn_down.weight"])
    assert kinds["model.layers.1.mlp.down_proj"] is _expected_kind(main)
    with pymlxc.load_model(str(path), backend="metal") as model:
        assert len(list(model.generate("Once upon a time", max_tokens=6))) == 6


# ---------------------------------------------------------------------- architectures

def _f32_round_trip(src: Path, tmp_path: Path, atol: float) -> tuple[Path, dict[str, Any], dict[str, Any]]:
    """`src` exported as an F32 GGUF file, whose logits match the source's within `atol`; with the
    config read from the file and the source's config.json (its text_config where it has one)."""
    path, _ = export(src, tmp_path / "f32", Q.F32)
    got, _, _ = logits_and_model(path)
    want, _, _ = logits_and_model(src)
    np.testing.assert_allclose(got, want, atol=atol, rtol=0)
    original = json.loads((src / "config.json").read_text())
    return path, gguf_config(read_gguf(path)), original.get("text_config", original)


@pytest.mark.parametrize("arch", ["qwen2_moe", "qwen3_moe"])
def test_moe_from_metadata(arch: str, tiny: Callable[[str], Path], tmp_path: Path) -> None:
    src = tiny(arch)
    path, config, original = _f32_round_trip(src, tmp_path, atol=1e-4)
    for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "mlp_only_layers",
                "shared_expert_intermediate_size"):
        if key in original:
            assert config[key] == original[key], key
    # Experts in Q4_K with the down projections in Q6_K (as Q4_K_M makes them).
    path, twin = export(src, tmp_path / "q", Q.Q4_K, {"blk.0.ffn_down_exps.weight": Q.Q6_K})
    got, kinds, ratio = logits_and_model(path)
    want, _, _ = logits_and_model(twin)
    np.testing.assert_allclose(got, want, atol=ATOL[Q.Q4_K], rtol=0)
    assert kinds["model.layers.0.mlp.switch_mlp.gate_proj"] is QuantizedSwitchLinear
    assert kinds["model.layers.0.mlp.switch_mlp.down_proj"] is BlockSwitchLinear
    assert ratio <= MEMORY_BOUND
    # One token picks fewer experts than there are: only those are dequantized (the decoding path).
    one = [IDS[0][:1]]
    np.testing.assert_allclose(logits_and_model(path, one)[0], logits_and_model(twin, one)[0],
                               atol=ATOL[Q.Q4_K], rtol=0)


# Gemma 4's per-layer inputs are 16 wide (the per-layer projection's inputs) and 4 * 16 (the table):
# no K-quant block fits them, as llama-quantize would also find.
GEMMA4_NARROW = {"per_layer_token_embd.weight": Q.Q8_0, **{f"blk.{i}.proj.weight": Q.F16 for i in range(4)}}


@pytest.mark.parametrize("arch", ["gemma4_text", "gemma4"])
def test_gemma4_from_metadata(arch: str, tiny: Callable[[str], Path], tmp_path: Path) -> None:
    """gemma4_text: per-layer inputs, shared-KV layers, the double-wide MLP; gemma4: the MoE block
    beside the MLP, K = V full layers with their own kv heads, the vision tower dropped."""
    src = tiny(arch)
    path, config, original = _f32_round_trip(src, tmp_path, atol=1e-5)
    for key in ("layer_types", "head_dim", "global_head_dim", "num_key_value_heads", "num_kv_shared_layers",
                "hidden_size_per_layer_input", "use_double_wide_mlp", "attention_k_eq_v", "enable_moe_block",
                "sliding_window", "final_logit_softcapping"):
        if key == "use_double_wide_mlp" and not original["num_kv_shared_layers"]:
            continue  # no shared-KV layer to widen: the file cannot tell
        assert config[key] == original[key], key
    assert config["rope_parameters"]["full_attention"]["partial_rotary_factor"] == 0.25
    if original["enable_moe_block"]:
        assert (config["num_experts"], config["top_k_experts"]) == (original["num_experts"], original["top_k_experts"])
        assert config["num_global_key_value_heads"] == original["num_global_key_value_heads"]
    types = {**GEMMA4_NARROW, "blk.0.ffn_down_exps.weight": Q.Q6_K, "blk.1.ffn_gate_up_exps.weight": Q.Q5_K,
             "blk.0.attn_q.weight": Q.Q3_K}
    path, twin = export(src, tmp_path / "q", Q.Q4_K, types)
    got, kinds, ratio = logits_and_model(path)
    want, _, _ = logits_and_model(twin)
    np.testing.assert_allclose(got, want, atol=ATOL[Q.Q4_K], rtol=0)
    assert kinds["model.layers.0.self_attn.q_proj"] is BlockLinear
    assert kinds["model.layers.1.self_attn.q_proj"] is nn.QuantizedLinear
    if original["enable_moe_block"]:
        assert kinds["model.layers.0.experts.switch_glu.down_proj"] is BlockSwitchLinear
        assert kinds["model.layers.1.experts.switch_glu.gate_proj"] is QuantizedSwitchLinear
        one = [IDS[0][:1]]  # fewer picks than experts
        np.testing.assert_allclose(logits_and_model(path, one)[0], logits_and_model(twin, one)[0],
                                   atol=ATOL[Q.Q4_K], rtol=0)
    assert ratio <= MEMORY_BOUND, ratio


# ---------------------------------------------------------------------- files

def _mappings(path: Path) -> list[str]:
    real = str(path.resolve())
    with open("/proc/self/maps", encoding="utf-8") as f:
        return [line.split()[1] for line in f if line.rstrip().endswith(real)]


def test_read_only_file_loads_and_is_mapped_read_only(tiny: Callable[[str], Path], tmp_path: Path) -> None:
    path, _ = export(tiny("qwen3"), tmp_path, Q.Q4_K)
    path.chmod(stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)  # 0o444, a shared model folder
    reader = read_gguf(path)
    assert not reader.data.flags.writeable
    perms = _mappings(path)
    assert perms and all("w" not in p for p in perms), perms  # root ignores 0o444; the mapping says it all
    del reader
    with pymlxc.load_model(str(path), backend="metal") as model:
        assert len(list(model.generate("hi", max_tokens=3))) == 3
        assert all("w" not in p for p in _mappings(path))


@pytest.mark.parametrize("qtype", [Q.IQ2_XXS, Q.TQ1_0, Q.MXFP4])
def test_other_types_are_refused_by_name_with_a_recipe(qtype: Q, tiny: Callable[[str], Path], tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    block, size = GGML_QUANT_SIZES[qtype]
    w.add_tensor("blk.0.attn_q.weight", np.zeros((8, 256 // block * size), np.uint8), raw_dtype=qtype)
    w.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    for step in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        step()
    with pytest.raises(GGUFError, match=rf"blk\.0\.attn_q\.weight \({qtype.name}\).*Q4_K_M"):
        read_gguf(path)


def test_overflowing_scale_in_a_file_names_file_and_tensor(tiny: Callable[[str], Path], tmp_path: Path) -> None:
    path, _ = export(tiny("llama"), tmp_path, Q.Q8_0)
    reader = gguf.GGUFReader(path)
    t = next(t for t in reader.tensors if t.name == "blk.1.ffn_up.weight")
    data = bytearray(path.read_bytes())
    data[t.data_offset:t.data_offset + 2] = np.array([30000.0], np.float16).tobytes()
    del reader
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match=rf"{bad}: tensor 'blk\.1\.ffn_up\.weight' \(Q8_0\).*float16"):
        load_weights_and_config(bad)


def test_loading_streams_tensor_by_tensor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Python-side memory while loading stays a fraction of the file (each tensor converted in
    chunks from the read-only map, then freed), and MLX's peak is the loaded model's size."""
    from pymlxc.backends.metal.formats import gguf_quants

    monkeypatch.setattr(gguf_quants, "_CHUNK_WEIGHTS", 1 << 16)
    src = write_tiny_model(tmp_path / "src", "llama", seed=1, hidden_size=512, intermediate_size=2048, num_layers=4,
                           num_heads=8, num_kv_heads=4)
    path, _ = export(src, tmp_path / "m", Q.Q8_0, {f"blk.{i}.ffn_down.weight": Q.Q4_K for i in range(4)}
                     | {f"blk.{i}.ffn_up.weight": Q.Q6_K for i in range(4)})
    file_bytes = sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)
    mx.clear_cache()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    tracemalloc.start()
    try:
        with load_weights_and_config(path) as loaded:
            _, python_peak = tracemalloc.get_traced_memory()
            mlx_peak = mx.get_peak_memory() - before
            assert loaded.nbytes <= MEMORY_BOUND * file_bytes
    finally:
        tracemalloc.stop()
    assert python_peak < 0.25 * file_bytes, (python_peak, file_bytes)
    assert mlx_peak < 1.25 * file_bytes, (mlx_peak, file_bytes)

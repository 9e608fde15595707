"""The dtype GGUF models compute in (`gguf_tensors.compute_dtype`) and `LoadConfig.dtype`.

Quantized files of the llama and qwen families compute in float16 by default on a GPU (llama.cpp's F32
norms, biases and routers cast at load; the tests take a GPU's default wherever they run) and in float32
on a CPU, Gemma's quantized files and F32 files in float32, F16/BF16 files in their type; `dtype` asks
for another. Tiny models of every type against their twin checkpoints
(the reference dequantization of the very blocks written, tests/metal/gguf_export.py):

- computed in float16, within TOL16 of the float32 twin beyond the type's own float32 tolerance
  (test_gguf_quants.ATOL), and within 2 TOL16 of the twin computed in float16; with
  TOL16 = u sqrt(K) (L + 1) max|logit|: float16's unit roundoff u = 2^-11, grown as a random walk
  over the K-term sums (K the hidden width) of each of the L blocks and the head, relative to the
  largest logit. (Measured on the CPU: 0.03 against a bound near 0.085; MLX's CPU quantized_matmul
  rounds in float16, so the GGUF side is the noisier one, 0.006 for the dense float16 twin.)
- greedy tokens equal to the twin's computed in the same dtype, float16 and float32.

Also: the segmented decode of a model with a Q6_K (uint8 blocks) embedding hands the RoPE kernel's
check the compute dtype, and the 4-bit matvec kernel takes the repacked Q4_0/Q4_K layers in float16.
"""
from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import load_file, save_file

import pymlxc
import pymlxc.core as mx
from pymlxc.backends.metal import generate as loops
from pymlxc.backends.metal import kernel_choice, nn
from pymlxc.backends.metal.decode import segments
from pymlxc.backends.metal.formats import gguf as gguf_format
from pymlxc.backends.metal.formats.gguf import GGUFError
from pymlxc.backends.metal.formats.gguf_quants import AFFINE_BITS
from pymlxc.backends.metal.formats.gguf_tensors import FLOAT16_MAX, TensorError, _Cast
from pymlxc.backends.metal.gguf_layers import BlockEmbedding, BlockLinear
from pymlxc.backends.metal.kernels import argmax as argmax_kernel
from pymlxc.backends.metal.kernels import rope_kv as rope_kv_kernel
from pymlxc.backends.metal.loader import load_weights_and_config
from pymlxc.backends.metal.sample import greedy
from pymlxc.options import LoadConfig
from pymlxc.registry import get as get_backend
from pymlxc.testing import write_tiny_model

from .cuda_decode_helpers import stood_in_decoder
from .gguf_export import export_gguf
from .test_gguf_quants import ATOL, IDS, QUANT_TYPES, tiny_dims

U16 = 2.0**-11  # float16's unit roundoff
U_BF16 = 2.0**-8


@pytest.fixture(autouse=True)
def _quiet() -> None:
    warnings.simplefilter("ignore", DeprecationWarning)


HALF_PRECISION_IS_FAST = gguf_format.half_precision_is_fast  # this device's own answer


@pytest.fixture(autouse=True)
def _a_gpus_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """The defaults a GPU chooses (float16 for quantized llama/qwen files), whatever runs the tests:
    `test_a_cpu_computes_quantized_files_in_float32` puts the device's own answer back."""
    monkeypatch.setattr(gguf_format, "half_precision_is_fast", lambda: True)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., tuple[Path, Path]]:
    """files(arch, qtype, extra) -> (the GGUF file alone in a folder, its twin checkpoint), cached."""
    root = tmp_path_factory.mktemp("dtype")
    sources: dict[str, Path] = {}
    cache: dict[tuple[Any, ...], tuple[Path, Path]] = {}

    def make(arch: str, qtype: Q, extra: Mapping[str, Q] | None = None) -> tuple[Path, Path]:
        key = (arch, qtype, tuple(sorted((extra or {}).items())))
        if key not in cache:
            if arch not in sources:
                sources[arch] = write_tiny_model(root / "src" / arch, arch, seed=3, **tiny_dims(arch))  # type: ignore[arg-type]
            folder = root / f"{arch}-{qtype.name}-{len(cache)}"
            (folder / "gguf").mkdir(parents=True)
            path = export_gguf(sources[arch], folder / "gguf" / "m.gguf", qtype, extra_types=extra,
                               twin=folder / "twin")
            cache[key] = path, folder / "twin"
        return cache[key]

    return make


def run(path: Path, dtype: str, tokens: int = 8) -> tuple[np.ndarray, list[int], Any, int, int]:
    """(logits of IDS as float32, greedy ids after IDS, compute dtype, layers, hidden width)."""
    with load_weights_and_config(path, dtype=dtype) as loaded:
        model = loaded.model
        out = model(mx.array(IDS))
        assert out.dtype == model.compute_dtype
        ids = list(loops.generate_ids(model, IDS[0], cache=model.make_cache(None), max_tokens=tokens, sampler=greedy))
        return (np.array(out.astype(mx.float32)), ids, model.compute_dtype, model.args.num_hidden_layers,
                model.args.hidden_size)


def tol16(reference: np.ndarray, layers: int, width: int, u: float = U16) -> float:
    return u * width**0.5 * (layers + 1) * float(np.abs(reference).max())


# ---------------------------------------------------------------------- which dtype

@pytest.mark.parametrize("arch,qtype,extra,want", [
    ("llama", Q.F32, None, mx.float32),
    ("llama", Q.F16, None, mx.float16),
    ("llama", Q.BF16, None, mx.bfloat16),
    ("llama", Q.Q4_0, {"token_embd.weight": Q.Q6_K, "output.weight": Q.Q6_K}, mx.float16),  # llama.cpp's Q4_0
    ("qwen2", Q.Q4_K, {"output.weight": Q.F32}, mx.float16),  # F32 biases and an F32 head, cast
    ("qwen3_moe", Q.Q4_K, None, mx.float16),
    ("gemma3", Q.Q4_0, None, mx.float32),  # Gemma's activations outgrow float16
    ("llama", Q.Q4_0, {"blk.0.ffn_down.weight": Q.BF16}, mx.float32),  # a BF16 matrix: no float16 by default
])
def test_the_compute_dtype_of_each_kind_of_file(arch: str, qtype: Q, extra: dict[str, Q] | None, want: Any,
                                                files: Callable[..., tuple[Path, Path]]) -> None:
    path, _ = files(arch, qtype, extra)
    with load_weights_and_config(path) as loaded:
        model = loaded.model
        assert model.compute_dtype == want
        assert model(mx.array(IDS)).dtype == want
        for name, value in model.parameters().items():
            if not value.dtype.is_floating:
                continue
            if name.endswith((".scales", ".biases")):
                assert value.dtype == mx.float16, name  # exact for the legacy types, whatever the compute dtype
            elif want.size == 2 or value.ndim == 1:
                assert value.dtype == want, name  # norms, biases, F32 matrices: all in the compute dtype
            else:
                assert value.dtype in (mx.float32, mx.bfloat16), name  # half-precision matrices are not widened


def test_a_cpu_computes_quantized_files_in_float32(files: Callable[..., tuple[Path, Path]],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the default device is a CPU (MLX computes float16 element by element there), a quantized
    llama file computes in float32 by default, with the float32 twin's logits; float16 stays an
    option. On a GPU the default is float16."""
    path, twin = files("llama", Q.Q4_0, {"token_embd.weight": Q.Q6_K, "output.weight": Q.Q6_K})
    monkeypatch.setattr(gguf_format, "half_precision_is_fast", HALF_PRECISION_IS_FAST)
    on_gpu = mx.default_device().type == "gpu"
    assert gguf_format.half_precision_is_fast() == on_gpu
    got, ids, dtype, _, _ = run(path, "auto")
    assert dtype == (mx.float16 if on_gpu else mx.float32)
    if not on_gpu:
        want, twin_ids, _, _, _ = run(twin, "float32")
        np.testing.assert_allclose(got, want, atol=ATOL[Q.Q4_0], rtol=0)
        assert ids == twin_ids
    assert run(path, "float16")[2] == mx.float16


@pytest.mark.parametrize("qtype", QUANT_TYPES)
def test_float16_compute_against_the_twin(qtype: Q, files: Callable[..., tuple[Path, Path]]) -> None:
    path, twin = files("llama", qtype)
    g16, ids16, dtype, layers, width = run(path, "auto")
    assert dtype == mx.float16
    t16, twin16, _, _, _ = run(twin, "float16")
    t32, twin32, _, _, _ = run(twin, "float32")
    g32, ids32, _, _, _ = run(path, "float32")
    bound = tol16(t32, layers, width)
    assert np.isfinite(g16).all()
    np.testing.assert_allclose(g16, t32, atol=ATOL[qtype] + bound, rtol=0)
    np.testing.assert_allclose(g16, t16, atol=2 * bound, rtol=0)
    np.testing.assert_allclose(g32, t32, atol=ATOL[qtype], rtol=0)
    assert ids16 == twin16
    assert ids32 == twin32


def check_greedy(ids: list[int], twin_ids: list[int], twin: Path, dtype: str, tol: float,
                 prompt: list[int] = IDS[0]) -> None:
    """The same greedy tokens, except where the twin's own logits at a step rank its pick and the
    GGUF model's within `tol` of each other (a tie that rounding decides; the sequences part there)."""
    for i, (a, b) in enumerate(zip(ids, twin_ids, strict=False)):
        if a != b:
            with load_weights_and_config(twin, dtype=dtype) as loaded:
                last = loaded.model(mx.array([prompt + twin_ids[:i]]))[0, -1].astype(mx.float32)
                margin = float(last[b].item()) - float(last[a].item())
            assert 0 <= margin <= tol, f"step {i}: {a} against the twin's {b}, {margin} apart"
            return
    assert len(ids) == len(twin_ids)


def test_the_default_q4_0_recipe_decodes_like_its_twin(files: Callable[..., tuple[Path, Path]]) -> None:
    """llama.cpp's Q4_0 recipe (Q6_K embedding and head, block layers) in float16 and float32, 16
    tokens (on these tiny random models, ties within float16's tolerance come up by then)."""
    path, twin = files("llama", Q.Q4_0, {"token_embd.weight": Q.Q6_K, "output.weight": Q.Q6_K})
    for dtype in ("float16", "float32"):
        got, ids, _, layers, width = run(path, "auto" if dtype == "float16" else dtype, tokens=16)
        want, twin_ids, _, _, _ = run(twin, dtype, tokens=16)
        tol = 2 * tol16(want, layers, width) if dtype == "float16" else ATOL[Q.Q4_0]
        np.testing.assert_allclose(got, want, atol=tol, rtol=0)
        assert ids[:8] == twin_ids[:8], dtype
        check_greedy(ids, twin_ids, twin, dtype, tol)


def test_bfloat16_on_a_file_without_affine_layers(files: Callable[..., tuple[Path, Path]]) -> None:
    """Block types dequantize in any dtype: Q6_K computes in bfloat16 when asked, within bfloat16's TOL."""
    path, twin = files("llama", Q.Q6_K)
    got, _, dtype, layers, width = run(path, "bfloat16")
    want, _, _, _, _ = run(twin, "float32")
    assert dtype == mx.bfloat16
    np.testing.assert_allclose(got, want, atol=tol16(want, layers, width, U_BF16), rtol=0)


# ---------------------------------------------------------------------- the option

@pytest.mark.parametrize("bad", ["half", "fp16", "", None, 16, "Float16"])
def test_the_option_is_checked_by_name(bad: Any) -> None:
    with pytest.raises(ValueError, match=r"dtype must be one of 'auto', 'float32', 'float16', 'bfloat16'"):
        LoadConfig(dtype=bad)
    with pytest.raises(ValueError, match="dtype must be one of"):
        pymlxc.load_model("/nonexistent/model", backend="metal", dtype=bad)


def test_the_loader_checks_it_before_reading(files: Callable[..., tuple[Path, Path]]) -> None:
    path, twin = files("llama", Q.Q4_0)
    for p in (path, twin):
        with pytest.raises(ValueError, match=r"dtype must be one of 'auto'.*not 'float64'"):
            load_weights_and_config(p, dtype="float64")


def test_bfloat16_with_affine_layers_is_refused_by_tensor(files: Callable[..., tuple[Path, Path]]) -> None:
    path, _ = files("llama", Q.Q4_K)
    with pytest.raises(GGUFError, match=rf"{path}: dtype 'bfloat16' cannot compute tensor 'blk\.0\.attn_k\.weight' "
                                        r"\(Q4_K\): its scales are float16"):
        load_weights_and_config(path, dtype="bfloat16")


def test_the_mlx_lm_backend_refuses_it(files: Callable[..., tuple[Path, Path]]) -> None:
    _, twin = files("llama", Q.Q4_0)
    with pytest.raises(ValueError, match=r"dtype='float16' is not supported by the mlx_lm backend"):
        get_backend("mlx_lm").load(str(twin), LoadConfig(dtype="float16"))


def test_load_model_takes_it(files: Callable[..., tuple[Path, Path]]) -> None:
    """Through the public door, for a GGUF file and a checkpoint: the dtype asked for is the model's,
    and the GGUF file's greedy tokens are its twin's in the same dtype (this prompt's first step is
    a tie within float16's tolerance: the twin's top two are 0.011 apart)."""
    path, twin = files("llama", Q.Q4_0)
    tokens: dict[tuple[Path, str], list[int]] = {}
    for p in (path, twin):
        for dtype, want in (("float32", mx.float32), ("float16", mx.float16)):
            with pymlxc.load_model(str(p), backend="metal", dtype=dtype) as model:
                assert model._model.compute_dtype == want  # noqa: SLF001 - what the option set
                prompt = model._encode_prompt("Once upon a time")  # noqa: SLF001 - the ids generated from
                tokens[p, dtype] = [t.id for t in model.generate("Once upon a time", max_tokens=6)]
    assert tokens[path, "float32"] == tokens[twin, "float32"]
    with load_weights_and_config(twin) as loaded:
        width, layers = loaded.model.args.hidden_size, loaded.model.args.num_hidden_layers
        reference = np.array(loaded.model(mx.array([list(prompt)])).astype(mx.float32))
    check_greedy(tokens[path, "float16"], tokens[twin, "float16"], twin, "float16",
                 2 * tol16(reference, layers, width), list(prompt))


def test_safetensors_checkpoints_take_it(tmp_path: Path) -> None:
    dense = write_tiny_model(tmp_path / "dense", "llama", seed=3)
    with load_weights_and_config(dense) as loaded:
        assert loaded.model.compute_dtype == mx.float32  # auto: the embedding's dtype
    with load_weights_and_config(dense, dtype="float16") as loaded:
        assert loaded.model.compute_dtype == mx.float16
        assert {v.dtype for v in loaded.model.parameters().values()} == {mx.float16}
        assert loaded.model(mx.array(IDS)).dtype == mx.float16
    quantized = write_tiny_model(tmp_path / "q4", "llama", seed=3, dtype="float16", quantize_bits=4)
    with load_weights_and_config(quantized) as loaded:
        assert loaded.model.compute_dtype == mx.float16  # the quantized embedding's scales
    with load_weights_and_config(quantized, dtype="float32") as loaded:
        params = loaded.model.parameters()
        assert params["model.norm.weight"].dtype == mx.float32
        assert params["model.layers.0.self_attn.q_proj.scales"].dtype == mx.float16  # kept: exact, half the bytes
        assert loaded.model(mx.array(IDS)).dtype == mx.float32
    with load_weights_and_config(quantized, dtype="bfloat16") as loaded:
        assert loaded.model.parameters()["model.layers.0.self_attn.q_proj.scales"].dtype == mx.bfloat16
        assert loaded.model(mx.array(IDS)).dtype == mx.bfloat16


# ---------------------------------------------------------------------- float16's range

@settings(max_examples=40, deadline=None)
@given(exponent=st.floats(-3.0, 6.0), seed=st.integers(0, 2**16), source=st.sampled_from(["float32", "bfloat16"]))
def test_a_cast_to_float16_is_refused_past_its_range(exponent: float, seed: int, source: str) -> None:
    values = np.random.default_rng(seed).standard_normal(64).astype(np.float32) * np.float32(10.0**exponent)
    value = mx.array(values).astype(getattr(mx, source))
    peak = float(np.abs(np.array(value.astype(mx.float32))).max())
    cast = _Cast(mx.float16, explicit=False)
    if peak <= FLOAT16_MAX:
        out = cast(value, "blk.0.attn_norm.weight", True)
        assert out.dtype == mx.float16 and bool(mx.all(mx.isfinite(out)).item())
    else:
        with pytest.raises(TensorError, match=r"tensor 'blk\.0\.attn_norm\.weight' holds values up to .* beyond "
                                              r"float16's 65504; load it with dtype 'float32'"):
            cast(value, "blk.0.attn_norm.weight", True)


def test_a_file_past_float16_names_the_tensor_and_loads_in_float32(tmp_path: Path) -> None:
    src = write_tiny_model(tmp_path / "src", "llama", seed=3, **tiny_dims("llama"))  # type: ignore[arg-type]
    weights = load_file(str(src / "model.safetensors"))
    weights["model.norm.weight"][3] = 1e5
    save_file(weights, str(src / "model.safetensors"))
    (tmp_path / "g").mkdir()
    path = export_gguf(src, tmp_path / "g" / "m.gguf", Q.Q4_0)
    with pytest.raises(GGUFError, match=rf"{path}: tensor 'output_norm\.weight' holds values up to 100000 .*"
                                        "dtype 'float32'"):
        load_weights_and_config(path)
    with load_weights_and_config(path, dtype="float32") as loaded:
        assert loaded.model.compute_dtype == mx.float32
        assert bool(mx.all(mx.isfinite(loaded.model(mx.array(IDS)))).item())


# ---------------------------------------------------------------------- kernels chosen by the compute dtype

def test_the_segmented_decode_of_a_block_embedding_uses_the_compute_dtype(
        files: Callable[..., tuple[Path, Path]], monkeypatch: pytest.MonkeyPatch, switches: Any) -> None:
    """A Q6_K embedding is uint8 blocks: the RoPE kernel's check and the argmax kernel's are asked
    for the model's float16, and the segments calling the RoPE kernel (stood in for by MLX's ops, as
    on the CPU) give the uncompiled loop's tokens."""
    path, _ = files("llama", Q.Q4_0, {"token_embd.weight": Q.Q6_K, "output.weight": Q.Q6_K})
    with load_weights_and_config(path) as loaded:
        model = loaded.model
        assert isinstance(model.model.embed_tokens, BlockEmbedding) and model.compute_dtype == mx.float16
        checked: list[Any] = []
        monkeypatch.setattr(rope_kv_kernel, "check", lambda dtype, *a: checked.append(dtype) or True)
        monkeypatch.setattr(rope_kv_kernel, "rope_write_kv",
                            lambda qk, v, pos, keys, values, spec, n: rope_kv_kernel.reference(
                                qk, v, pos, keys, values, spec.mlx, n))
        monkeypatch.setattr(argmax_kernel, "check", lambda vocab, dtype: checked.append(dtype) and False)
        assert not segments.use_cuda_argmax(model, "1") and checked == [mx.float16]
        switches.env("PYMLXC_CUDA_ROPE_KV", "1")
        decoder = stood_in_decoder(model, "rope_kv")
        decoder.close()
        assert set(checked) == {mx.float16}


@pytest.mark.parametrize("main,extra", [(Q.Q4_0, {"blk.0.ffn_down.weight": Q.Q8_0}),
                                        (Q.Q4_K, {"blk.1.attn_v.weight": Q.Q5_K, "blk.0.ffn_up.weight": Q.Q4_1})])
def test_the_4bit_matvec_kernel_takes_the_repacked_layers_in_float16(
        main: Q, extra: dict[str, Q], files: Callable[..., tuple[Path, Path]]) -> None:
    """4 bits at group 32 with x in the scales' float16: the kernel's; 5 and 8 bits, or float32 x: MLX's."""
    path, _ = files("llama", main, extra)
    for dtype in ("auto", "float32"):
        with load_weights_and_config(path, dtype=dtype) as loaded:
            layers = {p: m for p, m in loaded.model.named_modules() if isinstance(m, nn.QuantizedLinear)}
            bits = {m.bits for m in layers.values()}
            assert {4, AFFINE_BITS[next(iter(extra.values()))]} <= bits
            for name, m in layers.items():
                x = mx.zeros((1, 1, m.weight.shape[1] * 32 // m.bits), loaded.model.compute_dtype)
                takes = kernel_choice.kernel_takes(x, m.weight, m.scales, m.biases, m.group_size, m.bits)
                assert m.group_size == 32
                assert takes == (m.bits == 4 and dtype == "auto"), name


def test_the_memory_estimate_of_block_projections_counts_the_compute_dtype(
        files: Callable[..., tuple[Path, Path]]) -> None:
    # Q6_K k/v projections hold raw uint8 blocks: the keys and values they write are in the
    # model's compute dtype (2 bytes in float16), which is what the memory check must count.
    from pymlxc.backends.metal import memory_check

    path, _ = files("llama", Q.Q6_K)
    with load_weights_and_config(path) as loaded:
        model = loaded.model
        assert model.compute_dtype == mx.float16
        cache = model.make_cache(None)
        shapes = memory_check.layer_shapes(model, cache)
        assert shapes is not None and all(s.itemsize == 2 for s in shapes)
        list(loops.generate_ids(model, IDS[0], cache=cache, sampler=greedy, max_tokens=3))
        assert all(c.keys.dtype == mx.float16 for c in cache)


@contextlib.contextmanager
def _prefill_runner(path: Path) -> Iterator[tuple[Any, Any, Any]]:
    """(model, its segmented decoder, the decoder's compiled prefill runner) of a GGUF file, freed after."""
    from pymlxc.backends.metal.decode.decoder import CompiledDecoder

    with load_weights_and_config(path) as loaded:
        decoder = CompiledDecoder(loaded.model, "segmented")
        try:
            runner = decoder.prefill_runner(False)
            assert runner is not None
            yield loaded.model, decoder, runner
        finally:
            decoder.close()


def _greedy(model: Any, prompt: list[int], decoder: Any = None, tokens: int = 6) -> list[int]:
    return list(loops.generate_ids(model, prompt, cache=model.make_cache(None), sampler=greedy, max_tokens=tokens,
                                   decoder=decoder))


def test_block_layers_prefill_through_the_compiled_segments(
        files: Callable[..., tuple[Path, Path]], caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A Q4_K_M-like file (Q6_K and Q3_K value and down projections, a Q6_K embedding): the compiled
    prefill takes the block layers, their rows dequantized outside the trace for each segment call
    that runs them, and fills the caches as the model's forward does over chunks of changing
    lengths (the first segment has no block layer, the middle one two, the last one); a generation
    through it gives the uncompiled loop's tokens, and no trace fails."""
    extra = {"blk.0.ffn_down.weight": Q.Q6_K, "blk.1.attn_v.weight": Q.Q6_K, "blk.1.ffn_down.weight": Q.Q3_K,
             "token_embd.weight": Q.Q6_K}
    path, _ = files("llama", Q.Q4_K, extra)
    dequantized: list[Any] = []
    real = BlockLinear.dense_chunks
    monkeypatch.setattr(BlockLinear, "dense_chunks",
                        lambda self, dtype: dequantized.append((self.qtype, dtype)) or real(self, dtype))
    with _prefill_runner(path) as (model, decoder, runner):
        assert len(model.layers) == 2
        tokens = mx.array([[int(i) for i in np.random.default_rng(1).integers(16, 500, size=61)]], dtype=mx.int32)
        ours, theirs = model.make_cache(None), model.make_cache(None)
        for start, stop in ((0, 25), (25, 40), (40, 41), (41, 61)):
            runner(tokens[:, start:stop], ours)
            model(tokens[:, start:stop], cache=theirs)
        for a, b in zip(ours, theirs, strict=True):
            assert a.offset == b.offset == 61
            for x, y in ((a.keys, b.keys), (a.values, b.values)):
                np.testing.assert_array_equal(np.asarray(x[:, :, :61].astype(mx.float32)),
                                              np.asarray(y[:, :, :61].astype(mx.float32)))
        # Per chunk: the middle segment's two block layers, the last segment's one.
        assert dequantized == [(Q.Q6_K, model.compute_dtype), (Q.Q6_K, model.compute_dtype),
                               (Q.Q3_K, model.compute_dtype)] * 4
        with caplog.at_level("WARNING"):
            compiled = _greedy(model, list(IDS[0]), decoder)
        assert not [r for r in caplog.records if "not available" in r.getMessage()]
        assert decoder.stats["compiled"] == 1
        assert compiled == _greedy(model, list(IDS[0]))


def test_chunks_the_block_kernels_take_stay_op_by_op(
        files: Callable[..., tuple[Path, Path]], monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the block layers' matvec kernel takes a chunk's rows (a few: on a GPU), the chunk runs op
    by op, the kernel reading the blocks, rather than through the compiled prefill, which would
    dequantize their rows whole for it; longer chunks still take the compiled prefill. (The
    kernel's reach stood in for: the CPU has none.)"""
    from pymlxc.backends.metal.decode import prefill

    path, _ = files("llama", Q.Q4_K, {"blk.0.ffn_down.weight": Q.Q6_K, "token_embd.weight": Q.Q6_K})
    monkeypatch.setattr(BlockLinear, "kernel_rows", lambda self, dtype: 8)
    seen: list[tuple[int, ...]] = []
    real = prefill.PrefillRunner.__call__
    monkeypatch.setattr(prefill.PrefillRunner, "__call__",
                        lambda self, tokens, *a, **k: seen.append(tuple(tokens.shape)) or real(self, tokens, *a, **k))
    with _prefill_runner(path) as (model, decoder, runner):
        ids = mx.array([list(range(20, 29))], dtype=mx.int32)
        assert not runner.takes(ids[:, :8]) and runner.takes(ids)
        for prompt in (list(range(20, 25)), list(range(20, 40))):
            assert _greedy(model, prompt, decoder, 4) == _greedy(model, prompt, None, 4)
        assert seen == [(1, 20)]  # the 5-token prompt went op by op


def test_blocks_only_in_the_embedding_keep_the_compiled_prefill(files: Callable[..., tuple[Path, Path]]) -> None:
    """llama.cpp's Q4_0 recipe keeps only the tied embedding / head in Q6_K: both run outside the
    compiled prefill's trace, so the layers still prefill through it, with the plain loop's tokens."""
    path, _ = files("llama", Q.Q4_0, {"token_embd.weight": Q.Q6_K})
    with _prefill_runner(path) as (model, decoder, runner):
        prompt = list(IDS[0])
        h = runner(mx.array([prompt]), model.make_cache(None))
        want = model(mx.array([prompt]), cache=model.make_cache(None))[:, -1]
        np.testing.assert_allclose(np.asarray(model.output(h)[:, -1].astype(mx.float32)),
                                   np.asarray(want.astype(mx.float32)), rtol=2e-2, atol=2e-2)
        assert _greedy(model, prompt, decoder) == _greedy(model, prompt)

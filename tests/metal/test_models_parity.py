"""Every architecture, dense and quantized, against mlx-lm on the same model directory: logits of a
prompt, greedy decoding through the caches, and decoding with a context bound shorter than the
prompt plus the generation (rotating caches).

Tolerances: both sides run the same MLX kernels on the same device (the CPU here) on the same
weights, so results are normally bit-identical; the tolerance only admits a different summation
order. Float32 logits are O(5), so atol 1e-4 is ~2e-5 relative. Quantized layers dequantize with the
same kernel, so the same tolerance would do; 1e-3 leaves room for a reordered dequantize/matmul.
bfloat16 carries 8 bits of mantissa: 5e-2 there.
"""
from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import pymlxc.core as mx
from pymlxc.backends.metal.cache import KVCache, RotatingKVCache
from pymlxc.backends.metal.loader import LoadedModel, load_weights_and_config
from pymlxc.backends.metal.recurrent_cache import RecurrentCache
from pymlxc.testing import LLAMA3_ROPE_SCALING, write_tiny_model

mlx = importlib.import_module("mlx.core")
mlx_utils = importlib.import_module("mlx_lm.utils")
mlx_cache = importlib.import_module("mlx_lm.models.cache")

ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "gemma3")
ATOL = {None: 1e-4, 4: 1e-3}
PROMPT_LEN, STEPS = 10, 32

_loaded: dict[Any, tuple[LoadedModel, Any]] = {}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory):
    """(ours, mlx-lm's) per case, written and loaded once per module."""
    root = tmp_path_factory.mktemp("parity")

    def get(arch: str, bits: int | None = None, **kw: Any) -> tuple[LoadedModel, Any]:
        key = (arch, bits, json.dumps(kw, sort_keys=True))
        if key not in _loaded:
            path = write_tiny_model(root / f"{arch}-{bits}-{len(_loaded)}", arch, quantize_bits=bits, **kw)
            _loaded[key] = (load_weights_and_config(path), mlx_utils.load_model(path)[0])
        return _loaded[key]

    yield get
    for ours, _ in _loaded.values():
        ours.free()
    _loaded.clear()


def prompt_ids(n: int, batch: int = 1, seed: int = 1) -> np.ndarray:
    # Ids above the special tokens, so that the tiny models' muted rows play no part.
    return np.random.default_rng(seed).integers(16, 500, size=(batch, n)).astype(np.int32)


def mirror(caches: list[Any]) -> list[Any]:
    """mlx-lm caches of the same kinds and sizes as ours (a linear-attention layer's RecurrentCache:
    mlx-lm's ArraysCache of its two arrays)."""
    out: list[Any] = []
    for c in caches:
        if isinstance(c, RecurrentCache):
            out.append(mlx_cache.ArraysCache(size=2))
        elif isinstance(c, RotatingKVCache):
            out.append(mlx_cache.RotatingKVCache(max_size=c.max_size, keep=c.keep))
        else:
            assert isinstance(c, KVCache)
            out.append(mlx_cache.KVCache())
    return out


def run_both(ours: LoadedModel, ref: Any, prompt: np.ndarray, *, context_len: int | None = None,
             chunk: int | None = None,
             steps: int = STEPS) -> tuple[list[np.ndarray], list[np.ndarray], list[int], list[int]]:
    """Prefill (in chunks) then greedy single-token steps, on both models; logits of every step."""
    cache = ours.model.make_cache(context_len)
    ref_cache = mirror(cache)
    chunk = chunk or prompt.shape[1]
    la = lb = None
    for s in range(0, prompt.shape[1], chunk):
        piece = prompt[:, s:s + chunk]
        la = ours.model(mx.array(piece), cache)
        lb = ref(mlx.array(piece), cache=ref_cache)
    logits_a, logits_b, toks_a, toks_b = [], [], [], []
    for _ in range(steps):
        a, b = np.asarray(la)[:, -1], np.array(lb[:, -1].astype(mlx.float32))
        logits_a.append(a)
        logits_b.append(b)
        toks_a.append(int(a[0].argmax()))
        toks_b.append(int(b[0].argmax()))
        la = ours.model(mx.array([[toks_a[-1]]], mx.int32), cache)
        lb = ref(mlx.array([[toks_b[-1]]], dtype=mlx.int32), cache=ref_cache)
    return logits_a, logits_b, toks_a, toks_b


CASES = [(a, b) for a in ARCHS for b in (None, 4)]


@pytest.mark.parametrize("arch,bits", CASES)
def test_prompt_logits_match_mlx_lm(models, arch: str, bits: int | None) -> None:
    ours, ref = models(arch, bits)
    ids = prompt_ids(12, batch=2)
    a = np.asarray(ours.model(mx.array(ids)))
    b = np.array(ref(mlx.array(ids)))
    assert a.shape == (2, 12, ours.model.args.vocab_size)
    np.testing.assert_allclose(a, b, atol=ATOL[bits], rtol=0)


@pytest.mark.parametrize("arch,bits", CASES)
def test_greedy_decode_matches_mlx_lm(models, arch: str, bits: int | None) -> None:
    ours, ref = models(arch, bits)
    la, lb, ta, tb = run_both(ours, ref, prompt_ids(PROMPT_LEN), context_len=None, chunk=None, steps=STEPS)
    assert ta == tb
    np.testing.assert_allclose(np.stack(la), np.stack(lb), atol=ATOL[bits], rtol=0)


@pytest.mark.parametrize("arch,bits", CASES)
def test_context_bound_rotating_matches_mlx_lm(models, arch: str, bits: int | None) -> None:
    """context_len 24 < a 30-token prompt (prefilled in chunks of 16: chunks overflow the bound)
    plus 32 generated tokens."""
    ours, ref = models(arch, bits)
    cache = ours.model.make_cache(24)
    assert all(isinstance(c, RotatingKVCache) and c.max_size <= 24 for c in cache)
    la, lb, ta, tb = run_both(ours, ref, prompt_ids(30, seed=2), context_len=24, chunk=16, steps=STEPS)
    assert ta == tb
    np.testing.assert_allclose(np.stack(la), np.stack(lb), atol=ATOL[bits], rtol=0)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3_text"])
def test_cached_decode_equals_full_forward(models, arch: str) -> None:
    """Logits of each decoded token through the caches equal a cacheless forward over the whole
    sequence (gemma3's sliding window of 16 is crossed)."""
    ours, _ = models(arch)
    prompt = prompt_ids(PROMPT_LEN)
    la, _, toks, _ = run_both(ours, _NoRef(), prompt, context_len=None, chunk=4, steps=20)
    seq = np.concatenate([prompt, np.array([toks], np.int32)], axis=1)
    full = np.asarray(ours.model(mx.array(seq)))
    np.testing.assert_allclose(np.stack(la)[:, 0], full[0, PROMPT_LEN - 1:PROMPT_LEN - 1 + 20], atol=1e-4, rtol=0)


class _NoRef:
    """Stands in for mlx-lm when only our own model is exercised."""

    def __call__(self, x: Any, cache: Any = None) -> Any:
        return mlx.zeros((x.shape[0], x.shape[1], 1))


@pytest.mark.parametrize("bits", [2, 3, 6, 8])
def test_other_bit_widths_match_mlx_lm(models, bits: int) -> None:
    ours, ref = models("llama", bits)
    assert ours.quantization == {"group_size": 32, "bits": bits}
    ids = prompt_ids(8)
    np.testing.assert_allclose(np.asarray(ours.model(mx.array(ids))), np.array(ref(mlx.array(ids))), atol=1e-3, rtol=0)


@pytest.mark.parametrize("arch,scaling", [("llama", LLAMA3_ROPE_SCALING),
                                          ("gemma3_text", {"rope_type": "linear", "factor": 8.0}),
                                          ("qwen2", {"type": "linear", "factor": 2.0})])
def test_rope_scaling_matches_mlx_lm(models, arch: str, scaling: dict[str, Any]) -> None:
    ours, ref = models(arch, rope_scaling=scaling)
    la, lb, ta, tb = run_both(ours, ref, prompt_ids(PROMPT_LEN, seed=3), context_len=None, chunk=None, steps=8)
    assert ta == tb
    np.testing.assert_allclose(np.stack(la), np.stack(lb), atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ["gemma2", "mistral"])
def test_sliding_window_layers_beyond_the_window(models, arch: str) -> None:
    """mlx-lm's Gemma 2 and Mistral attend globally in every layer; HF's Gemma 2 looks back only
    `sliding_window` tokens in even layers, Mistral in all. The reference runs mlx-lm's own blocks
    with HF's per-layer masks."""
    ours, ref = models(arch, extra_config={"sliding_window": 8})
    ids = prompt_ids(20, seed=4)
    inner = ref.model
    h = inner.embed_tokens(mlx.array(ids))
    if arch == "gemma2":
        h = h * (ref.args.hidden_size**0.5)
    for i, layer in enumerate(inner.layers):
        window = 8 if arch == "mistral" or i % 2 == 0 else None
        h = layer(h, mlx_cache.create_causal_mask(20, 0, window_size=window), None)
    h = inner.norm(h)
    if arch == "gemma2":
        expected = np.array(mlx.tanh(inner.embed_tokens.as_linear(h) / 30.0) * 30.0)
    else:
        expected = np.array(ref.lm_head(h))
    np.testing.assert_allclose(np.asarray(ours.model(mx.array(ids))), expected, atol=1e-4, rtol=0)
    # Decoding through the window-sized rotating caches gives the same logits as the full forward.
    la, _, toks, _ = run_both(ours, _NoRef(), ids[:, :6], context_len=None, chunk=None, steps=14)
    seq = np.concatenate([ids[:, :6], np.array([toks], np.int32)], axis=1)
    full = np.asarray(ours.model(mx.array(seq)))
    np.testing.assert_allclose(np.stack(la)[:, 0], full[0, 5:19], atol=1e-4, rtol=0)


def _bf16_copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    weights = mlx.load(str(src / "model.safetensors"))
    mlx.save_safetensors(str(dst / "model.safetensors"),
                         {k: v.astype(mlx.bfloat16) if v.dtype == mlx.float32 else v for k, v in weights.items()})
    return dst


@pytest.mark.parametrize("arch,bits", [("llama", None), ("gemma3_text", None), ("qwen3", 4)])
def test_bfloat16_checkpoint_stays_bfloat16(tmp_path: Path, arch: str, bits: int | None) -> None:
    path = _bf16_copy(write_tiny_model(tmp_path / "f32", arch, quantize_bits=bits), tmp_path / "bf16")
    with load_weights_and_config(path) as ours:
        dtypes = {a.dtype for k, a in ours.model.parameters().items() if not k.endswith(".weight") or bits is None}
        assert dtypes == {mx.bfloat16}
        ref = mlx_utils.load_model(path)[0]
        ids = prompt_ids(8)
        a = np.asarray(ours.model(mx.array(ids)))
        b = np.array(ref(mlx.array(ids)).astype(mlx.float32))
        np.testing.assert_allclose(a, b, atol=5e-2, rtol=0)


def test_mixed_quantization_with_per_layer_overrides(tmp_path: Path) -> None:
    """A checkpoint quantized by mlx-lm with per-module settings: 8-bit down projections, a dense
    (false) output head, 4-bit elsewhere."""
    src = write_tiny_model(tmp_path / "src", "qwen3", tie_word_embeddings=False)
    model, config = mlx_utils.load_model(src)

    def predicate(path: str, module: Any) -> Any:
        if path.endswith("down_proj"):
            return {"group_size": 64, "bits": 8}
        return not path.startswith("lm_head")

    model, config = mlx_utils.quantize_model(model, config, 32, 4, quant_predicate=predicate)
    config["quantization"]["lm_head"] = False
    dst = tmp_path / "mixed"
    mlx_utils.save_model(dst, model)
    mlx_utils.save_config(config, dst / "config.json")
    with load_weights_and_config(dst) as ours:
        from pymlxc.backends.metal import nn

        layer = ours.model.layers[0]
        assert isinstance(layer.mlp.down_proj, nn.QuantizedLinear) and layer.mlp.down_proj.bits == 8
        assert layer.mlp.down_proj.group_size == 64
        assert isinstance(layer.mlp.up_proj, nn.QuantizedLinear) and layer.mlp.up_proj.bits == 4
        assert isinstance(ours.model.lm_head, nn.Linear)
        assert isinstance(ours.model.model.embed_tokens, nn.QuantizedEmbedding)
        ref = mlx_utils.load_model(dst)[0]
        ids = prompt_ids(8)
        np.testing.assert_allclose(np.asarray(ours.model(mx.array(ids))), np.array(ref(mlx.array(ids))),
                                   atol=1e-3, rtol=0)


def _alone(model: Any, ids: np.ndarray, steps: np.ndarray, context_len: int | None) -> list[np.ndarray]:
    cache = model.make_cache(context_len)
    out = [np.asarray(model(mx.array(ids[None]), cache))[0, -1]]
    for t in steps:
        out.append(np.asarray(model(mx.array([[t]], mx.int32), cache))[0, -1])
    return out


@pytest.mark.parametrize("context_len", [None, 24])
@pytest.mark.parametrize("arch,extra", [("gemma3_text", {}), ("gemma2", {"sliding_window": 8}), ("llama", {})])
def test_explicit_mask_left_padded_batch(models, arch: str, extra: dict[str, Any], context_len: int | None) -> None:
    """A left-padded batch with explicit boolean masks (prefill, then decoding through the caches)
    gives each row the logits it has alone: RoPE only sees relative positions and the pads are
    masked. The sliding windows (gemma3: 16, gemma2 here: 8, through the soft-capped path) are
    crossed and, with context_len 24, the rotating caches wrap: mask columns are picked by position."""
    ours, _ = models(arch, extra_config=extra) if extra else models(arch)
    model = ours.model
    long, short = prompt_ids(20, seed=5)[0], prompt_ids(12, seed=6)[0]
    pad = 20 - len(short)
    batch = np.stack([long, np.concatenate([np.zeros(pad, np.int32), short])])
    steps = prompt_ids(10, batch=2, seed=7)
    valid = np.ones((2, 20), bool)
    valid[1, :pad] = False
    mask = np.tril(np.ones((20, 20), bool))[None, None] & valid[:, None, None, :]
    mask |= np.eye(20, dtype=bool)[None, None]  # a pad query sees itself: no empty softmax row
    cache = model.make_cache(context_len)
    got = [np.asarray(model(mx.array(batch), cache, mask=mx.array(mask)))[:, -1]]
    for i in range(steps.shape[1]):
        valid = np.concatenate([valid, np.ones((2, 1), bool)], axis=1)
        step_mask = mx.array(valid[:, None, None, :])
        got.append(np.asarray(model(mx.array(steps[:, i:i + 1]), cache, mask=step_mask))[:, -1])
    got = np.stack(got)
    np.testing.assert_allclose(got[:, 0], np.stack(_alone(model, long, steps[0], context_len)), atol=1e-4, rtol=0)
    if context_len is None:  # with a bound, the pads take the kept first slots: rows differ by design
        np.testing.assert_allclose(got[:, 1], np.stack(_alone(model, short, steps[1], context_len)), atol=1e-4,
                                   rtol=0)

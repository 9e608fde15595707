"""`pymlxc.testing.write_tiny_model`: the directories it writes load in mlx-lm and transformers."""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import load_file

from pymlxc.testing import (
    ARCHITECTURES,
    LLAMA3_ROPE_SCALING,
    QUANTIZE_BITS,
    SPECS,
    ArchSpec,
    quantize_affine,
    tokenizer,
    write_tiny_model,
)
from pymlxc.testing.specs import block_weights
from pymlxc.testing.transformer import llama_fields, tensors

mx = pytest.importorskip("mlx.core")
mlx_lm_utils = pytest.importorskip("mlx_lm.utils")
transformers = pytest.importorskip("transformers")

PROMPT = "héllo wörld 你好 🙂, what is the capital of France?"


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, int | None], Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {(arch, bits): write_tiny_model(root / f"{arch}-{bits}", arch, quantize_bits=bits)
            for arch in ARCHITECTURES for bits in (None, 4)}


def _logits(path: Path, text: str = PROMPT) -> tuple[np.ndarray, list[int]]:
    model, tokenizer = mlx_lm_utils.load(str(path))
    ids = tokenizer.encode(text)
    return np.array(model(mx.array([ids])).astype(mx.float32)), ids


@pytest.mark.parametrize("bits", [None, 4])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_loads_in_mlx_lm_with_finite_logits(model_dirs: dict, arch: str, bits: int | None) -> None:
    path = model_dirs[(arch, bits)]
    logits, ids = _logits(path)
    config = json.loads((path / "config.json").read_text())
    assert logits.shape == (1, len(ids), 512)
    assert np.isfinite(logits).all()
    assert logits.std() > 0.1  # not degenerate: the tokens are told apart
    assert ("quantization" in config) == (bits is not None)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_quantized_model_is_close_to_dense(model_dirs: dict, arch: str) -> None:
    dense, _ = _logits(model_dirs[(arch, None)])
    quant, _ = _logits(model_dirs[(arch, 4)])
    # Random gated-delta layers (4 of them, gates through exp and softplus) amplify 4-bit rounding:
    # about 0.6-0.7 there, 0.99 at 8 bits; a wrong layout (norm offsets, conv axes) gives about 0.
    floor = 0.5 if arch in ("qwen3_next", "qwen3_5", "qwen3_5_moe") else 0.9
    assert np.corrcoef(dense.ravel(), quant.ravel())[0, 1] > floor


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_autotokenizer_loads_and_matches_config(model_dirs: dict, arch: str) -> None:
    path = model_dirs[(arch, None)]
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    config = json.loads((path / "config.json").read_text())
    assert len(tok) == config["vocab_size"] == 512
    ids = tok.encode(PROMPT)
    assert tok.decode(ids, skip_special_tokens=True) == PROMPT
    assert tok.chat_template is not None


@pytest.mark.parametrize("arch", [a for a in ARCHITECTURES if not a.endswith("moe")
                                  and not a.startswith(("gemma4", "qwen3_next", "qwen3_5"))])  # own layouts
def test_weights_have_the_checkpoint_names_and_shapes(model_dirs: dict, arch: str) -> None:
    weights = load_file(str(model_dirs[(arch, None)] / "model.safetensors"))
    prefix = "language_model." if arch == "gemma3" else ""
    layer = prefix + "model.layers.1."
    assert weights[prefix + "model.embed_tokens.weight"].shape == (512, 64)
    assert weights[layer + "self_attn.q_proj.weight"].shape == (64, 64)
    assert weights[layer + "self_attn.k_proj.weight"].shape == (32, 64)  # 2 kv heads of 16
    assert weights[layer + "self_attn.o_proj.weight"].shape == (64, 64)
    assert weights[layer + "mlp.gate_proj.weight"].shape == (128, 64)
    assert weights[layer + "mlp.down_proj.weight"].shape == (64, 128)
    assert (layer + "self_attn.q_proj.bias" in weights) == (arch == "qwen2")
    assert (layer + "self_attn.q_norm.weight" in weights) == (arch in ("qwen3", "gemma3_text", "gemma3"))
    assert (layer + "pre_feedforward_layernorm.weight" in weights) == arch.startswith("gemma")
    assert (prefix + "lm_head.weight" in weights) == (arch in ("llama", "mistral"))
    norm = weights[layer + "input_layernorm.weight"]
    assert abs(float(norm.mean()) - (0.0 if arch.startswith("gemma") else 1.0)) < 0.1
    assert all(v.dtype == np.float32 for v in weights.values())


def test_large_vocab_is_filled_with_reserved_specials(tmp_path: Path) -> None:
    path = write_tiny_model(tmp_path, "gemma3_text", vocab_size=1500)
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    assert len(tok) == 1500 and tok.convert_ids_to_tokens(1499).startswith("<reserved_")
    logits, _ = _logits(path)
    assert logits.shape[-1] == 1500 and logits[0, :, 1499].max() == 0.0  # muted, as every special


def test_family_config_fields(model_dirs: dict) -> None:
    def cfg(arch: str) -> dict:
        return json.loads((model_dirs[(arch, None)] / "config.json").read_text())

    gemma2 = cfg("gemma2")
    assert gemma2["attn_logit_softcapping"] == 50.0 and gemma2["final_logit_softcapping"] == 30.0
    assert gemma2["query_pre_attn_scalar"] == gemma2["head_dim"] and gemma2["cache_implementation"] == "hybrid"
    gemma3 = cfg("gemma3")
    text = gemma3["text_config"]
    assert gemma3["model_type"] == "gemma3" and text["model_type"] == "gemma3_text"
    assert text["layer_types"] == ["sliding_attention", "full_attention"] and text["sliding_window_pattern"] == 2
    assert text["rope_local_base_freq"] == 10000.0 and gemma3["vocab_size"] == text["vocab_size"]
    assert cfg("qwen2")["attention_bias"] is True and cfg("qwen3")["attention_bias"] is False
    for arch in ARCHITECTURES:
        config = cfg(arch)
        assert config["eos_token_id"] is not None and config["bos_token_id"] is not None


def test_llama3_rope_scaling_loads(tmp_path: Path) -> None:
    path = write_tiny_model(tmp_path, "llama", rope_scaling=LLAMA3_ROPE_SCALING)
    assert json.loads((path / "config.json").read_text())["rope_scaling"]["rope_type"] == "llama3"
    logits, _ = _logits(path)
    assert np.isfinite(logits).all()


@pytest.mark.parametrize("bits", [2, 3, 6, 8])
def test_other_bit_widths_load(tmp_path: Path, bits: int) -> None:
    path = write_tiny_model(tmp_path, "qwen3", quantize_bits=bits, group_size=64)
    weights = load_file(str(path / "model.safetensors"))
    assert weights["model.layers.0.mlp.down_proj.weight"].shape == (64, 128 * bits // 32)
    assert weights["model.layers.0.mlp.down_proj.weight"].dtype == np.uint32
    assert "model.norm.scales" not in weights
    logits, _ = _logits(path)
    assert np.isfinite(logits).all()


def test_float16(tmp_path: Path) -> None:
    path = write_tiny_model(tmp_path, "gemma3_text", dtype="float16", quantize_bits=4)
    weights = load_file(str(path / "model.safetensors"))
    assert weights["model.norm.weight"].dtype == np.float16
    assert weights["model.embed_tokens.scales"].dtype == np.float16
    logits, _ = _logits(path)
    assert np.isfinite(logits).all()


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("bits", [2, 3, 4, 6, 8])
def test_quantize_affine_matches_mlx(bits: int, group_size: int) -> None:
    rng = np.random.default_rng(bits * 1000 + group_size)
    w = rng.normal(size=(6, 256)).astype(np.float32)
    w[0, :group_size] = 0.0  # constant groups take the degenerate branch
    w[1, :group_size] = 2.5
    w[2] = np.abs(w[2])  # zero-ish minimum: the max is the edge
    packed, scales, biases = quantize_affine(w, group_size, bits)
    ref = [np.array(a) for a in mx.quantize(mx.array(w), group_size=group_size, bits=bits)]
    np.testing.assert_array_equal(packed, ref[0])
    np.testing.assert_array_equal(scales, ref[1])
    np.testing.assert_array_equal(biases, ref[2])
    back = np.array(mx.dequantize(mx.array(packed), mx.array(scales), mx.array(biases),
                                  group_size=group_size, bits=bits))
    # Within one step (not half: the step is stretched so one end of each group is exact).
    step = np.abs(scales).repeat(group_size, axis=-1)
    assert (np.abs(back - w) <= step + 1e-6).all()


def test_quantize_affine_matches_our_binding() -> None:
    pmx = pytest.importorskip("pymlxc.core")
    w = np.random.default_rng(7).normal(size=(5, 128)).astype(np.float32)
    ours = quantize_affine(w, 64, 3)
    for got, want in zip(pmx.quantize(pmx.array(w), 64, 3), ours, strict=True):
        np.testing.assert_array_equal(np.asarray(got), want)


def test_quantize_affine_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match="group_size"):
        quantize_affine(np.zeros((2, 48), np.float32), 32, 4)
    with pytest.raises(ValueError, match="bits"):
        quantize_affine(np.zeros((2, 64), np.float32), 32, 5)


def test_special_tokens_are_muted_for_greedy(model_dirs: dict) -> None:
    path = model_dirs[("qwen3", None)]
    logits, _ = _logits(path)
    tokenizer = json.loads((path / "tokenizer.json").read_text())
    special = {t["id"] for t in tokenizer["added_tokens"] if t["special"]}
    assert special and not special & set(logits[0].argmax(-1).tolist())


def test_same_seed_same_files_across_processes(tmp_path: Path) -> None:
    # The CLI runs in a fresh process, so this also checks the tokenizer training is deterministic.
    here = write_tiny_model(tmp_path / "a", "gemma2", seed=3, quantize_bits=4)
    subprocess.run([sys.executable, "-m", "pymlxc.testing", "gemma2", str(tmp_path / "b"), "--seed", "3",
                    "--quantize-bits", "4"], check=True, capture_output=True)
    for name in ("model.safetensors", "tokenizer.json", "config.json", "tokenizer_config.json"):
        assert (here / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    other = write_tiny_model(tmp_path / "c", "gemma2", seed=4)
    assert (other / "model.safetensors").read_bytes() != (write_tiny_model(tmp_path / "d", "gemma2", seed=3)
                                                           / "model.safetensors").read_bytes()


def test_bad_arguments_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="llama, mistral"):
        write_tiny_model(tmp_path, "gpt2")
    with pytest.raises(ValueError, match="bfloat16"):
        write_tiny_model(tmp_path, "llama", dtype="bfloat16")
    with pytest.raises(ValueError, match="ties"):
        write_tiny_model(tmp_path, "gemma2", tie_word_embeddings=False)
    with pytest.raises(ValueError, match="quantize_bits"):
        write_tiny_model(tmp_path, "llama", quantize_bits=5)


# -- the writers' structure: one spec per architecture, one tensor list for tiny and real shapes ------
# sha256 of model.safetensors and config.json as the writer made them before it was split into specs
# (`pymlxc/testing.py` at 9636cd2): the tiny models must not drift, or every parity test's weights move.
GOLDEN = {
    ("llama", None, "float32"): ("264a1440df370fa4dee3bf01b65f3f35143c5bf23fee9899ecb829f3ab4e3a8a",
                                 "b84aabe3e239f87b6577440b0bf2272cadb06b9eb9bdcacef533d44e471124c5"),
    ("qwen3_5_moe", 4, "float32"): ("42bd4f891b89c856e7ed734f123def10282d1f541a32f29d3d3e13b7915ce3e5",
                                    "bc9d8491689da3c9117a71008848b52ca3f103b317bf99b715b715215f34198f"),
    ("gemma4", None, "float16"): ("3b75f6532f06dfd3e686933c9ad34b2b1eb58a60023fd579596fbbcc41a6745a",
                                  "078e1908acf7667cc2fed11091e19ecdb5ce2329f2fb0f1cf49722ada870e774"),
    ("qwen2_moe", 8, "float32"): ("dee15e82b2d8f5c11e5fe27fdf2cb214060d78e904d7378418391552e79d6592",
                                  "b9162d901b36650fdaa461846463c227c4c3d3c6cb61cc15be1e4a9ca50f8440"),
}


@pytest.mark.parametrize(("arch", "bits", "dtype"), list(GOLDEN))
def test_tiny_models_keep_their_bytes(tmp_path: Path, arch: str, bits: int | None, dtype: str) -> None:
    path = write_tiny_model(tmp_path, arch, quantize_bits=bits, dtype=dtype)
    digests = tuple(hashlib.sha256((path / name).read_bytes()).hexdigest()
                    for name in ("model.safetensors", "config.json"))
    assert digests == GOLDEN[(arch, bits, dtype)]


def test_every_architecture_is_one_spec() -> None:
    assert tuple(SPECS) == ARCHITECTURES
    assert all(name == spec.name for name, spec in SPECS.items())


@pytest.mark.parametrize("arch", [a for a, s in SPECS.items() if s.weights is block_weights])
def test_standard_blocks_write_exactly_the_listed_tensors(tmp_path: Path, arch: str) -> None:
    """Architectures of the standard block write `transformer.tensors`, the list the real-shape
    writer draws too, under the checkpoint's nesting."""
    path = write_tiny_model(tmp_path, arch)
    config = json.loads((path / "config.json").read_text())
    text = config.get("text_config", config)
    spec = SPECS[arch]
    listed = {spec.rename(name): shape for name, shape, _ in tensors(text, spec)}
    written = {name: value.shape for name, value in load_file(str(path / "model.safetensors")).items()}
    assert written == listed


def test_real_shapes_draw_the_tiny_writers_tensor_list() -> None:
    from pymlxc.testing import shapes  # imports mlx.core, which the module skips without
    for shape in shapes.SHAPES:
        config = shapes.shape_config(shape, layers=2)
        if config["model_type"] == "qwen3_5_moe":  # listed in mlx-lm's converted layout: below
            continue
        assert list(shapes.tensor_shapes(config)) == list(tensors(config, SPECS[config["model_type"]]))
    names = [n for n, _, _ in shapes.tensor_shapes(shapes.shape_config("qwen3-0.6b", layers=1))]
    assert "model.layers.0.self_attn.q_norm.weight" in names and "lm_head.weight" not in names


@pytest.mark.parametrize("shape", ["qwen3.5-35b-a3b", "qwen3.5-35b-a3b-narrow"])
def test_qwen35_moe_shapes_list_the_tiny_writers_converted_tensors(shape: str) -> None:
    """Qwen 3.5 MoE's real shapes list the tensors the tiny writer's conversion to mlx-lm's layout
    gives (names and shapes), for one linear-attention and one full-attention layer."""
    from pymlxc.testing import shapes
    from pymlxc.testing.qwen_next import next_to_mlx_layout
    config = shapes.shape_config(shape, layers=4)
    config["full_attention_interval"] = 2
    if shape == "qwen3.5-35b-a3b":  # the tiny writer draws float64 with numpy: keep the widths, shrink the rest
        config.update(vocab_size=512, num_experts=4)
    spec = SPECS["qwen3_5_moe"]
    tiny = {spec.rename(k): v for k, v in spec.weights(config, spec, np.random.default_rng(0)).items()}
    expected = {name: value.shape for name, value in next_to_mlx_layout(tiny, "qwen3_5_moe").items()}
    assert {name: shp for name, shp, _ in shapes.tensor_shapes(config)} == expected


def test_a_new_architecture_is_one_spec_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Llama-like architecture needs nothing but its entry: config, tokenizer, weights and the
    quantized layout follow from the spec."""
    spec = ArchSpec("llama_like", tokenizer.LLAMA3, llama_fields, tied=False, qk_norm=True)
    monkeypatch.setitem(SPECS, "llama_like", spec)
    path = write_tiny_model(tmp_path, "llama_like", quantize_bits=4)
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "llama_like" and config["quantization"]["bits"] == 4
    weights = load_file(str(path / "model.safetensors"))
    assert "model.layers.1.self_attn.q_norm.weight" in weights and "lm_head.scales" in weights
    assert weights["model.layers.0.mlp.up_proj.weight"].dtype == np.uint32


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(arch=st.sampled_from(ARCHITECTURES), seed=st.integers(0, 2**32 - 1),
       bits=st.sampled_from([None, *QUANTIZE_BITS]))
def test_the_seed_alone_decides_the_weights(tmp_path: Path, arch: str, seed: int, bits: int | None) -> None:
    root = tmp_path / f"{arch}-{seed}-{bits}"
    a = write_tiny_model(root / "a", arch, seed=seed, quantize_bits=bits)
    b = write_tiny_model(root / "b", arch, seed=seed, quantize_bits=bits)
    c = write_tiny_model(root / "c", arch, seed=seed + 1, quantize_bits=bits)
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()

"""GGUF models in the native backend: tiny HF checkpoints written as GGUF (tests/metal/gguf_export.py,
llama.cpp's conventions) load with the same logits, tokenizers rebuilt from the metadata encode like
the originals, and malformed files give GGUFError, never a crash, a hang or a huge allocation."""
from __future__ import annotations

import json
import shutil
import struct
import warnings
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pymlxc
import pymlxc.core as mx
from pymlxc.backends.metal import nn
from pymlxc.backends.metal.formats.gguf import GGUFError, describe_gguf, find_gguf, gguf_config, read_gguf
from pymlxc.backends.metal.loader import load_weights_and_config
from pymlxc.backends.metal.tokenizer import Tokenizer, load_gguf_tokenizer
from pymlxc.testing import CORPUS, LLAMA3_ROPE_SCALING, write_tiny_model

from .gguf_export import export_gguf, write_spm_gguf

ARCHS = ("llama", "qwen2", "qwen3", "gemma2", "gemma3")
IDS = [[3, 17, 260, 99, 5, 301, 42, 8, 150, 77, 2, 400]]
SAMPLES = [*CORPUS.splitlines(keepends=True)[:12], CORPUS, "", " ", "  two  spaces\n\n", "héllo wörld 🙂 你好",
           "<|im_start|>user\nhi<|im_end|>", "<think>x</think>", "<bos><start_of_turn>user\n<end_of_turn>",
           "<|begin_of_text|><|start_header_id|>user<|end_header_id|>"]
# Logits of these tiny random models have a standard deviation near 1.
F16_ATOL, BF16_ATOL = 0.02, 0.1
QUANT_ATOL = 0.02  # against a dense model holding the gguf package's own dequantization
Q8_0_VS_ORIGINAL = 0.25


@pytest.fixture(autouse=True)
def _quiet() -> None:
    # gguf.SpecialVocab logs about the pair template of the tiny tokenizers; nothing to see here.
    warnings.simplefilter("ignore", DeprecationWarning)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: write_tiny_model(root / arch, arch, seed=3) for arch in ARCHS}


@pytest.fixture(scope="module")
def export(tiny: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """export(arch, qtype) -> a GGUF file alone in its folder (no tokenizer.json beside), cached."""
    root = tmp_path_factory.mktemp("gguf")
    cache: dict[tuple[str, Q], Path] = {}

    def make(arch: str, qtype: Q = Q.F32) -> Path:
        if (arch, qtype) not in cache:
            folder = root / f"{arch}-{qtype.name}"
            folder.mkdir()
            cache[arch, qtype] = export_gguf(tiny[arch], folder / f"{arch}.{qtype.name}.gguf", qtype)
        return cache[arch, qtype]

    return make


def logits(path: Path, patch: Callable[[object], None] | None = None, dtype: str = "auto") -> np.ndarray:
    with load_weights_and_config(path, dtype=dtype) as loaded:
        if patch is not None:
            patch(loaded.model)
        return np.array(loaded.model(mx.array(IDS)).astype(mx.float32))


# ---------------------------------------------------------------------- weights and config

@pytest.mark.parametrize("arch", ARCHS)
def test_f32_export_has_the_logits_of_its_safetensors_original(arch: str, tiny: dict[str, Path], export: Callable[..., Path]) -> None:
    path = export(arch)
    np.testing.assert_allclose(logits(path), logits(tiny[arch]), atol=1e-4, rtol=0)
    config = gguf_config(read_gguf(path))
    original = json.loads((tiny[arch] / "config.json").read_text())
    original = original.get("text_config", original)
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "intermediate_size", "vocab_size", "rms_norm_eps", "rope_theta", "max_position_embeddings"):
        assert config[key] == original[key], key
    for key in ("sliding_window", "attn_logit_softcapping", "final_logit_softcapping", "layer_types"):
        if original.get(key) is not None:
            assert config[key] == original[key], key


def test_a_llama_with_attention_biases(tmp_path: Path) -> None:
    """llama.cpp permutes a Llama's q/k bias values as it does the weight rows: they are put back per
    head like the rows (the 1-D tensor used to be taken for one row, and the file was refused)."""
    from safetensors.numpy import load_file, save_file

    model = write_tiny_model(tmp_path / "hf", "llama", seed=3, extra_config={"attention_bias": True})
    file = model / "model.safetensors"
    tensors, rng = load_file(file), np.random.default_rng(0)
    for name in [k for k in tensors if k.endswith(tuple(f"{p}_proj.weight" for p in "qkvo"))]:
        tensors[name.removesuffix("weight") + "bias"] = rng.standard_normal(tensors[name].shape[0]).astype(np.float32)
    save_file(tensors, file)
    path = export_gguf(model, tmp_path / "bias.gguf", Q.F32)
    np.testing.assert_allclose(logits(path), logits(model), atol=1e-4, rtol=1e-4)


def test_a_gemma3_file_without_a_sliding_window_attends_to_everything(
        tiny: dict[str, Path], export: Callable[..., Path], tmp_path: Path) -> None:
    """No `gemma3.attention.sliding_window` (or 0): every layer is global, as llama.cpp loads such a
    file, the logits those of the checkpoint with every layer full; it took Gemma 2's 4096-token
    window, silently, which differs from the checkpoint's past its window."""
    from .test_gguf_hostile import DELETE, rewrite

    ids = mx.array([[int(i) for i in np.random.default_rng(4).integers(6, 500, size=40)]])  # past the window of 16
    full = tmp_path / "full"
    shutil.copytree(tiny["gemma3"], full)
    config = json.loads((full / "config.json").read_text())
    config["text_config"]["layer_types"] = ["full_attention"] * config["text_config"]["num_hidden_layers"]
    (full / "config.json").write_text(json.dumps(config))

    def run(path: Path) -> np.ndarray:
        with load_weights_and_config(path) as loaded:
            return np.array(loaded.model(ids).astype(mx.float32))

    want, windowed = run(full), run(tiny["gemma3"])
    assert np.abs(want - windowed).max() > 1e-3  # the window matters for this prompt
    for value in (DELETE, 0):
        path = rewrite(export("gemma3"), tmp_path / f"g{value is DELETE}.gguf",
                       {"gemma3.attention.sliding_window": value})
        assert gguf_config(read_gguf(path))["layer_types"] == ["full_attention"] * 2
        np.testing.assert_allclose(run(path), want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_f16_and_bf16_exports(arch: str, tiny: dict[str, Path], export: Callable[..., Path]) -> None:
    original = logits(tiny[arch])
    np.testing.assert_allclose(logits(export(arch, Q.F16)), original, atol=F16_ATOL, rtol=0)
    path = export(arch, Q.BF16)
    np.testing.assert_allclose(logits(path), original, atol=BF16_ATOL, rtol=0)
    with load_weights_and_config(path) as loaded:
        w = loaded.model.layers[0].self_attn.q_proj.weight
        assert w.dtype == mx.bfloat16  # taken from the file bit-exact, not widened to float16
        with load_weights_and_config(tiny[arch]) as ref:
            want = ref.model.layers[0].self_attn.q_proj.weight.astype(mx.bfloat16)
            assert np.array_equal(np.array(w.astype(mx.float32)), np.array(want.astype(mx.float32)))


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_f16_export_of_a_float16_checkpoint_is_exact(arch: str, tmp_path: Path) -> None:
    # Norms come back from llama.cpp's F32 to float16, so activations stay float16 as in the original.
    src = write_tiny_model(tmp_path / arch, arch, dtype="float16", seed=3)
    path = export_gguf(src, tmp_path / f"{arch}.gguf", Q.F16)
    with load_weights_and_config(path) as loaded:
        assert loaded.model(mx.array(IDS)).dtype == mx.float16
    np.testing.assert_array_equal(logits(path), logits(src))


def _dequantized_reference(qtype: Q) -> Callable[[object], None]:
    """Replace every 2-D weight by gguf's own quantize -> dequantize round trip of it."""
    def patch(model: object) -> None:
        new = {k: mx.array(gguf.quants.dequantize(gguf.quants.quantize(np.array(v), qtype), qtype))
               for k, v in model.parameters().items() if v.ndim == 2}  # type: ignore[attr-defined]
        model.update(new)  # type: ignore[attr-defined]
    return patch


@pytest.mark.parametrize("arch,qtype", [*((a, Q.Q8_0) for a in ARCHS), ("llama", Q.Q4_0), ("llama", Q.Q4_1),
                                        ("gemma3", Q.Q4_0), ("qwen2", Q.Q4_1)])
def test_quantized_exports_stay_quantized(arch: str, qtype: Q, tiny: dict[str, Path], export: Callable[..., Path]) -> None:
    path = export(arch, qtype)
    bits = 8 if qtype == Q.Q8_0 else 4
    got = logits(path, dtype="float32")  # as the reference computes (float16 by default: test_gguf_dtype.py)
    np.testing.assert_allclose(got, logits(tiny[arch], _dequantized_reference(qtype)), atol=QUANT_ATOL, rtol=0)
    if qtype == Q.Q8_0:
        np.testing.assert_allclose(got, logits(tiny[arch]), atol=Q8_0_VS_ORIGINAL, rtol=0)
    with load_weights_and_config(path) as loaded:
        assert (loaded.quant_bits, loaded.quant_group) == (bits, 32)
        layer = loaded.model.layers[1]
        for module in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.mlp.down_proj):
            assert isinstance(module, nn.QuantizedLinear) and (module.bits, module.group_size) == (bits, 32)
        assert isinstance(loaded.model.model.embed_tokens, nn.QuantizedEmbedding)


def test_mixed_types_quantize_per_layer(tiny: dict[str, Path], tmp_path: Path) -> None:
    path = export_gguf(tiny["llama"], tmp_path / "mixed.gguf", Q.Q4_0,
                       extra_types={"output.weight": Q.Q8_0, "blk.1.ffn_down.weight": Q.F16})
    with load_weights_and_config(path) as loaded:
        assert loaded.quant_bits == 4
        assert loaded.model.lm_head.bits == 8
        assert isinstance(loaded.model.layers[1].mlp.down_proj, nn.Linear)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_K])
def test_a_matrix_of_the_wrong_width_is_refused(qtype: Q, tmp_path: Path) -> None:
    """A repacked matrix with half the model's inputs used to load as another bit width (Q8_0 as 4
    bits, Q4_0 as 2: garbage, no error) or fail at run time (MLX's group size error): its packed
    shape is now checked against the model's at the layer's own bits, naming the file and tensor."""
    from safetensors.numpy import load_file, save_file

    model = write_tiny_model(tmp_path / "hf", "llama", seed=3, hidden_size=512, intermediate_size=512)
    shards = list(model.glob("*.safetensors"))
    tensors = {k: v for shard in shards for k, v in load_file(shard).items()}
    name = "model.layers.1.self_attn.v_proj.weight"
    tensors[name] = np.ascontiguousarray(tensors[name][:, :256])
    for shard in shards:
        shard.unlink()
    save_file(tensors, model / "model.safetensors")
    path = export_gguf(model, tmp_path / "narrow-v.gguf", qtype)
    with pytest.raises(GGUFError, match=rf"{path}: tensor '{name}' has shape .* the model expects .*"
                                        r"\(GGUF tensor 'blk.1.attn_v.weight'\)"):
        load_weights_and_config(path)


@pytest.mark.parametrize("head_dim", [16, 64])  # one, and several, pairs in Llama 3's blend band
def test_llama3_rope_scaling_from_rope_freqs(head_dim: int, tmp_path: Path) -> None:
    src = write_tiny_model(tmp_path / "l3", "llama", rope_scaling=LLAMA3_ROPE_SCALING, extra_config={"head_dim": head_dim})
    path = export_gguf(src, tmp_path / "l3.gguf")
    assert gguf_config(read_gguf(path))["rope_scaling"]["rope_type"] == "llama3"
    np.testing.assert_allclose(logits(path), logits(src), atol=1e-4, rtol=0)


def test_load_model_end_to_end(tiny: dict[str, Path], export: Callable[..., Path], tmp_path: Path) -> None:
    folder = tmp_path / "one"
    folder.mkdir()
    shutil.copy(export("qwen3"), folder / "model.gguf")
    with pymlxc.load_model(str(tiny["qwen3"]), backend="metal") as ref, \
            pymlxc.load_model(str(folder), backend="metal") as model:  # a folder with one GGUF file
        assert model.info() == ref.info()
        for call in (lambda m: m.generate("Once upon a time", max_tokens=12),
                     lambda m: m.chat([{"role": "user", "content": "What is two plus two?"}], max_tokens=12)):
            assert [t.id for t in call(model)] == [t.id for t in call(ref)]
    with pymlxc.load_model(str(export("llama", Q.Q4_0)), backend="metal") as model:  # the file itself
        info = model.info()
        assert (info.architecture, info.quant_bits, info.quant_group) == ("llama", 4, 32)
        assert len(list(model.generate("hi", max_tokens=4))) == 4


def test_folder_with_several_gguf_files_is_an_error(export: Callable[..., Path], tmp_path: Path) -> None:
    for name in ("a.gguf", "b.gguf", "mmproj-f16.gguf"):
        shutil.copy(export("llama"), tmp_path / name)
    with pytest.raises(GGUFError, match=r"2 GGUF files.*a\.gguf, b\.gguf"):
        pymlxc.load_model(str(tmp_path), backend="metal")
    (tmp_path / "b.gguf").unlink()
    assert find_gguf(tmp_path) == tmp_path / "a.gguf"  # a vision projector is not a second model


def test_safetensors_folder_is_not_taken_for_gguf(tiny: dict[str, Path], export: Callable[..., Path], tmp_path: Path) -> None:
    folder = tmp_path / "both"
    shutil.copytree(tiny["llama"], folder)
    shutil.copy(export("qwen3"), folder / "other.gguf")
    assert find_gguf(folder) is None
    with load_weights_and_config(folder) as loaded:
        assert loaded.model_type == "llama"


def test_discover_reports_gguf_quantization(export: Callable[..., Path], tmp_path: Path) -> None:
    for name, arch, qtype in (("a", "llama", Q.Q4_0), ("b", "gemma3", Q.Q8_0), ("c", "qwen2", Q.F16)):
        (tmp_path / name).mkdir()
        shutil.copy(export(arch, qtype), tmp_path / name / "model.gguf")
    found = {m.path.name: (m.format, m.model_type, m.quant_bits, m.quant_group) for m in pymlxc.discover(tmp_path)}
    assert found == {"a": ("gguf", "llama", 4, 32), "b": ("gguf", "gemma3_text", 8, 32), "c": ("gguf", "qwen2", 0, 0)}
    assert describe_gguf(tmp_path / "a" / "model.gguf") == ("llama", 4, 32)
    # A folder of several GGUF files lists each file, by the path that loads it (the folder does not).
    shutil.copy(export("qwen2", Q.Q8_0), tmp_path / "a" / "other.gguf")
    listed = sorted((m.path, m.model_type) for m in pymlxc.discover(tmp_path / "a"))
    assert listed == [(tmp_path / "a" / "model.gguf", "llama"), (tmp_path / "a" / "other.gguf", "qwen2")]
    with pymlxc.load_model(str(listed[1][0]), backend="metal") as m:
        assert m.info().architecture == "qwen2" and m.info().quant_bits == 8


# ---------------------------------------------------------------------- tokenizer

@pytest.mark.parametrize("arch", ARCHS)
def test_tokenizer_from_metadata_encodes_like_the_original(arch: str, tiny: dict[str, Path], export: Callable[..., Path]) -> None:
    path = export(arch)
    assert not (path.parent / "tokenizer.json").exists()
    ours = load_gguf_tokenizer(path, read_gguf(path), arch)
    ref = Tokenizer(tiny[arch])
    for text in SAMPLES:
        for special in (True, False):
            assert ours.encode(text, special) == ref.encode(text, special), (text, special)
        ids = ref.encode(text)
        assert ours.decode(ids) == ref.decode(ids)
    assert ours.bos_token_id == ref.bos_token_id
    assert ours.eos_token_ids == ref.eos_token_ids
    assert ours.chat_template == ref.chat_template


@pytest.mark.parametrize("pre,pattern,ignore_merges", [
    ("llama-bpe", r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+", True),
    ("qwen2", r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+", False),
])
def test_pre_tokenizer_patterns(pre: str, pattern: str, ignore_merges: bool, tiny: dict[str, Path], tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(tiny["qwen2"], src)
    data = json.loads((src / "tokenizer.json").read_text())
    data["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]}
    data["model"]["ignore_merges"] = ignore_merges
    (src / "tokenizer.json").write_text(json.dumps(data))
    (tmp_path / "out").mkdir()
    path = export_gguf(src, tmp_path / "out" / "m.gguf", pre=pre)
    ours, ref = load_gguf_tokenizer(path, read_gguf(path), "qwen2"), Tokenizer(src)
    for text in [*SAMPLES, "12345 x 2024, 3.14159!!\r\n\n  end"]:
        # without BOS: llama.cpp adds one for llama-bpe files that do not say (this one does not), HF does not
        assert ours.encode(text, False) == ref.encode(text, False), text


def test_tokenizer_json_beside_the_file_wins(tiny: dict[str, Path], export: Callable[..., Path], tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    shutil.copy(export("qwen3"), path)
    other = write_tiny_model(tmp_path / "other", "qwen3", seed=3, vocab_size=300)
    shutil.copy(other / "tokenizer.json", tmp_path / "tokenizer.json")
    ours, ref = load_gguf_tokenizer(path, read_gguf(path), "qwen3"), Tokenizer(other)
    assert ours.encode(CORPUS) == ref.encode(CORPUS) != Tokenizer(tiny["qwen3"]).encode(CORPUS)
    assert ours.chat_template == ref.chat_template  # from the GGUF, no tokenizer_config.json here


@pytest.mark.parametrize("add_space_prefix", [True, False])
def test_sentencepiece_tokenizer_from_scores(add_space_prefix: bool, tmp_path: Path) -> None:
    spm = pytest.importorskip("sentencepiece")
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS.splitlines() * 3), model_prefix=str(tmp_path / "tokenizer"), vocab_size=520,
        model_type="bpe", byte_fallback=True, character_coverage=0.98, normalization_rule_name="identity",
        remove_extra_whitespaces=False, add_dummy_prefix=add_space_prefix, user_defined_symbols=["<start_of_turn>"],
        minloglevel=2)
    proc = spm.SentencePieceProcessor(model_file=str(tmp_path / "tokenizer.model"))
    (tmp_path / "out").mkdir()
    path = write_spm_gguf(tmp_path / "out" / "t.gguf", tmp_path, add_space_prefix=add_space_prefix,
                          user_defined=["<start_of_turn>"])
    tok = load_gguf_tokenizer(path, read_gguf(path), "llama")
    texts = [*CORPUS.splitlines(), CORPUS, "  two  spaces", " leading", "x<start_of_turn>", "ß 😀 乾坤 \x07", ""]
    for text in texts:
        assert tok.encode(text, add_special_tokens=False) == proc.encode(text), text
        assert tok.decode(proc.encode(text)) == proc.decode(proc.encode(text))
    assert tok.encode("hi")[0] == proc.bos_id()  # add_bos_token
    assert proc.eos_id() in tok.eos_token_ids


def test_unsupported_tokenizers_name_the_fix(tiny: dict[str, Path], tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    path = export_gguf(tiny["qwen2"], tmp_path / "a" / "m.gguf", pre="tekken")
    with pytest.raises(GGUFError, match="tekken.*tokenizer.json beside"):
        pymlxc.load_model(str(path), backend="metal")
    (tmp_path / "b").mkdir()
    path = export_gguf(tiny["qwen2"], tmp_path / "b" / "m.gguf", tokenizer=False)
    with pytest.raises(GGUFError, match="no tokenizer"):
        pymlxc.load_model(str(path), backend="metal")


# ---------------------------------------------------------------------- malformed files

def _field_offset(path: Path, key: str) -> int:
    """Offset of the value of metadata `key` (after its key string and type)."""
    field = gguf.GGUFReader(path).fields[key]
    return field.offset + 8 + len(key.encode()) + 4


def _patched(src: Path, dst: Path, offset: int, fmt: str, value: int) -> Path:
    data = bytearray(src.read_bytes())
    struct.pack_into(fmt, data, offset, value)
    dst.write_bytes(bytes(data))
    return dst


@pytest.fixture(scope="module")
def small(export: Callable[..., Path]) -> Path:
    return export("llama", Q.Q8_0)


@pytest.mark.parametrize("fraction", [0.0, 0.001, 0.01, 0.05, 0.2, 0.5, 0.9, 0.999])
def test_truncated_files(fraction: float, small: Path, tmp_path: Path) -> None:
    data = small.read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[: int(len(data) * fraction)])
    with pytest.raises(GGUFError, match="truncated|not a GGUF file|corrupt|past the end|cannot fit"):
        pymlxc.load_model(str(path), backend="metal")


def test_bad_magic_and_version(small: Path, tmp_path: Path) -> None:
    data = bytearray(small.read_bytes())
    (tmp_path / "magic.gguf").write_bytes(b"GGML" + data[4:])
    with pytest.raises(GGUFError, match="not a GGUF file"):
        read_gguf(tmp_path / "magic.gguf")
    with pytest.raises(GGUFError, match="version 7"):
        read_gguf(_patched(small, tmp_path / "v.gguf", 4, "<I", 7))
    with pytest.raises(GGUFError, match="big-endian"):
        read_gguf(_patched(small, tmp_path / "be.gguf", 4, ">I", 3))


@pytest.mark.parametrize("offset,what", [(8, "tensors"), (16, "metadata entries")])
@pytest.mark.parametrize("count", [2**63, 2**40, 10**6])
def test_absurd_counts(offset: int, what: str, count: int, small: Path, tmp_path: Path) -> None:
    with pytest.raises(GGUFError, match=f"{what}.*cannot fit"):
        read_gguf(_patched(small, tmp_path / "n.gguf", offset, "<Q", count))


@pytest.mark.parametrize("length", [2**64 - 1, 2**62, 10**9, 10**6])
def test_absurd_string_lengths(length: int, small: Path, tmp_path: Path) -> None:
    key = _patched(small, tmp_path / "key.gguf", 24, "<Q", length)  # the first key's length
    with pytest.raises(GGUFError, match="claims"):
        read_gguf(key)
    value = _field_offset(small, "general.architecture")  # a string value's length
    with pytest.raises(GGUFError, match="claims"):
        read_gguf(_patched(small, tmp_path / "value.gguf", value, "<Q", length))
    element = _field_offset(small, "tokenizer.ggml.tokens") + 12  # the first token's length
    with pytest.raises(GGUFError, match="claims|past the end"):
        read_gguf(_patched(small, tmp_path / "element.gguf", element, "<Q", length))


@pytest.mark.parametrize("key", ["tokenizer.ggml.tokens", "tokenizer.ggml.token_type"])
@pytest.mark.parametrize("length", [2**64 - 1, 2**40, 2**24 + 1])
def test_absurd_array_lengths(key: str, length: int, small: Path, tmp_path: Path) -> None:
    with pytest.raises(GGUFError, match="claims|past the end"):
        read_gguf(_patched(small, tmp_path / "a.gguf", _field_offset(small, key) + 4, "<Q", length))


def test_bad_value_and_tensor_types(small: Path, tmp_path: Path) -> None:
    tokens = _field_offset(small, "tokenizer.ggml.tokens")
    with pytest.raises(GGUFError, match="nested arrays"):
        read_gguf(_patched(small, tmp_path / "nested.gguf", tokens, "<I", int(gguf.GGUFValueType.ARRAY)))
    with pytest.raises(GGUFError, match="unknown value type"):
        read_gguf(_patched(small, tmp_path / "vt.gguf", tokens, "<I", 99))
    with pytest.raises(GGUFError, match="malformed"):
        read_gguf(_patched(small, tmp_path / "kt.gguf", _field_offset(small, "general.architecture") - 4, "<I", 77))
    reader = gguf.GGUFReader(small)
    info = reader.tensors[0].field  # name, n_dims, dims, type, offset
    type_offset = info.offset + 8 + len(reader.tensors[0].name.encode()) + 4 + 8 * len(reader.tensors[0].shape)
    with pytest.raises(GGUFError, match="malformed"):
        read_gguf(_patched(small, tmp_path / "tt.gguf", type_offset, "<I", 99))
    with pytest.raises(GGUFError, match="past the end|truncated"):
        read_gguf(_patched(small, tmp_path / "off.gguf", type_offset + 4, "<Q", 2**50))
    dims_offset = info.offset + 8 + len(reader.tensors[0].name.encode())
    with pytest.raises(GGUFError, match="truncated|invalid shape|past the end|corrupt"):
        read_gguf(_patched(small, tmp_path / "nd.gguf", dims_offset, "<I", 2**31))


def test_unsupported_tensor_type_names_tensor_and_type(tiny: dict[str, Path], tmp_path: Path) -> None:
    path = tmp_path / "k.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("blk.0.attn_q.weight", np.zeros((64, 66), np.uint8), raw_dtype=Q.IQ2_XXS)
    w.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    for step in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        step()
    with pytest.raises(GGUFError, match=r"blk\.0\.attn_q\.weight \(IQ2_XXS\).*supported: F32, F16, BF16, Q4_0, .*Q6_K; "
                                        r"re-quantize it with llama-quantize to Q4_K_M"):
        pymlxc.load_model(str(path), backend="metal")
    assert describe_gguf(path) == ("llama", 2, 256)  # discover still reports it


@pytest.mark.parametrize("tensor", ["blk.0.attn_norm.weight", "output_norm.weight"])
def test_a_quantized_norm_is_named(tensor: str, tiny: dict[str, Path], tmp_path: Path) -> None:
    """llama.cpp quantizes the layers' matrices only. A norm stored as Q8_0 (its values as one row
    or as a vector) was taken for a quantized layer: 'quantization declared, but not quantized'."""
    path = export_gguf(tiny["llama"], tmp_path / "n.gguf", Q.F32, extra_types={tensor: Q.Q8_0})
    with pytest.raises(GGUFError, match=rf"tensor '{tensor}' is a (vector|norm) stored as Q8_0; only the layers'"):
        load_weights_and_config(path)


def test_a_nan_is_named_as_such(tiny: dict[str, Path], tmp_path: Path) -> None:
    from safetensors.numpy import load_file, save_file

    model = Path(shutil.copytree(tiny["llama"], tmp_path / "m"))
    tensors = load_file(model / "model.safetensors")
    tensors["model.norm.weight"][3] = np.nan
    save_file(tensors, model / "model.safetensors")
    path = export_gguf(model, tmp_path / "nan.gguf", Q.F32)
    with pytest.raises(GGUFError, match="tensor 'output_norm.weight' holds NaN values"):
        load_weights_and_config(path, dtype="float16")


def test_metadata_must_match_the_tensors(small: Path, tmp_path: Path) -> None:
    with pytest.raises(GGUFError, match="block_count is 100000000"):
        pymlxc.load_model(str(_patched(small, tmp_path / "b.gguf", _field_offset(small, "llama.block_count"), "<I",
                                       100_000_000)), backend="metal")
    with pytest.raises(GGUFError, match="metadata implies"):
        pymlxc.load_model(str(_patched(small, tmp_path / "f.gguf", _field_offset(small, "llama.feed_forward_length"),
                                       "<I", 1 << 30)), backend="metal")
    data = bytearray(small.read_bytes())
    arch = _field_offset(small, "general.architecture")
    data[arch + 8: arch + 13] = b"phi3x"
    (tmp_path / "a.gguf").write_bytes(bytes(data))
    with pytest.raises(GGUFError, match="'phi3x' is not supported; supported: llama, qwen2, qwen3, qwen2moe, qwen3moe, "
                                        "gemma2, gemma3, gemma4"):
        pymlxc.load_model(str(tmp_path / "a.gguf"), backend="metal")


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_mutated_files_fail_cleanly(data: st.DataObject, small: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Random truncations and overwritten header bytes: GGUFError, or a file the loader reads safely."""
    raw = bytearray(small.read_bytes())
    header_end = gguf.GGUFReader(small).data_offset
    if data.draw(st.booleans(), "truncate"):
        raw = raw[: data.draw(st.integers(0, len(raw) - 1), "cut")]
    else:
        for _ in range(data.draw(st.integers(1, 4), "edits")):
            at = data.draw(st.integers(0, header_end - 8), "at")
            value = data.draw(st.sampled_from([0, 1, 9, 30, 99, 2**31, 2**32 - 1, 2**63, 2**64 - 1]), "value")
            fmt = data.draw(st.sampled_from(["<B", "<I", "<Q"]), "fmt")
            struct.pack_into(fmt, raw, at, value % (1 << (8 * struct.calcsize(fmt))))
    path = tmp_path_factory.mktemp("fuzz") / "m.gguf"
    path.write_bytes(bytes(raw))
    try:
        read_gguf(path)
    except GGUFError:
        return
    try:  # a file that passes the checks loads, or is refused with a ValueError naming what is wrong
        with load_weights_and_config(path) as loaded:
            mx.eval(loaded.model(mx.array([[1, 2]])))
    except ValueError as exc:
        assert str(path) in str(exc) or "tensor" in str(exc), exc

"""benchmarks/compare_llama_cpp.py on the CPU: the byte-level vocabulary it writes tokenizes the same
in Hugging Face's tokenizers, llama.cpp (llama-cpp-python, vocab_only, in a child process) and
pymlxc's GGUF tokenizer; a whole run (pymlxc only, tiny shape) writes a JSON report and a table
with every side's numbers; the bytes a decode step reads leave out an untied embedding table."""
from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from pymlxc.backends.metal.formats.gguf import read_gguf
from pymlxc.backends.metal.tokenizer import load_gguf_tokenizer
from pymlxc.testing import shapes, write_tiny_model
from pymlxc.testing_gguf import export_gguf

from .gguf_vocab import LlamaCppVocab

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))
import compare_llama_cpp  # noqa: E402 - a benchmark script, importable from its folder

TEXTS = ["Hello world, this is a test.", "  spaces\tand\nnewlines  ", "digits 1234567 and 3.14",
         "ünïcödé ✓ 🙂", "it's they're I'M", ""]


@pytest.fixture(autouse=True)
def _quiet() -> None:
    warnings.simplefilter("ignore", DeprecationWarning)


@pytest.fixture(scope="module")
def narrow_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("narrow")
    src = shapes.write_random_model(root / "src", "llama-3.2-1b-narrow", layers=1, dtype="float16")
    shapes.write_byte_tokenizer(src, shapes.shape_config("llama-3.2-1b-narrow", 1))
    return src, export_gguf(src, root / "m.gguf", Q.Q8_0, pre="gpt-2")


def test_vocabulary_tokenizes_alike_in_hf_llama_cpp_and_pymlxc(narrow_gguf: tuple[Path, Path]) -> None:
    from tokenizers import Tokenizer

    src, path = narrow_gguf
    hf = Tokenizer.from_file(str(src / "tokenizer.json"))
    assert hf.get_vocab_size() == 8192 and hf.token_to_id("<|begin_of_text|>") == 1
    ours = load_gguf_tokenizer(path, read_gguf(path), None)
    ref = LlamaCppVocab(path)
    try:
        for text in TEXTS:
            want = hf.encode(text, add_special_tokens=False).ids
            assert ref.tokenize(text, False) == want, text
            assert ours.encode(text, False) == want, text
        assert ref.tokenize("<|begin_of_text|>x", False)[0] == 1  # the special id stays where the config put it
    finally:
        ref.close()


def test_bytes_a_decode_step_reads(narrow_gguf: tuple[Path, Path], tmp_path: Path) -> None:
    """Tied: the head reads the whole table. Untied: a step reads one row of the embedding, so its
    table is left out."""
    from gguf import GGUFReader

    _, tied = narrow_gguf
    total, per_token = compare_llama_cpp.gguf_tensor_bytes(tied)
    assert per_token == total > 0
    untied = export_gguf(write_tiny_model(tmp_path / "hf", "llama", hidden_size=256, intermediate_size=256),
                         tmp_path / "u.gguf", Q.Q8_0)
    sizes = {t.name: int(t.n_bytes) for t in GGUFReader(str(untied)).tensors}
    total_u, per_token_u = compare_llama_cpp.gguf_tensor_bytes(untied)
    assert "output.weight" in sizes and total_u == sum(sizes.values())
    assert per_token_u == total_u - sizes["token_embd.weight"]


def test_a_cpu_run_writes_the_report(tmp_path: Path) -> None:
    out = tmp_path / "out"
    rc = compare_llama_cpp.main(["--cpu", "--shapes", "llama-3.2-1b-narrow", "--layers", "1", "--no-llama-cpp",
                                 "--prompt-lengths", "8", "--max-tokens", "4", "--rounds", "1", "--formats", "q4_0",
                                 "q6_k", "--models-dir", str(tmp_path / "models"), "--out", str(out), "--drop-source"])
    assert rc == 0
    report = json.loads((out / "compare_llama_cpp.json").read_text())
    assert [c["format"] for c in report["cases"]] == ["q4_0", "q6_k"]
    for case in report["cases"]:
        assert set(case["sides"]) == {"pymlxc_gguf", "pymlxc_native"}
        assert case["generated"] == {"pymlxc_gguf": 4, "pymlxc_native": 4}
        for side in case["sides"].values():
            assert side["8"]["decode_tps"] > 0 and side["8"]["prefill_tps"] > 0
        # kept quantized: at most 1.12x the file's tensor bytes (docs/gguf.md)
        assert case["memory_after_load"]["pymlxc_gguf"] <= 1.12 * case["gguf_tensor_bytes"]
    table = (out / "compare_llama_cpp.md").read_text()
    assert table.count("| llama-3.2-1b-narrow (1 layers) |") == 2
    assert not (tmp_path / "models" / "llama-3.2-1b-narrow-1l-f16-src").exists()  # --drop-source
    assert np.isfinite(report["bandwidth"]["copy_bytes_per_s"])


_QUANTIZE = r"""
import ctypes, sys
import llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(params)))
"""


def test_the_q4_k_m_layer_mix_is_llama_cpps(tmp_path: Path) -> None:
    """`q4_k_m_layer_types` (the Q4_K_M-like files written without llama-quantize) names the value
    and down projections that llama.cpp's own quantizer (llama-cpp-python's llama_model_quantize, in
    a child process) stores as Q6_K in a Q4_K_M file of 16 layers; the others it stores as Q4_K."""
    import subprocess

    from gguf import GGUFReader

    layers = 16
    src = shapes.write_random_model(tmp_path / "src", "llama-3.2-1b-narrow", layers=layers, dtype="float16")
    shapes.write_byte_tokenizer(src, shapes.shape_config("llama-3.2-1b-narrow", layers))
    f16 = export_gguf(src, tmp_path / "f16.gguf", Q.F16, pre="gpt-2")
    out = tmp_path / "q4_k_m.gguf"
    done = subprocess.run([sys.executable, "-c", _QUANTIZE, str(f16), str(out)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    types = {t.name: Q(t.tensor_type) for t in GGUFReader(out).tensors
             if t.name.endswith((".attn_v.weight", ".ffn_down.weight"))}
    assert len(types) == 2 * layers
    want = compare_llama_cpp.q4_k_m_layer_types(layers)
    assert 0 < len(want) < len(types)
    assert {name for name, t in types.items() if t == Q.Q6_K} == set(want)
    assert {t for name, t in types.items() if name not in want} == {Q.Q4_K}


def test_the_q4_k_m_native_checkpoint_has_the_recipes_bit_widths(tmp_path: Path) -> None:
    """The native checkpoint a Q4_K_M file is compared with is quantized at 6 bits exactly where the
    recipe has Q6_K (the value and down projections `q4_k_m_layer_types` names, and the tied
    embedding that is the head) and at 4 bits elsewhere; it loads with those widths, and a module the
    model does not have is refused by name."""
    from pymlxc.backends.metal.loader import load_weights_and_config

    layers = 16
    config = shapes.shape_config("llama-3.2-1b-narrow", layers)
    six = compare_llama_cpp.q4_k_m_native_bits(config)
    gguf_names = {f"blk.{i}.{'attn_v' if 'v_proj' in m else 'ffn_down'}.weight"
                  for m in six if m.startswith("model.layers.")
                  for i in [int(m.split(".")[2])]}
    assert gguf_names == set(compare_llama_cpp.q4_k_m_layer_types(layers))
    assert "model.embed_tokens" in six and set(six.values()) == {6}
    path = shapes.write_random_model(tmp_path / "mix", "llama-3.2-1b-narrow", bits=4, layers=layers,
                                     module_bits=six)
    loaded = load_weights_and_config(path)
    try:
        model: Any = loaded.model
        widths = {f"model.layers.{i}.{name}": getattr(getattr(block, part), proj).bits
                  for i, block in enumerate(model.layers)
                  for name, part, proj in (("self_attn.v_proj", "self_attn", "v_proj"),
                                           ("self_attn.q_proj", "self_attn", "q_proj"),
                                           ("mlp.down_proj", "mlp", "down_proj"), ("mlp.up_proj", "mlp", "up_proj"))}
        assert {m for m, b in widths.items() if b == 6} == {m for m in six if m.startswith("model.layers.")}
        assert {b for m, b in widths.items() if m not in six} == {4}
        assert model.model.embed_tokens.bits == 6
    finally:
        loaded.close()
    with pytest.raises(ValueError, match="model.layers.99.mlp.down_proj"):
        shapes.write_random_model(tmp_path / "bad", "llama-3.2-1b-narrow", bits=4, layers=2,
                                  module_bits={"model.layers.99.mlp.down_proj": 6})

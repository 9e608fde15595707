"""A GGUF vocabulary that gives one text two ids (`tokenizer.ggml.tokens`) is refused at load, naming
the file, the key, the token and both ids. It used to load, encoding the text as its first id;
llama.cpp stops on such a file for every tokenizer model (llama-vocab.cpp: GGML_ASSERT(
id_to_token.size() == token_to_id.size()) aborts, newer versions throw "duplicate token in
vocabulary"), and reads an empty token as "[EMPTY_<id>]", so empty tokens are no repeat. Each case is
also handed to llama.cpp itself (llama-cpp-python, in a child process, as an abort would end this one)
to check that both refuse the same files."""
from __future__ import annotations

import shutil
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import pytest
from gguf import GGMLQuantizationType as Q

from pymlxc.backends.metal.formats.gguf import GGUFError
from pymlxc.backends.metal.loader import load_gguf_model
from pymlxc.testing import write_tiny_model

from .gguf_export import export_gguf
from .test_gguf_hostile import DELETE, rewrite

LONG = "x" * 200
# name -> (the change to the token list, given two ids a < b of tokens no merge uses;
#          the ids named as a repeat, None where the file loads)
Change = Callable[[list[str], int, int], tuple[dict[int, str], tuple[int, int] | None]]
CASES: dict[str, Change] = {
    "no repeat": lambda t, a, b: ({}, None),
    "normal token": lambda t, a, b: ({b: t[a]}, (a, b)),
    "control token": lambda t, a, b: ({1: t[0]}, (0, 1)),
    "long token": lambda t, a, b: ({a: LONG, b: LONG}, (a, b)),
    "two empty tokens": lambda t, a, b: ({a: "", b: ""}, None),  # "[EMPTY_a]" and "[EMPTY_b]" in llama.cpp
    "an empty token's llama.cpp name": lambda t, a, b: ({a: f"[EMPTY_{b}]", b: ""}, (a, b)),
}
MODELS = ("gpt2", "llama")  # llama.cpp's BPE and SPM


@pytest.fixture(autouse=True)
def _quiet() -> None:
    warnings.simplefilter("ignore", DeprecationWarning)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("vocab")
    (root / "gguf").mkdir()
    return export_gguf(write_tiny_model(root / "llama", "llama", seed=5), root / "gguf" / "llama.gguf", Q.F32)


def _variant(llama: Path, out: Path, case: str, model: str) -> tuple[Path, list[str], tuple[int, int] | None]:
    """(file, its tokens, the repeat expected) of `case` for tokenizer `model`. The ids changed are
    normal tokens no merge uses, so the file differs from the export only in the case's change."""
    reader = gguf.GGUFReader(llama)
    tokens: list[str] = reader.fields["tokenizer.ggml.tokens"].contents()
    types: list[int] = reader.fields["tokenizer.ggml.token_type"].contents()
    used: set[str] = set()
    for merge in reader.fields["tokenizer.ggml.merges"].contents():
        left, right = merge.split(" ", 1)
        used |= {left, right, left + right}
    a, b = [i for i, (t, k) in enumerate(zip(tokens, types, strict=True)) if k == 1 and t not in used][:2]
    change, repeat = CASES[case](tokens, a, b)
    tokens = [change.get(i, t) for i, t in enumerate(tokens)]
    changes: dict[str, Any] = {"tokenizer.ggml.tokens": tokens}
    if model == "llama":  # SentencePiece: scores instead of merges
        changes.update({"tokenizer.ggml.model": "llama", "tokenizer.ggml.merges": DELETE,
                        "tokenizer.ggml.scores": [float(-i) for i in range(len(tokens))]})
    return rewrite(llama, out, changes), tokens, repeat


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("case", CASES)
def test_a_repeated_token_is_refused_naming_file_key_token_and_ids(case: str, model: str, llama: Path,
                                                                  tmp_path: Path) -> None:
    path, tokens, repeat = _variant(llama, tmp_path / "v.gguf", case, model)
    if repeat is None:
        tokenizer, loaded = load_gguf_model(path)
        loaded.free()
        if case == "no repeat" and model == "gpt2":
            a = next(i for i, t in enumerate(tokens) if t == "!")
            assert tokenizer.encode("!", add_special_tokens=False) == [a]
        return
    first, second = repeat
    with pytest.raises(GGUFError) as info:
        load_gguf_model(path)
    message = str(info.value)
    shown = repr(LONG[:40]) + "... (200 characters)" if tokens[first] == LONG else repr(tokens[first])
    assert message.startswith(str(path))
    assert f"tokenizer.ggml.tokens repeats the token {shown}" in message
    assert f"at ids {first} and {second}" in message


def test_a_tokenizer_json_beside_the_file_still_loads_it(llama: Path, tmp_path: Path) -> None:
    """The way out that the message names: the model's own tokenizer replaces the vocabulary."""
    path, _, _ = _variant(llama, tmp_path / "v.gguf", "normal token", "gpt2")
    with pytest.raises(GGUFError, match="repeats the token"):
        load_gguf_model(path)
    shutil.copy(llama.parent.parent / "llama" / "tokenizer.json", tmp_path / "tokenizer.json")
    _, loaded = load_gguf_model(path)
    loaded.free()


_LLAMA_CPP = "import sys, llama_cpp; llama_cpp.Llama(model_path=sys.argv[1], vocab_only=True, verbose=True)"


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("case", CASES)
def test_llama_cpp_refuses_the_same_files(case: str, model: str, llama: Path, tmp_path: Path) -> None:
    """The cases above as llama.cpp reads them: it fails (an abort, or an exception in newer versions)
    on exactly the files refused here."""
    pytest.importorskip("llama_cpp")
    path, _, repeat = _variant(llama, tmp_path / "v.gguf", case, model)
    run = subprocess.run([sys.executable, "-c", _LLAMA_CPP, str(path)], capture_output=True, text=True, timeout=300,
                         check=False)
    assert (run.returncode == 0) == (repeat is None), run.stderr[-2000:]
    if repeat is not None:
        assert "token_to_id" in run.stderr or "duplicate token" in run.stderr, run.stderr[-2000:]

"""Tokenizers rebuilt from GGUF metadata give llama.cpp's token ids: each family's vocabulary style
(tests/metal/gguf_vocab.py) is tokenized by llama.cpp itself (llama-cpp-python, vocab_only) and by
ours, on fixed samples and on random text (unicode, combining marks, whitespace runs, digits,
contractions, special tokens)."""
from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import llama_cpp  # noqa: F401 - the reference tokenizer (the test extra); it runs in a child process
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pymlxc.backends.metal.formats.gguf import GGUFError, read_gguf
from pymlxc.backends.metal.formats.gguf_tokenizer import PRE_TOKENIZERS
from pymlxc.backends.metal.tokenizer import Tokenizer, load_gguf_tokenizer

from .gguf_vocab import (
    BPE_SPECIALS,
    CONTROL,
    GEMMA_SPECIALS,
    NORMAL,
    TEXT,
    LlamaCppVocab,
    byte_level_vocab,
    byte_pair_vocab,
    gemma4_vocab,
    sentencepiece_gguf,
    write_vocab_gguf,
)

BYTE_LEVEL = ("llama-bpe", "qwen2", "qwen35", "gpt-2", "default")
PAIRS = tuple(f"pairs-{pre}" for pre in BYTE_LEVEL)  # every byte pair merges: ids show each split boundary
VOCABS = (*BYTE_LEVEL, *PAIRS, "gemma4", "gemma4-as-gpt2", "spm", "spm-no-prefix")
SAMPLES = [
    *TEXT.splitlines(keepends=True), TEXT, "", " ", "\n", "  ", "\n\n\n\n\n\n", " \n \n", "\t\t x", "a  b   c    d",
    "I'M YOU'RE we'Ll it'S", "'s't're", "x'\u017ft",  # a long s is no contraction for llama.cpp
    "e\u0301\u0301 \u0915\u094d\u0937 \u0301lead", "\u00a0nbsp\u2003em\u3000ideo", "12345678901 3.14159 1,000,000",
    "🙂🙂 👍🏽 🇫🇷 \U0010fffd \ufeff\u200b", "\x00\x01\x7f control", "<|im_start|>user\nhi<|im_end|>\n",
    "<bos><start_of_turn>user\nHi!<end_of_turn>\n<start_of_turn>model\n", "<|turn>user\n  x<turn|>", "<h1>Title</h1>",
    "<think>\n\n</think>\n\n", "<|endoftext|><|endoftext|>", "trailing   ", "   leading", "a<|file_sep|>b",
]


@pytest.fixture(autouse=True)
def _quiet() -> None:
    warnings.simplefilter("ignore", DeprecationWarning)


def _write(name: str, root: Path) -> Path:
    """The GGUF file of vocabulary `name` (one of VOCABS) in `root`."""
    path = root / f"{name}.gguf"
    args: dict[str, Any]
    if name in BYTE_LEVEL:
        tokens, merges, types = byte_level_vocab(name)
        args = dict(model="gpt2", pre=name, tokens=tokens, merges=merges, types=types,
                          bos="<|endoftext|>", eos="<|im_end|>")
    elif name in PAIRS:
        tokens, merges, types = byte_pair_vocab()
        args = dict(model="gpt2", pre=name.removeprefix("pairs-"), tokens=tokens, merges=merges, types=types,
                    bos="<|endoftext|>", eos="<|im_end|>")
    elif name.startswith("gemma4"):
        tokens, merges, types = gemma4_vocab()
        # llama.cpp also runs Gemma 4's split for a "gpt2" model whose pre is "gemma4"
        args = dict(model="gpt2" if name == "gemma4-as-gpt2" else "gemma4", pre="gemma4", tokens=tokens,
                    merges=merges, types=types, bos="<bos>", eos="<eos>", unk="<unk>",
                    add_bos=False)  # llama.cpp adds BOS for Gemma 4 whatever the file says
    else:
        work = root / name
        work.mkdir()
        return sentencepiece_gguf(path, work, add_space_prefix=name == "spm")
    return write_vocab_gguf(path, **args)


class Pair:
    """Our tokenizer and llama.cpp's for one GGUF file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.ours: Tokenizer = load_gguf_tokenizer(path, read_gguf(path), None)
        self.ref = LlamaCppVocab(path)

    def check(self, text: str) -> None:
        for add_special in (True, False):
            want = self.ref.tokenize(text, add_special)
            assert self.ours.encode(text, add_special) == want, (self.path.name, text, add_special)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str], Pair]]:
    root = tmp_path_factory.mktemp("vocab")
    made: dict[str, Pair] = {}

    def get(name: str) -> Pair:
        if name not in made:
            made[name] = Pair(_write(name, root))
        return made[name]

    yield get
    for pair in made.values():
        pair.ref.close()


@pytest.mark.parametrize("name", VOCABS)
def test_samples_tokenize_as_llama_cpp(name: str, pairs: Callable[[str], Pair]) -> None:
    pair = pairs(name)
    for text in SAMPLES:
        pair.check(text)


_SPECIALS = sorted({*BPE_SPECIALS, *GEMMA_SPECIALS, "<h1>", "</h1>", "<start_of_image>"})
_PIECES = st.one_of(
    st.text(max_size=12),  # any code point but surrogates
    st.text(st.characters(categories=("L", "M", "N")), max_size=8),
    st.text(st.characters(categories=("Zs", "Cc", "P", "S")), max_size=6),
    st.sampled_from([" ", "  ", "\n", "\n\n", "\r\n", "\t", "   \n", "'s", "'LL", "'Re", "\u0301", "\u093f", "0",
                     "123", "9999", "é", "ß", "🙂", "中文", *_SPECIALS]),
)
TEXTS = st.lists(_PIECES, max_size=12).map("".join)


@pytest.mark.parametrize("name", VOCABS)
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=TEXTS)
def test_random_text_tokenizes_as_llama_cpp(name: str, text: str, pairs: Callable[[str], Pair]) -> None:
    pairs(name).check(text)


@pytest.mark.parametrize("pre", sorted((k for k in PRE_TOKENIZERS if k != "gemma4"), key=str))
def test_every_pre_tokenizer_name_splits_as_llama_cpp(pre: str | None, tmp_path: Path) -> None:
    """Each accepted byte-level tokenizer.ggml.pre value (None: the key is missing) on the byte-pair
    vocabulary, whose ids show every split boundary, with llama.cpp's BOS default for that name
    (gemma4's has its own vocabularies above)."""
    tokens, merges, types = byte_pair_vocab()
    path = write_vocab_gguf(tmp_path / "p.gguf", model="gpt2", pre=pre, tokens=tokens, merges=merges, types=types,
                            bos="<|endoftext|>", eos="<|im_end|>")
    pair = Pair(path)
    try:
        for text in SAMPLES:
            pair.check(text)
    finally:
        pair.ref.close()


def test_control_looking_tokens_are_special_and_end_generation(pairs: Callable[[str], Pair]) -> None:
    pair = pairs("qwen2")
    sep = BPE_SPECIALS.index("<|file_sep|>")  # a normal token in the file
    assert pair.ours.encode("a<|file_sep|>b", False) == pair.ref.tokenize("a<|file_sep|>b", False)
    assert sep in pair.ours.encode("a<|file_sep|>b", False)
    assert sep in pair.ours.eos_token_ids


def test_the_pre_tokenizer_name_decides_the_split(tmp_path: Path) -> None:
    """Qwen 3.5's split keeps combining marks with their letters; Qwen 2's does not. The same vocabulary
    under each name gives different ids in llama.cpp, and ours follows the name."""
    text = "\u0928\u092e\u0938\u094d\u0924\u0947 \u0926\u0941\u0928\u093f\u092f\u093e re\u0301sume\u0301"
    ids = {}
    for pre in ("qwen2", "qwen35"):
        tokens, merges, types = byte_level_vocab("qwen35")
        path = write_vocab_gguf(tmp_path / f"{pre}.gguf", model="gpt2", pre=pre, tokens=tokens, merges=merges,
                                types=types)
        pair = Pair(path)
        try:
            pair.check(text)
            ids[pre] = pair.ours.encode(text)
        finally:
            pair.ref.close()
    assert ids["qwen2"] != ids["qwen35"]


def test_gemma4_settings_follow_llama_cpp(pairs: Callable[[str], Pair]) -> None:
    pair = pairs("gemma4")
    bos = GEMMA_SPECIALS.index("<bos>")
    assert pair.ours.encode("hi")[0] == bos == pair.ref.tokenize("hi")[0]  # the file says add_bos false
    assert pair.ours.encode("hi", False)[0] != bos
    assert {GEMMA_SPECIALS.index("<eos>"), GEMMA_SPECIALS.index("<turn|>")} <= set(pair.ours.eos_token_ids)
    ids = pair.ours.encode("a\n\n\nb", False)
    assert "\n\n\n" in [pair.ours.decode([i]) for i in ids]  # a newline run that is a token is taken whole
    assert pair.ours.decode(pair.ours.encode(TEXT, False)) == TEXT


def test_gemma4_end_of_s_is_text_beside_a_tool_response_token(tmp_path: Path) -> None:
    """llama.cpp makes "</s>" plain text (and no stop) in a vocabulary with "<|tool_response>"; no merge
    builds "</s>", so text that is just "</s>" must be merged, not taken whole."""
    tokens, merges, types = gemma4_vocab()
    tokens += ["<|tool_response>", "</s>"]
    types += [CONTROL, CONTROL]
    path = write_vocab_gguf(tmp_path / "g.gguf", model="gemma4", tokens=tokens, merges=merges, types=types,
                            bos="<bos>", eos="<eos>")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        pair = Pair(path)
    try:
        for text in ("x</s>y<|tool_response>z", "a </s>\n\n</s>\n</s> b", "<|tool_response></s>", "</s>", "<0x41>"):
            pair.check(text)
        stops = set(pair.ours.eos_token_ids)
        assert len(tokens) - 2 in stops and len(tokens) - 1 not in stops
    finally:
        pair.ref.close()


def test_gemma4_vocabulary_no_setting_reproduces_warns(tmp_path: Path) -> None:
    """When the file's own merges join newlines but do not build its run tokens, runs cannot be cut
    apart safely; pieces that are tokens are then taken whole, which is wrong only for a piece that is
    a token no merge builds, and loading names them."""
    tokens, merges, types = gemma4_vocab()
    merges.append("\n\n \n\n")  # builds "\n\n\n\n" from "\n\n", which nothing builds
    tokens.append("\u2581the\u2581baker\u2581counted")  # no merge builds this
    types.append(NORMAL)
    path = write_vocab_gguf(tmp_path / "g.gguf", model="gemma4", tokens=tokens, merges=merges, types=types,
                            bos="<bos>", eos="<eos>")
    with pytest.warns(UserWarning, match=r"257 token\(s\) its merges cannot build"):
        pair = Pair(path)
    try:
        for text in ("a\n\nb\n\n\n\n\nc\n", "the baker counted\n\n\n", "x\n\u2581the\u2581baker\u2581countedy"):
            pair.check(text)
        line = "\n\u2581the\u2581baker\u2581counted\n"  # the stated exception
        assert pair.ours.encode(line, False) != pair.ref.tokenize(line, False)
    finally:
        pair.ref.close()


@pytest.mark.parametrize("model,pre,match", [
    ("gpt2", "tekken", r"pre-tokenizer 'tekken' \(tokenizer.ggml.pre\) is not supported.*qwen35"),
    ("gpt2", "chatglm-bpe", r"pre-tokenizer 'chatglm-bpe'.*tokenizer.json beside"),
    ("t5", None, r"tokenizer model 't5' \(tokenizer.ggml.model\) is not supported.*gemma4"),
])
def test_unreproducible_tokenizers_are_refused_by_name(model: str, pre: str | None, match: str, tmp_path: Path) -> None:
    tokens, merges, types = byte_level_vocab("gpt-2", vocab_size=300)
    path = write_vocab_gguf(tmp_path / "t.gguf", model=model, pre=pre, tokens=tokens, merges=merges, types=types)
    with pytest.raises(GGUFError, match=match):
        load_gguf_tokenizer(path, read_gguf(path), None)


@pytest.mark.parametrize("name", ["qwen2", "gemma4", "spm"])
def test_bos_and_eos_are_resolved_once_per_load(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The settings and the rebuilt pipeline's check both need the BOS/EOS ids: they used to be
    resolved from the metadata twice per load; now once, passed to both, with the same result."""
    from pymlxc.backends.metal.formats import gguf_tokenizer

    path = _write(name, tmp_path)
    reference = load_gguf_tokenizer(path, read_gguf(path), None)
    resolve = gguf_tokenizer._bos_eos
    calls: list[int] = []

    def counted(reader: Any, n: int) -> Any:
        calls.append(n)
        return resolve(reader, n)

    monkeypatch.setattr(gguf_tokenizer, "_bos_eos", counted)
    tok = load_gguf_tokenizer(path, read_gguf(path), None)
    assert len(calls) == 1
    assert (tok.bos_token, tok.eos_token_ids, tok.encode(TEXT)) == (
        reference.bos_token, reference.eos_token_ids, reference.encode(TEXT))


def test_malformed_merges_are_refused(tmp_path: Path) -> None:
    tokens, merges, types = byte_level_vocab("qwen2", vocab_size=300)
    path = write_vocab_gguf(tmp_path / "m.gguf", model="gpt2", pre="qwen2", tokens=tokens, merges=[*merges, "nospace"],
                            types=types)
    with pytest.raises(GGUFError, match="malformed merge 'nospace'"):
        load_gguf_tokenizer(path, read_gguf(path), None)
    assert CONTROL in types


def test_without_llama_cpps_unicode_tables_loading_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without unicodedata2 15.1 the split falls back on Oniguruma's newer tables: a letter added in
    Unicode 16 then splits otherwise than in llama.cpp, and loading warns instead of staying silent."""
    import sys

    from pymlxc.backends.metal.formats import gguf_tokenizer

    path = _write("pairs-qwen2", tmp_path)
    text = "A\U00013460:"  # U+13460: a letter since Unicode 16, unassigned in llama.cpp's tables
    pair = Pair(path)
    try:
        pair.check(text)
        monkeypatch.setitem(sys.modules, "unicodedata2", None)  # import unicodedata2 -> ImportError
        gguf_tokenizer._unicode_ranges.cache_clear()
        with pytest.warns(UserWarning, match=r"unicodedata2==15.1.0 is not installed.*Unicode 15.1.0"):
            fallback = load_gguf_tokenizer(path, read_gguf(path), None)
        assert fallback.encode(text) != pair.ref.tokenize(text)
    finally:
        pair.ref.close()
        gguf_tokenizer._unicode_ranges.cache_clear()


_VALUES = st.one_of(st.text(max_size=8), st.booleans(), st.integers(-2**31, 2**31 - 1),
                    st.floats(allow_nan=False, width=32),
                    st.lists(st.integers(0, 2**31 - 1), max_size=4), st.lists(st.text(max_size=6), max_size=4))


@settings(max_examples=60, deadline=None)
@given(key=st.sampled_from(["tokenizer.ggml.pre", "tokenizer.ggml.model", "tokenizer.ggml.merges",
                            "tokenizer.ggml.tokens",
                            "tokenizer.ggml.token_type", "tokenizer.ggml.scores", "tokenizer.ggml.add_bos_token",
                            "tokenizer.ggml.bos_token_id", "tokenizer.ggml.add_space_prefix"]),
       value=_VALUES, model=st.sampled_from(["gpt2", "gemma4", "llama"]))
def test_hostile_tokenizer_metadata_gives_gguf_error(key: str, value: object, model: str,
                                                    tmp_path_factory: pytest.TempPathFactory) -> None:
    """Any value of any type under a tokenizer key loads or raises GGUFError, never another exception."""
    tokens, merges, types = byte_level_vocab("gpt-2", vocab_size=300)
    fields = dict(model=model, pre="gpt-2", tokens=tokens, merges=merges, types=types, scores=[0.0] * len(tokens),
                  bos="<|endoftext|>", add_bos=True, add_space_prefix=True)
    name = {"tokenizer.ggml.pre": "pre", "tokenizer.ggml.model": "model", "tokenizer.ggml.merges": "merges",
            "tokenizer.ggml.tokens": "tokens",
            "tokenizer.ggml.token_type": "types", "tokenizer.ggml.scores": "scores",
            "tokenizer.ggml.add_bos_token": "add_bos", "tokenizer.ggml.bos_token_id": "bos",
            "tokenizer.ggml.add_space_prefix": "add_space_prefix"}[key]
    fields[name] = None if name in ("pre", "model", "add_bos", "add_space_prefix", "bos", "scores") else ()
    if name == "tokens":
        fields["bos"] = None
    path = tmp_path_factory.mktemp("hostile") / "h.gguf"
    try:
        write_vocab_gguf(path, **fields, extra={key: value})
    except (ValueError, TypeError, OverflowError):
        event("the gguf package does not write this value")  # e.g. an empty or mixed array
        return
    try:
        tok = load_gguf_tokenizer(path, read_gguf(path), None)
    except GGUFError:
        event("GGUFError")
        return
    event("loaded")
    tok.encode("hello world, 123 <|endoftext|>")

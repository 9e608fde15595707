"""Differential property tests: the tokenizer pymlxc rebuilds from a GGUF file's metadata against
llama.cpp's own tokenizer of the same file (llama-cpp-python, vocab_only, in a child process).

For each family fixture (tests/metal/gguf_vocab.py builds the vocabularies; Mistral's is built here)
random text of mixed scripts, emoji, combining marks, digit and whitespace runs, contractions and
special-token strings is encoded by both, with and without the special tokens the file asks for;
ids must be equal, and pymlxc's decode must give the text back where the family guarantees it. A
second test compares BOS/EOS handling with the file's add_bos/add_eos flags and its special-token
ids, present, absent or out of range.
"""
from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import llama_cpp  # noqa: F401 - the reference tokenizer (the test extra); it runs in a child process
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pymlxc.backends.metal.formats.gguf import GGUFError, read_gguf
from pymlxc.backends.metal.tokenizer import Tokenizer, load_gguf_tokenizer

from .gguf_vocab import (
    BPE_SPECIALS,
    BYTE,
    CONTROL,
    GEMMA_SPECIALS,
    NORMAL,
    TEXT,
    UNKNOWN,
    USER_DEFINED,
    LlamaCpp,
    byte_level_vocab,
    byte_pair_vocab,
    gemma4_vocab,
    sentencepiece_gguf,
    write_vocab_gguf,
)


@pytest.fixture(scope="module")
def llama() -> Iterator[LlamaCpp]:
    ref = LlamaCpp()
    yield ref
    ref.close()


@pytest.fixture(autouse=True)
def _quiet() -> None:
    warnings.simplefilter("ignore", DeprecationWarning)


# ---------------------------------------------------------------------- family fixtures

MISTRAL_CONTROL = ("[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]")
# Added tokens that are not special (Qwen 2.5's tool tags): llama.cpp's converter writes them
# USER_DEFINED, with their raw text.
QWEN_USER = ("<tool_call>", "</tool_call>")


def mistral_gguf(out: Path, work: Path, **flags: Any) -> Path:
    """A Llama 2 / Mistral-style vocabulary: SentencePiece BPE with byte fallback, <unk> <s> </s> as
    ids 0 1 2, control tokens [INST] and the like, a dummy space prefix (the key left out, as the
    converter does: llama.cpp's default is on)."""
    import sentencepiece as spm

    model = work / "tokenizer.model"
    if not model.exists():
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(TEXT.splitlines(keepends=True) * 4), model_prefix=str(work / "tokenizer"),
            vocab_size=520, model_type="bpe", byte_fallback=True, character_coverage=0.98,
            normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=True,
            split_digits=True, control_symbols=list(MISTRAL_CONTROL), unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
            allow_whitespace_only_pieces=True, minloglevel=2)
    proc = spm.SentencePieceProcessor(model_file=str(model))
    tokens, scores, types = [], [], []
    for i in range(proc.vocab_size()):
        tokens.append(proc.id_to_piece(i))
        scores.append(proc.get_score(i))
        types.append(BYTE if proc.is_byte(i) else UNKNOWN if proc.is_unknown(i) else
                     CONTROL if proc.is_control(i) else NORMAL)
    args: dict[str, Any] = dict(bos="<s>", eos="</s>", unk="<unk>", add_bos=True)
    args.update(flags)
    return write_vocab_gguf(out, model="llama", tokens=tokens, types=types, scores=scores, **args)


BYTE_LEVEL = ("llama-bpe", "qwen2", "qwen35", "gpt-2", "default")
FAMILIES = (*BYTE_LEVEL, "pairs-llama-bpe", "pairs-qwen2", "pairs-qwen35", "qwen2-user", "gemma4", "gemma3-spm",
            "spm-no-prefix", "mistral", "llama-bpe-no-ids", "mistral-no-ids")
SPM = ("gemma3-spm", "spm-no-prefix", "mistral")


def write_family(name: str, root: Path, **flags: Any) -> Path:
    """The GGUF file of family fixture `name` in `root`; `flags` override write_vocab_gguf's
    arguments (bos, eos, add_bos, extra...)."""
    suffix = "-".join(f"{k}={v}" for k, v in sorted(flags.items()) if k != "extra")
    suffix += "-".join(f"{k}={v}" for k, v in sorted(flags.get("extra", {}).items()))
    path = root / f"{name}{'-' + suffix if suffix else ''}.gguf".replace("/", "_")
    if path.exists():
        return path
    if name.endswith("-no-ids"):  # no bos_token_id / eos_token_id: llama.cpp's default ids apply
        return write_family(name.removesuffix("-no-ids"), root, **{**flags, "bos": None, "eos": None, "unk": None})
    args: dict[str, Any]
    if name in BYTE_LEVEL or name == "qwen2-user":
        tokens, merges, types = byte_level_vocab("qwen2" if name == "qwen2-user" else name)
        if name == "qwen2-user":
            tokens += list(QWEN_USER)
            types += [USER_DEFINED] * len(QWEN_USER)
        args = dict(model="gpt2", pre="qwen2" if name == "qwen2-user" else name, tokens=tokens, merges=merges,
                    types=types, bos="<|endoftext|>", eos="<|im_end|>")
    elif name.startswith("pairs-"):
        tokens, merges, types = byte_pair_vocab()
        args = dict(model="gpt2", pre=name.removeprefix("pairs-"), tokens=tokens, merges=merges, types=types,
                    bos="<|endoftext|>", eos="<|im_end|>")
    elif name == "gemma4":
        tokens, merges, types = gemma4_vocab()
        args = dict(model="gemma4", tokens=tokens, merges=merges, types=types, bos="<bos>", eos="<eos>", unk="<unk>")
    elif name == "mistral":
        work = root / "mistral-work"
        work.mkdir(exist_ok=True)
        return mistral_gguf(path, work, **flags)
    elif name in SPM:
        work = root / f"{path.stem}-work"
        work.mkdir(exist_ok=True)
        if flags:
            raise ValueError("flags are not supported for the Gemma SentencePiece fixtures")
        return sentencepiece_gguf(path, work, add_space_prefix=name == "gemma3-spm")
    else:
        raise ValueError(name)
    args.update(flags)
    return write_vocab_gguf(path, **args)


@pytest.fixture(scope="module")
def family(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., tuple[Path, Tokenizer]]:
    root = tmp_path_factory.mktemp("families")
    made: dict[Path, Tokenizer] = {}

    def get(name: str, **flags: Any) -> tuple[Path, Tokenizer]:
        path = write_family(name, root, **flags)
        if path not in made:
            made[path] = load_gguf_tokenizer(path, read_gguf(path), None)
        return path, made[path]

    return get


# ---------------------------------------------------------------------- random text

_SPECIAL_TEXTS = sorted({*BPE_SPECIALS, *GEMMA_SPECIALS, *MISTRAL_CONTROL, *QWEN_USER, "<s>", "</s>", "<unk>", "<h1>",
                         "</h1>", "<start_of_image>"})
_PIECES = st.one_of(
    # words of any script, and any code point at all (surrogates excepted)
    st.text(st.characters(categories=("L",)), min_size=1, max_size=8),
    st.text(max_size=6),
    st.sampled_from(["hello", "World", "Привет", "мир", "Γειά", "中文字符", "日本語の", "한국어", "مرحبا", "שלום",
                     "नमस्ते", "สวัสดี", "ǅemal", "ﬁne", "İstanbul", "straße", "\U00013460", "\U0001D400"]),
    # combining marks, alone and after letters
    st.text(st.characters(categories=("M",)), min_size=1, max_size=3),
    st.sampled_from(["e\u0301", "a\u0308\u0323", "\u0915\u094d\u0937", "\u0e01\u0e34", "\u0301", "\u093f", "\u200d"]),
    # emoji, with modifiers, joiners, flags and variation selectors
    st.sampled_from(["🙂", "👍🏽", "👨\u200d👩\u200d👧", "🇫🇷", "❤️", "🏳️\u200d🌈", "😀😀", "\U0001FAE0", "\ufe0f"]),
    # digit runs, ASCII and others
    st.text(st.sampled_from("0123456789"), min_size=1, max_size=12),
    st.sampled_from(["٣٤٥", "\uff11\uff12\uff13", "½", "²", "Ⅻ", "3.14", "1,000", "1e10", "0x1F"]),
    # whitespace runs
    st.lists(st.sampled_from([" ", "\t", "\n", "\r\n", "\r", "\u00a0", "\u3000", "\u2003", "\v", "\f", "\x85"]),
             min_size=1, max_size=6).map("".join),
    # contractions
    st.sampled_from(["'s", "'S", "'t", "'re", "'RE", "'ve", "'m", "'ll", "'LL", "'d", "'D", "n't", "\u2019s", "'",
                     "''", "'x", "'\u017f"]),
    st.sampled_from(["I'm", "don't", "YOU'RE", "we'll", "it's"]),
    # punctuation and symbols
    st.text(st.characters(categories=("P", "S")), min_size=1, max_size=4),
    # special-token texts, whole and cut, and the texts SentencePiece uses for spaces and bytes
    st.sampled_from(_SPECIAL_TEXTS),
    st.sampled_from(["<|im_", "im_end|>", "<start_of", "[INST", "<tool_call", "\u2581", "\u2581\u2581", "<0x41>",
                     "\u0120"]),
)
TEXTS = st.tuples(st.sampled_from(["", "", " ", "  ", "\n", "\t", " \n"]), st.lists(_PIECES, max_size=10)).map(
    lambda parts: parts[0] + "".join(parts[1]))


def _round_trips(name: str, ours: Tokenizer, text: str) -> bool:
    """Whether `name`'s family guarantees decode(encode(text)) == text: byte-level BPE always;
    SentencePiece-style vocabularies (Gemma 4 too) unless the text holds U+2581 (decoded as a space)
    or, with a space prefix, an added token (llama.cpp puts a space after each)."""
    name = name.removesuffix("-no-ids")
    if name in BYTE_LEVEL or name.startswith("pairs-") or name == "qwen2-user":
        return True
    if "\u2581" in text:
        return False
    if name in ("gemma3-spm", "mistral"):
        added = ours.backend.get_added_tokens_decoder().values()
        return not any(a.content in text for a in added)
    return True


def check(llama: LlamaCpp, name: str, path: Path, ours: Tokenizer, text: str) -> None:
    for add_special in (True, False):
        want = llama.tokenize(path, text, add_special)
        got = ours.encode(text, add_special)
        assert got == want, (name, text, add_special)
    if _round_trips(name, ours, text):
        assert ours.decode(ours.encode(text, False)) == text, (name, text)


@pytest.mark.parametrize("name", FAMILIES)
# TOKFUZZ_EXAMPLES: more examples for a longer search (5000 a family found nothing more).
@settings(max_examples=int(os.environ.get("TOKFUZZ_EXAMPLES", "300")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=TEXTS)
def test_random_text_tokenizes_as_llama_cpp(name: str, text: str, family: Callable[..., tuple[Path, Tokenizer]],
                                            llama: LlamaCpp) -> None:
    path, ours = family(name)
    check(llama, name, path, ours, text)


# ---------------------------------------------------------------------- BOS / EOS against the file's flags

_ABSENT = object()
_IDS = {"gpt2": ("<|endoftext|>", "<|im_end|>"), "gemma4": ("<bos>", "<eos>"), "llama": ("<s>", "</s>")}
_FLAG_FAMILIES = {"llama-bpe": "gpt2", "qwen2": "gpt2", "gemma4": "gemma4", "mistral": "llama"}


def _flags(name: str, add_bos: Any, add_eos: Any, ids: str) -> dict[str, Any]:
    """write_family's flags: the add_bos/add_eos keys (absent, True or False) and the BOS/EOS ids
    ("named", "absent": no key, "bad": an id past the vocabulary)."""
    bos, eos = _IDS[_FLAG_FAMILIES[name]]
    flags: dict[str, Any] = {"bos": bos, "eos": eos} if ids == "named" else {"bos": None, "eos": None}
    extra: dict[str, Any] = {}
    if ids == "bad":
        extra = {"tokenizer.ggml.bos_token_id": np.uint32(1_000_000),
                 "tokenizer.ggml.eos_token_id": np.uint32(1_000_001)}
    flags["add_bos"] = None if add_bos is _ABSENT else add_bos
    if add_eos is not _ABSENT:
        extra["tokenizer.ggml.add_eos_token"] = add_eos
    if extra:
        flags["extra"] = extra
    return flags


@pytest.mark.parametrize("ids", ["named", "absent", "bad"])
@pytest.mark.parametrize("add_eos", [_ABSENT, True, False], ids=["eos-absent", "eos-true", "eos-false"])
@pytest.mark.parametrize("add_bos", [_ABSENT, True, False], ids=["bos-absent", "bos-true", "bos-false"])
@pytest.mark.parametrize("name", list(_FLAG_FAMILIES))
def test_bos_and_eos_follow_the_files_flags_as_llama_cpp(name: str, add_bos: Any, add_eos: Any, ids: str,
                                                        llama: LlamaCpp, tmp_path: Path) -> None:
    """BOS and EOS are added as llama.cpp adds them: by tokenizer.ggml.add_bos_token/add_eos_token, else
    llama.cpp's default for the tokenizer, with the ids of bos_token_id/eos_token_id, else llama.cpp's
    default ids (11 for "gpt2", 1 and 2 for "llama"). Where llama.cpp would add a token it has no id for
    (it fails an assertion), pymlxc refuses the file naming the key."""
    flags = _flags(name, add_bos, add_eos, ids)
    if name == "mistral":
        (tmp_path / "mistral-work").mkdir()
    path = write_family(name, tmp_path, **flags)
    info = llama.info(path)
    try:
        want = {text: llama.tokenize(path, text, True) for text in ("", "hi", "<s>x")}
    except RuntimeError as crash:
        assert "GGML_ASSERT" in str(crash) and "!= LLAMA_TOKEN_NULL" in str(crash), crash
        with pytest.raises(GGUFError, match=r"tokenizer\.ggml\.(bos|eos)_token_id"):
            load_gguf_tokenizer(path, read_gguf(path), None)
        return
    ours = load_gguf_tokenizer(path, read_gguf(path), None)
    for text, ids_ in want.items():
        assert ours.encode(text, True) == ids_, (text, info)
        assert ours.encode(text, False) == llama.tokenize(path, text, False), text
    # The same, spelled against the flags llama.cpp read from the file.
    edges = ([info["bos"]] if info["add_bos"] else []) + ([info["eos"]] if info["add_eos"] else [])
    assert ours.encode("", True) == edges
    if info["eos"] >= 0:
        assert info["eos"] in ours.eos_token_ids
    if info["bos"] >= 0:
        assert ours.bos_token_id == info["bos"]


# ---------------------------------------------------------------------- regressions (minimal failing inputs)

def test_missing_bos_and_eos_ids_take_llama_cpps_defaults(llama: LlamaCpp, tmp_path: Path) -> None:
    """Without tokenizer.ggml.bos_token_id/eos_token_id llama.cpp adds and stops on its default ids:
    11 for a "gpt2" vocabulary, 1 (BOS) and 2 (EOS) for a SentencePiece ("llama") one. pymlxc added
    no BOS at all: "" gave [] where llama.cpp gives [11] (Llama 3's split adds BOS by default)."""
    path = write_family("llama-bpe", tmp_path, bos=None, eos=None)
    ours = load_gguf_tokenizer(path, read_gguf(path), None)
    assert llama.tokenize(path, "", True) == [11] == ours.encode("", True)
    assert 11 in ours.eos_token_ids
    (tmp_path / "mistral-work").mkdir()
    path = write_family("mistral", tmp_path, bos=None, eos=None, unk=None, extra={"tokenizer.ggml.add_eos_token": True})
    ours = load_gguf_tokenizer(path, read_gguf(path), None)
    assert llama.tokenize(path, "", True) == [1, 2] == ours.encode("", True)


def test_bos_without_a_token_is_refused_by_name(llama: LlamaCpp, tmp_path: Path) -> None:
    """Gemma 4 always adds BOS and has no default id for it: llama.cpp fails an assertion on the
    first text it encodes with special tokens, pymlxc added nothing; now loading names the key."""
    path = write_family("gemma4", tmp_path, bos=None)
    with pytest.raises(RuntimeError, match=r"GGML_ASSERT\(vocab.token_bos\(\) != LLAMA_TOKEN_NULL\)"):
        llama.tokenize(path, "", True)
    with pytest.raises(GGUFError, match=r"adds BOS .*tokenizer\.ggml\.bos_token_id names no token"):
        load_gguf_tokenizer(path, read_gguf(path), None)
    path = write_family("gemma4", tmp_path, eos=None, extra={"tokenizer.ggml.add_eos_token": True})
    with pytest.raises(GGUFError, match=r"adds EOS .*tokenizer\.ggml\.eos_token_id names no token"):
        load_gguf_tokenizer(path, read_gguf(path), None)


def test_overlapping_special_tokens_are_named_in_a_warning(llama: LlamaCpp, tmp_path: Path) -> None:
    """llama.cpp cuts special tokens out of the text longest first, `tokenizers` leftmost first: with
    user-defined "<a|" and "|b>>", "<a|b>>" is "<a" + "|b>>" in llama.cpp and "<a|" + "b>>" in the
    pipeline. No pipeline setting reproduces llama.cpp's order, so loading such a vocabulary warns,
    naming the pair (only text holding the join differs)."""
    tokens, merges, types = byte_level_vocab("qwen2")
    path = write_vocab_gguf(tmp_path / "o.gguf", model="gpt2", pre="qwen2", tokens=[*tokens, "<a|", "|b>>"],
                            merges=merges, types=[*types, USER_DEFINED, USER_DEFINED])
    assert llama.tokenize(path, "<a|b>>", False)[-1] == len(tokens) + 1  # "|b>>" won
    with pytest.warns(UserWarning, match=r"1 pair\(s\) of special tokens overlap .* '<a\|' and '\|b>>' in '<a\|b>>'"):
        ours = load_gguf_tokenizer(path, read_gguf(path), None)
    assert ours.encode("x <a| y |b>> z", False) == llama.tokenize(path, "x <a| y |b>> z", False)  # apart: alike
    # Runs of one character overlap too but split alike, and stay accepted.
    path = write_vocab_gguf(tmp_path / "r.gguf", model="gpt2", pre="qwen2", tokens=[*tokens, "\t\t", "\t\t\t"],
                            merges=merges, types=[*types, USER_DEFINED, USER_DEFINED])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = load_gguf_tokenizer(path, read_gguf(path), None)
    assert not [w for w in caught if "overlap" in str(w.message)]
    for text in ("\t\t\t\t\t", "\t\t\t\t", "x\t\t\t\t\t\t\t"):
        assert ours.encode(text, False) == llama.tokenize(path, text, False), text

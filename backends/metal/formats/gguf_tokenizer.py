"""The tokenizer of a GGUF model, as a `tokenizers` pipeline plus the settings `Tokenizer` reads.

Where the pipeline comes from, best first: a `tokenizer.json` beside the GGUF file; the
`tokenizer.huggingface.json` key some converters embed; else it is rebuilt from llama.cpp's
`tokenizer.ggml.*` keys, to give the ids llama.cpp gives (llama-vocab.cpp is the reference;
tests/metal/test_gguf_tokenizer.py compares with it on random text):

* `gpt2`: byte-level BPE from `tokens` and `merges`, split first by `tokenizer.ggml.pre`: GPT-2's,
  Llama 3's, Qwen 2's and Qwen 3.5's patterns (under every name llama.cpp gives them) and llama.cpp's
  "default" (also taken when the key is missing), spelled as llama.cpp runs them and with its
  Unicode 15.1 character tables. Other names are refused by name, since a wrong split silently
  changes every encoding.
* `gemma4` (or `gpt2` with pre `gemma4`): BPE on raw UTF-8 with U+2581 for spaces, split only at
  newlines, <0xXX> byte tokens for what no token covers; a newline run that is a token is taken whole.
* `llama`: SentencePiece BPE (Gemma 2/3, Llama 2, Mistral) from `tokens` and `scores` with byte
  fallback. llama.cpp (like SentencePiece's BPE) merges the adjacent pair whose joined text is a
  token with the highest score; a BPE whose merges are every split of every token, ranked by the
  joined token's score, does the same. This is what "llama" means in a GGUF file even for a
  Unigram-trained vocabulary (llama.cpp calls those "t5"), so no Viterbi segmentation is attempted.

Control tokens become special added tokens, user-defined ones plain added tokens; the text between
them is tokenized as llama.cpp parses special tokens (`special=True`). The settings (special tokens,
whether BOS/EOS are added, the chat template, the ids that end generation) come from
`tokenizer_config.json` beside the file when present, else from the GGUF keys with llama.cpp's
defaults (BOS for SentencePiece, Llama 3 and Gemma 4; BOS/EOS ids 11 for "gpt2", 1 and 2 for "llama"
when the file names none), in the shape of the Hugging Face files so that `Tokenizer.from_parts`
treats both alike. A file that asks for BOS or EOS without a token for it is refused by name, as is
one whose `tokens` repeat a text (llama.cpp stops on both); tests/metal/test_gguf_tokenizer_llama_cpp.py
checks all this against llama.cpp.

Where it can still differ from llama.cpp: two merges of one SentencePiece vocabulary whose tokens
score exactly alike compete at different places of a word (llama.cpp takes the leftmost, the pipeline
the lower id); special tokens that overlap in the text (llama.cpp matches the longest token first,
`tokenizers` the leftmost; loading warns and names a pair, and misses chains of three or more); a
Gemma 4 vocabulary whose own merges join newlines without building its newline-run tokens (loading
warns and names the tokens concerned); llama.cpp's `special=False` (control tokens read as text) has
no counterpart, as `Tokenizer.encode` always reads them as special tokens.
"""
from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

from pymlxc.files import TOKENIZER_LIMIT, check_regular_file, read_json

from .gguf import GGUFError, metadata

if TYPE_CHECKING:
    from gguf import GGUFReader

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# The split patterns as llama.cpp runs them (llama-vocab.cpp, `llm_tokenizer_bpe`), not as the
# tokenizer.json they came from: llama.cpp spells `(?i:'s|...)` as `'[sS]|...`, which differs for
# letters that case-fold to ASCII ("'\u017f" is no contraction there), and its pattern decides the ids.
# Every class is in brackets so that `_classes` can put llama.cpp's own tables in place of
# Oniguruma's \p{..} and \s (see `_unicode_ranges`).
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?[\p{L}]+| ?[\p{N}]+| ?[^\s\p{L}\p{N}]+|[\s]+(?![^\s])|[\s]+"
_LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}]+|[\p{N}]{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|[\s]*[\r\n]+"
           r"|[\s]+(?![^\s])|[\s]+")
_QWEN2 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}]+|[\p{N}]| ?[^\s\p{L}\p{N}]+[\r\n]*|[\s]*[\r\n]+"
          r"|[\s]+(?![^\s])|[\s]+")
# Qwen 3.5: letter runs take combining marks along (\p{M}).
_QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|[\p{N}]| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
           r"|[\s]*[\r\n]+|[\s]+(?![^\s])|[\s]+")
# llama.cpp's "default" (also what it uses when tokenizer.ggml.pre is missing): four splits in turn.
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"[\p{N}]+", r"[0-9][0-9][0-9]")
_NEWLINES = r"[^\n]+|[\n]+"
_SPM_SPACE = "\u2581"


@dataclass(frozen=True)
class PreTokenizer:
    """How llama.cpp splits text before its BPE merges, for one `tokenizer.ggml.pre` value."""

    patterns: tuple[str, ...]  # applied in turn, each to the pieces of the one before
    ignore_merges: bool = False  # a piece that is a token is taken whole (Llama 3)
    spm_style: bool = False  # spaces become U+2581, raw UTF-8 with <0xXX> byte tokens (Gemma 4)
    add_bos: bool = False  # llama.cpp's default when tokenizer.ggml.add_bos_token is absent


_P_DEFAULT = PreTokenizer(_DEFAULT)
_P_GPT2 = PreTokenizer((_GPT2,))
_P_LLAMA3 = PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True)
_P_QWEN2 = PreTokenizer((_QWEN2,))
_P_QWEN35 = PreTokenizer((_QWEN35,))
_P_GEMMA4 = PreTokenizer((_NEWLINES,), spm_style=True, add_bos=True)
# tokenizer.ggml.pre -> its split, under the names llama.cpp gives the same split and settings
# (llama-vocab.cpp); names it gives special-token rules of their own (jina, modern-bert) are left out.
PRE_TOKENIZERS: dict[str | None, PreTokenizer] = {
    None: _P_DEFAULT, "default": _P_DEFAULT,
    **dict.fromkeys(("gpt-2", "phi-2", "gigachat", "a.x-4.0", "mellum", "roberta-bpe", "exaone4", "mpt", "olmo"),
                    _P_GPT2),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"),
                    _P_LLAMA3),
    # Llama 3's pattern without its whole-word rule and BOS default
    **dict.fromkeys(("smaug-bpe", "dbrx"), PreTokenizer((_LLAMA3,))),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2"), _P_QWEN2),
    "qwen35": _P_QWEN35,
    "gemma4": _P_GEMMA4,
}
# Texts of tokens that end generation, as llama.cpp has them (GGUF files carry no
# generation_config.json, and often name only one of them as EOS); the fill-in-the-middle padding,
# repository and file separators end it there too.
_FIM_ENDS = ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]", "<|fim_repo|>", "<|repo_name|>",
             "<fim-repo>", "<REPO>", "<reponame>", "<|file_sep|>")
END_OF_TURN = ("<|eot_id|>", "<|end_of_text|>", "<|eom_id|>", "<|im_end|>", "<|endoftext|>", "<|end|>",
               "<end_of_turn>", "<eos>", "</s>", "<turn|>", "<|tool_response>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
               "<end_of_utterance>", "<\uff5cend\u2581of\u2581sentence\uff5c>", *_FIM_ENDS)
# llama.cpp makes tokens with these texts control tokens whatever type the file gives them
# ("control-looking token"), so they are parsed as special tokens; the other fill-in-the-middle
# markers are among them.
_CONTROL_LOOKING = frozenset((*END_OF_TURN, "<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>",
                              "<\uff5cfim\u2581begin\uff5c>", "<PRE>", "\u2581<PRE>", "<|fim_suffix|>", "<fim-suffix>",
                              "<fim_suffix>", "<\uff5cfim\u2581hole\uff5c>", "<SUF>", "\u2581<SUF>", "<|fim_middle|>",
                              "<fim-middle>", "<fim_middle>", "<\uff5cfim\u2581end\uff5c>", "<MID>", "\u2581<MID>"))


def token_types(tokens: Sequence[str], types: Sequence[int]) -> list[int]:
    """The token types llama.cpp tokenizes with: control-looking tokens made control, and Gemma 4's
    "</s>" (a vocabulary with "<|tool_response>") made normal text."""
    out = [CONTROL if t in _CONTROL_LOOKING and k not in (CONTROL, UNKNOWN) else k
           for t, k in zip(tokens, types, strict=False)]
    if "<|tool_response>" in tokens:
        out = [NORMAL if t == "</s>" else k for t, k in zip(tokens, out, strict=False)]
    return out


def _token_id(value: Any, n: int) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < n:
        return None
    return value


def _special_id(reader: GGUFReader, key: str, n: int) -> int | None:
    """The token id a `tokenizer.ggml.*_token_id` key names, None where absent. Not an integer: refused
    by name. An id outside the `n` tokens: ignored with a warning, as llama.cpp does ("bad special
    token", its default then used), where the vocabulary itself is well formed (`n` > 0)."""
    value = metadata(reader, key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise GGUFError(f"{key} must be a token id (an integer), got {value!r}")
    if not 0 <= value < n:
        if n:
            warnings.warn(f"{key} is {value}, which names no token of the {n} in tokenizer.ggml.tokens: ignored, "
                          "as llama.cpp does", stacklevel=3)
        return None
    return value


def _flag(reader: GGUFReader, key: str, default: bool) -> bool:
    """A boolean key (`default` where absent); another type is refused rather than read as true."""
    value = metadata(reader, key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise GGUFError(f"{key} must be a boolean, got {value!r}")
    return value


# llama.cpp's token types (llama_token_type): UNDEFINED (0) to BYTE (6).
_TOKEN_TYPES = range(0, BYTE + 1)


# llama.cpp classifies code points with tables of Unicode 15.1 (unicode-data.cpp); Oniguruma, under
# `tokenizers`, knows later versions, so a letter added since (U+13460, Egyptian hieroglyphs) would be
# split differently. unicodedata2 of that version (the gguf extra) gives the same tables.
LLAMA_CPP_UNICODE = "15.1.0"
# Unicode's White_Space property, which is llama.cpp's `\s` (a fixed list there too).
_WHITE_SPACE = (0x09, 0x0A, 0x0B, 0x0C, 0x0D, 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x2028, 0x2029,
                0x202F, 0x205F, 0x3000)


def _ranges(points: Sequence[int]) -> str:
    out, i = [], 0
    while i < len(points):
        j = i
        while j + 1 < len(points) and points[j + 1] == points[j] + 1:
            j += 1
        out.append(f"\\x{{{points[i]:X}}}" if i == j else f"\\x{{{points[i]:X}}}-\\x{{{points[j]:X}}}")
        i = j + 1
    return "".join(out)


@functools.cache
def _unicode_ranges() -> dict[str, str] | None:
    r"""Class bodies for \p{L}, \p{N}, \p{M}, \p{P} and \s from llama.cpp's Unicode version, or None
    when unicodedata2 of that version is not installed."""
    try:
        import unicodedata2
    except ImportError:
        return None
    if unicodedata2.unidata_version != LLAMA_CPP_UNICODE:
        return None
    by_major: dict[str, list[int]] = {"L": [], "N": [], "M": [], "P": []}
    # Planes 4-13 hold no assigned code point and 15-16 only private use (category Co).
    points = [*range(0x40000), *range(0xE0000, 0xF0000)]
    for c, category in zip(points, map(unicodedata2.category, map(chr, points)), strict=True):
        group = by_major.get(category[0])
        if group is not None:
            group.append(c)
    ranges = {f"\\p{{{k}}}": _ranges(v) for k, v in by_major.items()}
    ranges["\\s"] = _ranges(_WHITE_SPACE)
    return ranges


def _classes(pattern: str) -> str:
    """`pattern` with llama.cpp's character tables in place of Oniguruma's."""
    ranges = _unicode_ranges()
    if ranges is None:
        warnings.warn(f"unicodedata2=={LLAMA_CPP_UNICODE} is not installed (pip install 'pymlxc[gguf]'): the "
                      "GGUF tokenizer splits text with Oniguruma's Unicode tables, so characters assigned after "
                      f"Unicode {LLAMA_CPP_UNICODE} may get other token ids than in llama.cpp", stacklevel=4)
        return pattern
    for name, body in ranges.items():
        pattern = pattern.replace(name, body)
    return pattern


# ---------------------------------------------------------------------- pipelines

def _split(patterns: Sequence[str]) -> list[pre_tokenizers.PreTokenizer]:
    # "isolated": llama.cpp keeps both the matches and the text between them as pieces.
    return [pre_tokenizers.Split(Regex(_classes(p)), behavior="isolated", invert=False) for p in patterns]


def _bpe_model(vocab: dict[str, int], pairs: list[tuple[str, str]], *, ignore_merges: bool,
               byte_fallback: bool) -> models.BPE:
    try:
        return models.BPE(vocab=vocab, merges=pairs, ignore_merges=ignore_merges, byte_fallback=byte_fallback)
    except Exception as exc:  # tokenizers raises plain Exception for merges outside the vocabulary
        raise GGUFError(f"the GGUF vocabulary and merges do not form a BPE model: {exc}") from exc


def _unreachable(vocab: dict[str, int], pairs: list[tuple[str, str]], pieces: Sequence[str]) -> list[str]:
    """The `pieces` that the merges alone do not turn into themselves."""
    if not pieces:
        return []
    probe = tokenizers.Tokenizer(_bpe_model(vocab, pairs, ignore_merges=False, byte_fallback=True))
    found = probe.encode_batch(list(pieces), add_special_tokens=False)
    return [p for p, enc in zip(pieces, found, strict=True) if enc.ids != [vocab[p]]]


def _gemma4_newlines(vocab: dict[str, int], pairs: list[tuple[str, str]], tokens: Sequence[str],
                     types: Sequence[int]) -> tuple[str, list[tuple[str, str]], bool]:
    """(split pattern, merges, ignore_merges) that give llama.cpp's Gemma 4 ids.

    llama.cpp splits the text into lines and maximal newline runs, takes a run whole when it is a
    token and merges everything else. Gemma 4's run tokens are not built by its merges, and
    `tokenizers` has one whole-word switch for all pieces, so: a run that is a token becomes one
    piece, built by added merges between run tokens (ranked after the file's); any other run is cut
    into single newlines, which is what the file's merges make of it when none of them joins two runs."""
    runs = sorted((t for t in vocab if t and not t.strip("\n")), key=len)
    if not _unreachable(vocab, pairs, runs):
        return _NEWLINES, pairs, False  # the file's merges build every run token: merging is exact
    # Only a merge of two newline runs can act on a run (pieces never mix newlines with other text).
    if not any(not a.strip("\n") and not b.strip("\n") for a, b in pairs):
        lengths = sorted({len(r) for r in runs if len(r) > 1}, reverse=True)
        whole = "|".join(rf"\n{{{k}}}" for k in lengths)
        pattern = r"[^\n]+|" + (r"(?<!\n)(?:" + whole + r")(?!\n)|" if lengths else "") + r"\n"
        joins = [(r[:k], r[k:]) for r in runs for k in range(1, len(r)) if r[:k] in vocab and r[k:] in vocab]
        merged = [*pairs, *joins]
        if not _unreachable(vocab, merged, runs):
            return pattern, merged, False
    # A run token neither the file's merges nor added ones build: take every piece that is a token
    # whole, which is wrong only for a piece (not a run) that is a token no merge builds.
    added = (CONTROL, UNKNOWN, USER_DEFINED)  # split off before the merges
    pieces = [t for t, k in zip(tokens, types, strict=False)
              if k not in added and "\n" not in t and vocab.get(t) is not None]
    bad = _unreachable(vocab, pairs, pieces)
    if bad:
        warnings.warn(f"this Gemma 4 vocabulary has {len(bad)} token(s) its merges cannot build (e.g. "
                      f"{bad[0]!r}): text between newlines and special tokens that is exactly one of them is "
                      "encoded as that token, where llama.cpp encodes it by merges", stacklevel=3)
    return _NEWLINES, pairs, True


def _bpe(tokens: Sequence[str], merges: Sequence[str], types: Sequence[int], pre: str | None,
         model: str) -> tokenizers.Tokenizer:
    """llama.cpp's BPE (`tokenizer.ggml.model` gpt2 or gemma4): split by `pre`, then merges by rank."""
    if model == "gemma4":
        pre = "gemma4"  # llama.cpp ignores tokenizer.ggml.pre for this model
    if pre not in PRE_TOKENIZERS:
        known = ", ".join(sorted(k for k in PRE_TOKENIZERS if k))
        raise GGUFError(f"pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported (supported: {known}); "
                        "put the model's tokenizer.json beside the GGUF file")
    split = PRE_TOKENIZERS[pre]
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    pairs: list[tuple[str, str]] = []
    for m in merges:
        # llama.cpp splits at the first space after the first character, so a merge's left part
        # may itself be a space (SPM-style vocabularies keep raw spaces in some tokens).
        cut = m.find(" ", 1)
        left, right = (m[:cut], m[cut + 1:]) if cut > 0 else ("", "")
        if not left or not right:
            raise GGUFError(f"malformed merge {m!r} in tokenizer.ggml.merges")
        pairs.append((left, right))
    if split.spm_style:
        pattern, pairs, ignore = _gemma4_newlines(vocab, pairs, tokens, types)
        tok = tokenizers.Tokenizer(_bpe_model(vocab, pairs, ignore_merges=ignore, byte_fallback=True))
        tok.normalizer = normalizers.Replace(" ", _SPM_SPACE)
        tok.pre_tokenizer = pre_tokenizers.Sequence(_split((pattern,)))
        tok.decoder = decoders.Sequence([decoders.Replace(_SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
        return tok
    tok = tokenizers.Tokenizer(_bpe_model(vocab, pairs, ignore_merges=split.ignore_merges, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        *_split(split.patterns), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


def spm_merges(tokens: Sequence[str], scores: Sequence[float], types: Sequence[int]) -> list[tuple[str, str]]:
    """Every split of every token into two tokens, best-scoring joined token first (ties: lower id
    first, then by the ids of the halves). llama.cpp's SPM joins two adjacent pieces whenever the
    joined text is a token of any type, so user-defined and control tokens take part too; only byte
    tokens (`<0x41>`) stay out, as they stand for bytes, not for their text."""
    ids: dict[str, int] = {}
    for i, (t, kind) in enumerate(zip(tokens, types, strict=False)):
        if kind != BYTE:
            ids.setdefault(t, i)
    ranked: list[tuple[float, int, int, int, str, str]] = []
    for piece, pid in ids.items():
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            li, ri = ids.get(left), ids.get(right)
            if li is not None and ri is not None:
                ranked.append((-float(scores[pid]), pid, li, ri, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _sentencepiece_bpe(tokens: Sequence[str], scores: Sequence[float], types: Sequence[int], *,
                       unk: str | None, add_space_prefix: bool) -> tokenizers.Tokenizer:
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    try:
        model = models.BPE(vocab=vocab, merges=spm_merges(tokens, scores, types), unk_token=unk,
                           byte_fallback=True, fuse_unk=True)
    except Exception as exc:  # noqa: BLE001 - tokenizers raises plain Exception
        raise GGUFError(f"the GGUF vocabulary does not form a SentencePiece BPE model: {exc}") from exc
    tok = tokenizers.Tokenizer(model)
    # Spaces become U+2581 and, as in llama.cpp, one is put before the text and after each special
    # token (HF's Metaspace would skip it before a leading space, where SentencePiece does not).
    replace = normalizers.Replace(" ", _SPM_SPACE)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(_SPM_SPACE), replace]) if add_space_prefix else replace
    steps = [decoders.Replace(_SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(steps)
    return tok


def _shown(text: str, limit: int = 40) -> str:
    """`text` as repr, cut to `limit` characters (a token may be a long run of spaces)."""
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}... ({len(text)} characters)"


def _check_unique(tokens: Sequence[str]) -> None:
    """Refuse a vocabulary that gives one text two ids, which the rebuilt tokenizer would otherwise
    encode as the first of them, silently. llama.cpp (llama-vocab.cpp, `llama_vocab::impl::load`)
    stops on such a file: older versions abort on GGML_ASSERT(id_to_token.size() ==
    token_to_id.size()), newer ones throw "duplicate token in vocabulary". Its token loop comes after
    the per-model setup, so this holds for every tokenizer model (SPM, BPE, WPM, UGM alike), and it
    reads an empty token as "[EMPTY_<id>]", so empty tokens never repeat."""
    seen: dict[str, int] = {}
    for i, t in enumerate(tokens):
        text = t or f"[EMPTY_{i}]"
        first = seen.setdefault(text, i)
        if first != i:
            empty = " (llama.cpp's name for an empty token)" if not t or not tokens[first] else ""
            raise GGUFError(f"tokenizer.ggml.tokens repeats the token {_shown(text)}{empty} at ids {first} and {i}, "
                            "which llama.cpp refuses (one id per token text); put the model's tokenizer.json "
                            "beside the GGUF file")


def _pre(reader: GGUFReader) -> str | None:
    pre = metadata(reader, "tokenizer.ggml.pre")
    if pre is not None and not isinstance(pre, str):
        raise GGUFError(f"tokenizer.ggml.pre is a {type(pre).__name__}, not a pre-tokenizer name")
    return pre


def pipeline_from_metadata(reader: GGUFReader, bos_eos: BosEos | None = None) -> tokenizers.Tokenizer:
    """A `tokenizers.Tokenizer` from the `tokenizer.ggml.*` keys (or an embedded tokenizer.json).
    `bos_eos`: `_bos_eos` of the file where the caller has it already (`tokenizer_sources`)."""
    embedded = metadata(reader, "tokenizer.huggingface.json")
    if isinstance(embedded, str) and embedded:
        try:
            return tokenizers.Tokenizer.from_str(embedded)
        except Exception as exc:  # noqa: BLE001 - tokenizers raises plain Exception
            raise GGUFError(f"the embedded tokenizer.huggingface.json is not a valid tokenizer: {exc}") from exc
    kind = metadata(reader, "tokenizer.ggml.model")
    tokens = metadata(reader, "tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise GGUFError("the GGUF file has no tokenizer (tokenizer.ggml.tokens); put the model's tokenizer.json "
                        "beside it")
    if not all(isinstance(t, str) for t in tokens):
        raise GGUFError("tokenizer.ggml.tokens is not a list of strings")
    # Only here, where the vocabulary becomes the tokenizer: a tokenizer.json (beside the file or
    # embedded) replaces it, and stays the way to load such a file.
    _check_unique(tokens)
    n = len(tokens)
    types = metadata(reader, "tokenizer.ggml.token_type") or [NORMAL] * n
    if not isinstance(types, list) or len(types) != n or not all(isinstance(k, int) for k in types):
        raise GGUFError(f"tokenizer.ggml.token_type is not a list of {n} integers, one per token")
    bad = next((i for i, k in enumerate(types) if k not in _TOKEN_TYPES), None)
    if bad is not None:
        raise GGUFError(f"tokenizer.ggml.token_type of token {bad} ({tokens[bad]!r}) is {types[bad]}, not a token "
                        f"type (0 to {BYTE})")
    types = token_types(tokens, types)
    _check_bos_eos(bos_eos if bos_eos is not None else _bos_eos(reader, n), n)
    _check_overlapping_specials(tokens, types)
    if kind in ("gpt2", "gemma4"):
        merges = metadata(reader, "tokenizer.ggml.merges") or []
        if not isinstance(merges, list) or not all(isinstance(m, str) for m in merges):
            raise GGUFError("tokenizer.ggml.merges is not a list of strings")
        tok = _bpe(tokens, merges, types, _pre(reader), kind)
    elif kind == "llama":
        scores = metadata(reader, "tokenizer.ggml.scores")
        if (not isinstance(scores, list) or len(scores) != n
                or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in scores)):
            raise GGUFError("a SentencePiece (llama) tokenizer needs tokenizer.ggml.scores, one number per token")
        bad = next((i for i, x in enumerate(scores) if not math.isfinite(x)), None)
        if bad is not None:  # the merges are ranked by score: a NaN would order them arbitrarily
            raise GGUFError(f"tokenizer.ggml.scores of token {bad} ({tokens[bad]!r}) is {scores[bad]}, not a finite "
                            "number")
        unk_id = _special_id(reader, "tokenizer.ggml.unknown_token_id", n)
        if unk_id is None:
            unk_id = next((i for i, k in enumerate(types) if k == UNKNOWN), None)
        add_prefix = _flag(reader, "tokenizer.ggml.add_space_prefix", True)
        tok = _sentencepiece_bpe(tokens, scores, types, unk=tokens[unk_id] if unk_id is not None else None,
                                 add_space_prefix=add_prefix)
    else:
        raise GGUFError(f"tokenizer model {kind!r} (tokenizer.ggml.model) is not supported (supported: gpt2, "
                        "gemma4, llama); put the model's tokenizer.json beside the GGUF file")
    special = [AddedToken(t, special=True, normalized=False)
               for t, k in zip(tokens, types, strict=False) if k in (CONTROL, UNKNOWN)]
    plain = [AddedToken(t, special=False, normalized=False)
             for t, k in zip(tokens, types, strict=False) if k == USER_DEFINED]
    if special:
        tok.add_special_tokens(special)
    if plain:
        tok.add_tokens(plain)
    return tok


def _llama_cpp_split(text: str, order: Sequence[str]) -> list[str]:
    """`text` cut as llama.cpp cuts special tokens out of it: each token in `order` in turn (longest
    first), at every place in the text left over by the tokens before."""
    pieces: list[tuple[str, bool]] = [(text, False)]
    for tok in order:
        out: list[tuple[str, bool]] = []
        for piece, is_token in pieces:
            while not is_token and (at := piece.find(tok)) >= 0:
                out += [(piece[:at], False), (tok, True)]
                piece = piece[at + len(tok):]
            out.append((piece, is_token))
        pieces = [p for p in out if p[0]]
    return [p if t else "\0" + p for p, t in pieces]


def _leftmost_split(text: str, toks: Sequence[str]) -> list[str]:
    """`text` cut as `tokenizers` cuts added tokens out of it: leftmost match first, longest there."""
    out, pos, start = [], 0, 0
    while start < len(text):
        found = [t for t in toks if text.startswith(t, start)]
        if not found:
            start += 1
            continue
        tok = max(found, key=len)
        out += (["\0" + text[pos:start]] if start > pos else []) + [tok]
        pos = start = start + len(tok)
    return out + (["\0" + text[pos:]] if pos < len(text) else [])


def _check_overlapping_specials(tokens: Sequence[str], types: Sequence[int]) -> None:
    """Warn of special (or user-defined) tokens that overlap in text: llama.cpp cuts the longest token
    out first, `tokenizers` the leftmost, so for A = "<a|" and B = "|b>>" the text "<a|b>>" gives
    "<a" + B in llama.cpp and A + "b>>" here. Each overlap is tried on the text that joins the two
    (runs of one character, like newline-run tokens, overlap too but split alike). A warning, not a
    refusal: only text that holds the joined form tokenizes differently, and the rest of the file
    (the weights, every other text) is as llama.cpp reads it."""
    added = sorted({t for t, k in zip(tokens, types, strict=False) if k in (CONTROL, UNKNOWN, USER_DEFINED) and t})
    by_suffix: dict[str, list[str]] = {}
    for a in added:
        for k in range(1, len(a)):
            by_suffix.setdefault(a[k:], []).append(a)
    found: list[tuple[str, str, str]] = []
    for b in added:
        for k in range(1, len(b)):
            for a in by_suffix.get(b[:k], ()):
                if a == b or len(a) > len(b):
                    continue  # llama.cpp then takes `a` first, the leftmost match too
                text = a + b[k:]
                # Tokens of one length come in no set order in llama.cpp: either order must agree.
                orders = [[b, a]] if len(b) > len(a) else [[a, b], [b, a]]
                want = _leftmost_split(text, [a, b])
                if any(_llama_cpp_split(text, o) != want for o in orders):
                    found.append((a, b, text))
    if found:
        a, b, text = found[0]
        warnings.warn(f"{len(found)} pair(s) of special tokens overlap in text (tokenizer.ggml.tokens, token_type), "
                      f"e.g. {a!r} and {b!r} in {text!r}, which llama.cpp splits at the longer token and the rebuilt "
                      "tokenizer at the leftmost: text holding such a join tokenizes differently from llama.cpp (put "
                      "the model's tokenizer.json beside the GGUF file to use its own)", stacklevel=3)


# llama.cpp's BOS and EOS ids where tokenizer.ggml.bos_token_id / eos_token_id is missing or names no
# token (llama-vocab.cpp's defaults per tokenizer.ggml.model): it adds and stops on these, so must we.
# Gemma 4's vocabulary has none.
_DEFAULT_BOS_EOS: dict[str, tuple[int, int]] = {"gpt2": (11, 11), "llama": (1, 2)}


BosEos = tuple[int | None, int | None, bool, bool]  # BOS id, EOS id, add BOS, add EOS


def _bos_eos(reader: GGUFReader, n: int) -> BosEos:
    """(BOS id, EOS id, add BOS, add EOS) as llama.cpp has them for a vocabulary of `n` tokens."""
    kind = metadata(reader, "tokenizer.ggml.model")
    default_bos, default_eos = _DEFAULT_BOS_EOS.get(kind, (None, None)) if isinstance(kind, str) else (None, None)
    bos_id = _special_id(reader, "tokenizer.ggml.bos_token_id", n)
    eos_id = _special_id(reader, "tokenizer.ggml.eos_token_id", n)
    bos_id = bos_id if bos_id is not None else _token_id(default_bos, n)
    eos_id = eos_id if eos_id is not None else _token_id(default_eos, n)
    pre = "gemma4" if kind == "gemma4" else _pre(reader)
    split = PRE_TOKENIZERS.get(pre) if kind in ("gpt2", "gemma4") else None
    add_bos = _flag(reader, "tokenizer.ggml.add_bos_token", kind == "llama" or (split is not None and split.add_bos))
    if pre == "gemma4":
        add_bos = True  # llama.cpp forces BOS for Gemma 4, whatever the file says
    add_eos = _flag(reader, "tokenizer.ggml.add_eos_token", False)
    return bos_id, eos_id, bool(add_bos), bool(add_eos)


def _check_bos_eos(bos_eos: BosEos, n: int) -> None:
    """Refuse a file that asks for BOS or EOS without a token for it (`bos_eos`: its `_bos_eos`):
    llama.cpp fails an assertion on such a file (and would with any special tokens added), so there
    are no ids to agree with."""
    bos_id, eos_id, add_bos, add_eos = bos_eos
    for add, found, what in ((add_bos, bos_id, "bos"), (add_eos, eos_id, "eos")):
        if add and found is None:
            raise GGUFError(f"the tokenizer adds {what.upper()} (tokenizer.ggml.add_{what}_token, or llama.cpp's "
                            f"default for this tokenizer) but tokenizer.ggml.{what}_token_id names no token of the "
                            f"{n}; put the model's tokenizer.json beside the GGUF file")


# ---------------------------------------------------------------------- settings

def _tokens(reader: GGUFReader) -> list[str]:
    """tokenizer.ggml.tokens, or [] where malformed (`pipeline_from_metadata` names what is wrong)."""
    tokens = metadata(reader, "tokenizer.ggml.tokens")
    return tokens if isinstance(tokens, list) and all(isinstance(t, str) for t in tokens) else []


def settings_from_metadata(reader: GGUFReader, model_type: str | None,
                           bos_eos: BosEos | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(tokenizer_config, config) dicts shaped like the Hugging Face files, from the GGUF keys.
    `bos_eos`: `_bos_eos` of the file where the caller has it already (`tokenizer_sources`)."""
    # Malformed lists are left to `pipeline_from_metadata` to name; here they only give no settings.
    tokens = _tokens(reader)
    types = metadata(reader, "tokenizer.ggml.token_type")
    types = types if isinstance(types, list) and all(isinstance(k, int) for k in types) else []
    n = len(tokens)

    def token(key: str) -> tuple[int | None, str | None]:
        i = _special_id(reader, key, n)
        return (i, tokens[i]) if i is not None else (None, None)

    bos_id, eos_id, add_bos, add_eos = bos_eos if bos_eos is not None else _bos_eos(reader, n)
    bos = tokens[bos_id] if bos_id is not None else None
    eos = tokens[eos_id] if eos_id is not None else None
    _, unk = token("tokenizer.ggml.unknown_token_id")
    _, pad = token("tokenizer.ggml.padding_token_id")
    tok_config: dict[str, Any] = {"add_bos_token": add_bos and bos is not None,
                                  "add_eos_token": add_eos and eos is not None}
    for name, text in (("bos_token", bos), ("eos_token", eos), ("unk_token", unk), ("pad_token", pad)):
        if text is not None:
            tok_config[name] = text
    template = metadata(reader, "tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise GGUFError(f"tokenizer.chat_template must be a string, got a {type(template).__name__}")
    if isinstance(template, str) and template:
        tok_config["chat_template"] = template

    stop = [i for i in (eos_id, token("tokenizer.ggml.eot_token_id")[0], token("tokenizer.ggml.eom_token_id")[0])
            if i is not None]
    if len(types) == n:
        stop += [i for i, (t, k) in enumerate(zip(tokens, token_types(tokens, types), strict=False))
                 if k == CONTROL and t in END_OF_TURN]
        if "<|tool_response>" in tokens:
            stop = [i for i in stop if tokens[i] != "</s>"]  # Gemma 4's "</s>" is text, as llama.cpp has it
    config: dict[str, Any] = {"model_type": model_type, "eos_token_id": sorted(set(stop))}
    if bos_id is not None:
        config["bos_token_id"] = bos_id
    return tok_config, config


def _read_json(path: Path) -> dict[str, Any] | None:
    """A settings file beside the GGUF file, None where there is none; read as `tokenizer.py` reads
    a model directory's: only a regular file of bounded size (a FIFO there is refused, not waited on)."""
    if not path.exists():
        return None
    return read_json(path, what="tokenizer file", error=GGUFError)


@dataclass(frozen=True)
class TokenizerSources:
    """What a `tokenizer.Tokenizer` of a GGUF model is built from: `file`, a `tokenizer.json` beside
    the GGUF file (its settings files merged into `tok_config`), else `pipeline`, the tokenizer the
    file's metadata describes; `config` and `gen_config` as config.json and generation_config.json."""

    file: Path | None
    pipeline: tokenizers.Tokenizer | None
    tok_config: dict[str, Any]
    special_map: dict[str, Any]
    config: dict[str, Any]
    gen_config: dict[str, Any]


def tokenizer_sources(gguf_path: str | Path, reader: GGUFReader, model_type: str | None) -> TokenizerSources:
    """The sources of the tokenizer of the GGUF model at `gguf_path` (see the module doc)."""
    beside = Path(gguf_path).parent
    # BOS and EOS as llama.cpp resolves them, once: the settings name them and the rebuilt pipeline
    # checks them (for the same vocabulary: the pipeline refuses a malformed token list first).
    bos_eos = _bos_eos(reader, len(_tokens(reader)))
    tok_config, config = settings_from_metadata(reader, model_type, bos_eos)
    special_map: dict[str, Any] = {}
    file = beside / "tokenizer.json"
    if file.exists():
        # Read by name by `tokenizers`: only a regular file of bounded size is handed to it.
        check_regular_file(file, what="tokenizer file", max_bytes=TOKENIZER_LIMIT)
        hf_config = _read_json(beside / "tokenizer_config.json")
        if hf_config is not None:
            tok_config = {**({"chat_template": tok_config["chat_template"]} if "chat_template" in tok_config else {}),
                          **hf_config}
            special_map = _read_json(beside / "special_tokens_map.json") or {}
        return TokenizerSources(file, None, tok_config, special_map, config,
                                _read_json(beside / "generation_config.json") or {})
    return TokenizerSources(None, pipeline_from_metadata(reader, bos_eos), tok_config, special_map, config,
                            _read_json(beside / "generation_config.json") or {})


__all__ = ["PRE_TOKENIZERS", "END_OF_TURN", "LLAMA_CPP_UNICODE", "token_types", "pipeline_from_metadata",
           "settings_from_metadata", "spm_merges", "TokenizerSources", "tokenizer_sources"]

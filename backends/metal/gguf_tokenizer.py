"""The tokenizer of a GGUF model, as a `tokenizers` pipeline plus the settings `Tokenizer` reads.

Where the pipeline comes from, best first: a `tokenizer.json` beside the GGUF file; the
`tokenizer.huggingface.json` key some converters embed; else it is rebuilt from llama.cpp's
`tokenizer.ggml.*` keys:

* `gpt2`: byte-level BPE from `tokens` and `merges`. The pre-tokenizer split follows
  `tokenizer.ggml.pre` (GPT-2's, Llama 3's or Qwen 2's pattern); others are refused, since a wrong
  split silently changes every encoding.
* `llama`: SentencePiece BPE from `tokens` and `scores` with byte fallback. llama.cpp (like
  SentencePiece's BPE) merges the adjacent pair whose joined piece scores highest; a BPE whose
  merges are every split of every piece, ranked by the joined piece's score, does the same. This is
  what "llama" means in a GGUF file even for a Unigram-trained vocabulary (llama.cpp calls those
  "t5"), so no Viterbi segmentation is attempted.

Control tokens become special added tokens, user-defined ones plain added tokens. The settings
(special tokens, whether BOS/EOS are added, the chat template, the ids that end generation) come
from `tokenizer_config.json` beside the file when present, else from the GGUF keys, in the shape of
the Hugging Face files so that `Tokenizer.from_parts` treats both alike.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

from .gguf import GGUFError, metadata

if TYPE_CHECKING:
    from gguf import GGUFReader

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_GPT2 = None  # ByteLevel's own GPT-2 pattern
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> (split pattern, ignore_merges: a word that is a token is taken whole, as
# Llama 3's tokenizer.json asks).
PRE_TOKENIZERS: dict[str | None, tuple[str | None, bool]] = {
    None: (_GPT2, False), "default": (_GPT2, False), "gpt-2": (_GPT2, False), "gpt2": (_GPT2, False),
    "llama-bpe": (_LLAMA3, True), "llama3": (_LLAMA3, True), "smaug-bpe": (_LLAMA3, True),
    "qwen2": (_QWEN2, False), "deepseek-r1-qwen": (_QWEN2, False),
}
# Texts of control tokens that end a turn, as llama.cpp also treats them (GGUF files carry no
# generation_config.json, and often name only one of them as EOS).
END_OF_TURN = ("<|eot_id|>", "<|end_of_text|>", "<|eom_id|>", "<|im_end|>", "<|endoftext|>", "<|end|>",
               "<end_of_turn>", "<eos>", "</s>")
_SPM_SPACE = "\u2581"


def _token_id(value: Any, n: int) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < n:
        return None
    return value


# ---------------------------------------------------------------------- pipelines

def _byte_level_bpe(tokens: Sequence[str], merges: Sequence[str], pre: str | None) -> tokenizers.Tokenizer:
    if pre not in PRE_TOKENIZERS:
        known = ", ".join(sorted(k for k in PRE_TOKENIZERS if k))
        raise GGUFError(f"pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported (supported: {known}); "
                        "put the model's tokenizer.json beside the GGUF file")
    pattern, ignore_merges = PRE_TOKENIZERS[pre]
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    pairs: list[tuple[str, str]] = []
    for m in merges:
        left, sep, right = m.partition(" ")
        if not sep or not left or not right or " " in right:
            raise GGUFError(f"malformed merge {m!r} in tokenizer.ggml.merges")
        pairs.append((left, right))
    try:
        model = models.BPE(vocab=vocab, merges=pairs, ignore_merges=ignore_merges)
    except Exception as exc:  # tokenizers raises plain Exception for merges outside the vocabulary
        raise GGUFError(f"the GGUF vocabulary and merges do not form a BPE model: {exc}") from exc
    tok = tokenizers.Tokenizer(model)
    if pattern is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    tok.decoder = decoders.ByteLevel()
    return tok


def spm_merges(tokens: Sequence[str], scores: Sequence[float], types: Sequence[int]) -> list[tuple[str, str]]:
    """Every split of every normal piece into two normal pieces, best-scoring joined piece first
    (ties: lower id first, then by the ids of the halves)."""
    normal = {}
    for i, (t, kind) in enumerate(zip(tokens, types)):
        if kind == NORMAL:
            normal.setdefault(t, i)
    ranked: list[tuple[float, int, int, int, str, str]] = []
    for piece, pid in normal.items():
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            li, ri = normal.get(left), normal.get(right)
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


def pipeline_from_metadata(reader: GGUFReader) -> tokenizers.Tokenizer:
    """A `tokenizers.Tokenizer` from the `tokenizer.ggml.*` keys (or an embedded tokenizer.json)."""
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
    n = len(tokens)
    types = metadata(reader, "tokenizer.ggml.token_type") or [NORMAL] * n
    if not isinstance(types, list) or len(types) != n:
        raise GGUFError(f"tokenizer.ggml.token_type has {len(types) if isinstance(types, list) else 'no'} entries "
                        f"for {n} tokens")
    if kind == "gpt2":
        merges = metadata(reader, "tokenizer.ggml.merges") or []
        tok = _byte_level_bpe(tokens, merges, metadata(reader, "tokenizer.ggml.pre"))
    elif kind == "llama":
        scores = metadata(reader, "tokenizer.ggml.scores")
        if not isinstance(scores, list) or len(scores) != n:
            raise GGUFError("a SentencePiece (llama) tokenizer needs tokenizer.ggml.scores, one per token")
        unk_id = _token_id(metadata(reader, "tokenizer.ggml.unknown_token_id"), n)
        if unk_id is None:
            unk_id = next((i for i, k in enumerate(types) if k == UNKNOWN), None)
        add_prefix = metadata(reader, "tokenizer.ggml.add_space_prefix", True)
        tok = _sentencepiece_bpe(tokens, scores, types, unk=tokens[unk_id] if unk_id is not None else None,
                                 add_space_prefix=bool(add_prefix))
    else:
        raise GGUFError(f"tokenizer model {kind!r} (tokenizer.ggml.model) is not supported (supported: gpt2, "
                        "llama); put the model's tokenizer.json beside the GGUF file")
    special = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k in (CONTROL, UNKNOWN)]
    plain = [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == USER_DEFINED]
    if special:
        tok.add_special_tokens(special)
    if plain:
        tok.add_tokens(plain)
    return tok


# ---------------------------------------------------------------------- settings

def settings_from_metadata(reader: GGUFReader, model_type: str | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(tokenizer_config, config) dicts shaped like the Hugging Face files, from the GGUF keys."""
    tokens = metadata(reader, "tokenizer.ggml.tokens") or []
    types = metadata(reader, "tokenizer.ggml.token_type") or []
    n = len(tokens)

    def token(key: str) -> tuple[int | None, str | None]:
        i = _token_id(metadata(reader, key), n)
        return (i, tokens[i]) if i is not None else (None, None)

    bos_id, bos = token("tokenizer.ggml.bos_token_id")
    eos_id, eos = token("tokenizer.ggml.eos_token_id")
    _, unk = token("tokenizer.ggml.unknown_token_id")
    _, pad = token("tokenizer.ggml.padding_token_id")
    spm = metadata(reader, "tokenizer.ggml.model") == "llama"
    add_bos = metadata(reader, "tokenizer.ggml.add_bos_token", spm)
    add_eos = metadata(reader, "tokenizer.ggml.add_eos_token", False)
    tok_config: dict[str, Any] = {"add_bos_token": bool(add_bos) and bos is not None, "add_eos_token": bool(add_eos)}
    for name, text in (("bos_token", bos), ("eos_token", eos), ("unk_token", unk), ("pad_token", pad)):
        if text is not None:
            tok_config[name] = text
    template = metadata(reader, "tokenizer.chat_template")
    if isinstance(template, str) and template:
        tok_config["chat_template"] = template

    stop = [i for i in (eos_id, token("tokenizer.ggml.eot_token_id")[0], token("tokenizer.ggml.eom_token_id")[0])
            if i is not None]
    if len(types) == n:
        stop += [i for i, (t, k) in enumerate(zip(tokens, types)) if k == CONTROL and t in END_OF_TURN]
    config: dict[str, Any] = {"model_type": model_type, "eos_token_id": sorted(set(stop))}
    if bos_id is not None:
        config["bos_token_id"] = bos_id
    return tok_config, config


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise GGUFError(f"{path}: not valid JSON: {exc}") from exc
    return data if isinstance(data, dict) else None


def load_gguf_tokenizer(gguf_path: str | Path, reader: GGUFReader, model_type: str | None) -> Any:
    """The `tokenizer.Tokenizer` of the GGUF model at `gguf_path` (see the module doc for sources)."""
    from .tokenizer import Tokenizer, TokenizerLoadError

    beside = Path(gguf_path).parent
    tok_config, config = settings_from_metadata(reader, model_type)
    special_map: dict[str, Any] = {}
    file = beside / "tokenizer.json"
    if file.is_file():
        try:
            backend = tokenizers.Tokenizer.from_file(str(file))
        except Exception as exc:  # noqa: BLE001 - tokenizers raises plain Exception
            raise TokenizerLoadError(f"{file}: not a valid tokenizers file: {exc}") from exc
        hf_config = _read_json(beside / "tokenizer_config.json")
        if hf_config is not None:
            tok_config = {**({"chat_template": tok_config["chat_template"]} if "chat_template" in tok_config else {}),
                          **hf_config}
            special_map = _read_json(beside / "special_tokens_map.json") or {}
    else:
        backend = pipeline_from_metadata(reader)
    gen_config = _read_json(beside / "generation_config.json") or {}
    return Tokenizer.from_parts(backend, tok_config=tok_config, special_map=special_map, config=config,
                                gen_config=gen_config)


__all__ = ["PRE_TOKENIZERS", "END_OF_TURN", "pipeline_from_metadata", "settings_from_metadata", "spm_merges",
           "load_gguf_tokenizer"]

"""Tokenizer-only GGUF files in each family's style, from small tokenizers trained here, and
llama.cpp's own tokenization of them (llama-cpp-python, in a child process) to compare with.

The vocabularies are trained on `TEXT` with the tokenizers and sentencepiece libraries, shaped like
the real ones: byte-level BPE under a family's split pattern (Llama 3, Qwen 2, Qwen 3.5, GPT-2,
llama.cpp's default), Gemma 4's BPE on raw UTF-8 with U+2581 for spaces and <0x00>..<0xFF> byte
tokens, and Gemma 2/3's SentencePiece BPE with byte fallback, scores and token types.
"""
from __future__ import annotations

import functools
import json
import os
import select
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import tokenizers
from tokenizers import Regex, models, normalizers, pre_tokenizers, trainers

from pymlxc.testing import CORPUS

# Scripts with combining marks (Devanagari, Thai, decomposed accents), contractions in both cases,
# tabs and runs of newlines and spaces, so that the split patterns' differences show.
TEXT = CORPUS + """\
नमस्ते दुनिया, यह एक छोटा वाक्य है। สวัสดีชาวโลก ภาษาไทยมีสระ. Cafe\u0301 re\u0301sume\u0301 nai\u0308ve.
I'M HERE, you'RE there, we'Ll see; they'VE gone, it'S done, I'D say, don'T.
\tindented\twith\ttabs\n\n\nthree newlines, then four\n\n\n\nand spaces:    four,        eight.
1234567 89 000 3.14 1e10 0x1F 2024-01-01 12:30:45 $100 +5 <tag> ~x^y|z
"""

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = (int(gguf.TokenType.NORMAL), int(gguf.TokenType.UNKNOWN),
                                                int(gguf.TokenType.CONTROL), int(gguf.TokenType.USER_DEFINED),
                                                int(gguf.TokenType.BYTE))
LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
         r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# tokenizer.ggml.pre -> the pattern its vocabulary is trained under (the HF spelling).
TRAIN_PATTERN = {"llama-bpe": LLAMA3, "qwen2": QWEN2, "qwen35": QWEN35, "gpt-2": GPT2, "default": GPT2}
BPE_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|file_sep|>")
# Written as normal tokens, as some converters did: llama.cpp makes "control-looking" ones control.
LOOSE_SPECIALS = ("<|file_sep|>",)
GEMMA_SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>", "<|turn>", "<turn|>", "<start_of_turn>", "<end_of_turn>")


def _lines() -> list[str]:
    return TEXT.splitlines(keepends=True) * 4


def byte_level_vocab(pre: str, vocab_size: int = 700) -> tuple[list[str], list[str], list[int]]:
    """(tokens, merges, token types) of a byte-level BPE trained under `pre`'s split pattern."""
    tokens, merges, types = _byte_level_vocab(pre, vocab_size)
    return list(tokens), list(merges), list(types)


@functools.cache
def _byte_level_vocab(pre: str, vocab_size: int) -> tuple[tuple[str, ...], tuple[str, ...], tuple[int, ...]]:
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(TRAIN_PATTERN[pre]), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(BPE_SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_lines(), trainer)
    data = json.loads(tok.to_str())
    vocab: dict[str, int] = data["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.__getitem__)
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    types = [CONTROL if t in BPE_SPECIALS and t not in LOOSE_SPECIALS else NORMAL for t in tokens]
    return tuple(tokens), tuple(merges), tuple(types)


def byte_pair_vocab() -> tuple[list[str], list[str], list[int]]:
    """(tokens, merges, token types) holding every pair of byte symbols as a token with its merge: any
    two bytes that end up in one piece are merged, so the ids show every boundary the split drew
    (a trained vocabulary hides a wrong boundary wherever it has no merge across it)."""
    chars = sorted(pre_tokenizers.ByteLevel.alphabet(), key=_byte_of)  # GPT-2's stand-ins, in byte order
    pairs = [a + b for a in chars for b in chars]
    tokens = [*BPE_SPECIALS, *chars, *pairs]
    merges = [f"{a} {b}" for a in chars for b in chars]
    return tokens, merges, [CONTROL] * len(BPE_SPECIALS) + [NORMAL] * (len(chars) + len(pairs))


def _byte_of(ch: str) -> int:
    """The byte that GPT-2's byte-to-unicode table maps to `ch`."""
    c = ord(ch)
    if 33 <= c <= 126 or 161 <= c <= 172 or 174 <= c <= 255:
        return c
    return sorted(b for b in range(256) if not (33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255))[c - 256]


def gemma4_vocab(vocab_size: int = 900, newline_runs: int = 4) -> tuple[list[str], list[str], list[int]]:
    """(tokens, merges, token types) shaped like Gemma 4's: BPE on raw UTF-8 with U+2581 for spaces,
    split only at newlines, 256 byte tokens, and newline-run tokens "\\n" * 2..`newline_runs` that
    no merge builds (as in the real vocabulary, where they are added tokens)."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\n+"), behavior="removed")
    # Newlines stay out of the alphabet here: the single "\n" token is placed by hand below.
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False, limit_alphabet=120,
                                  max_token_length=12)
    tok.train_from_iterator(_lines(), trainer)
    data = json.loads(tok.to_str())
    learned: dict[str, int] = data["model"]["vocab"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    runs = ["\n" * k for k in range(1, newline_runs + 1)]
    tokens = [*GEMMA_SPECIALS, *bytes_, *runs, *sorted(learned, key=learned.__getitem__)]
    types = ([CONTROL] * len(GEMMA_SPECIALS) + [BYTE] * 256 + [NORMAL] * len(runs)
             + [NORMAL] * len(learned))
    types[GEMMA_SPECIALS.index("<unk>")] = UNKNOWN
    return tokens, merges, types


def write_vocab_gguf(out: str | Path, *, model: str | None, tokens: Sequence[str], types: Sequence[int],
                     merges: Sequence[str] = (), scores: Sequence[float] | None = None, pre: str | None = None,
                     bos: str | None = None, eos: str | None = None, unk: str | None = None,
                     add_bos: bool | None = None, add_space_prefix: bool | None = None,
                     extra: Mapping[str, Any] | None = None) -> Path:
    """A vocabulary-only GGUF that llama.cpp loads with vocab_only=True (a llama header, no tensors);
    `extra` adds keys of any type (str, bool, int, float, numpy.uint32 or a list of one of them)."""
    writer = gguf.GGUFWriter(str(out), "llama")
    # The hyper-parameters llama.cpp reads before the vocabulary; no tensor is ever read.
    writer.add_context_length(128)
    writer.add_embedding_length(64)
    writer.add_block_count(1)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(4)
    writer.add_layer_norm_rms_eps(1e-5)
    if model is not None:
        writer.add_tokenizer_model(model)
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    if tokens:
        writer.add_token_list(list(tokens))
    if types:
        writer.add_token_types([int(t) for t in types])
    if scores is not None:
        writer.add_token_scores([float(s) for s in scores])
    if merges:
        writer.add_token_merges(list(merges))
    index = {t: i for i, t in reversed(list(enumerate(tokens)))}
    if bos is not None:
        writer.add_bos_token_id(index[bos])
    if eos is not None:
        writer.add_eos_token_id(index[eos])
    if unk is not None:
        writer.add_unk_token_id(index[unk])
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    if add_space_prefix is not None:
        writer.add_add_space_prefix(add_space_prefix)
    for key, value in (extra or {}).items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, np.uint32):  # the type llama.cpp requires of token ids
            writer.add_uint32(key, int(value))
        elif isinstance(value, int):
            writer.add_int32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_array(key, list(value))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(out)


def sentencepiece_gguf(out: Path, work: Path, *, add_space_prefix: bool, vocab_size: int = 600) -> Path:
    """A Gemma 2/3-style vocabulary: SentencePiece BPE with byte fallback, Gemma's control tokens,
    user-defined whitespace runs and tags, written with llama.cpp's converter's token types."""
    import sentencepiece as spm

    user = ["\u2581\u2581", "\u2581\u2581\u2581\u2581", "<h1>", "</h1>", "<start_of_image>"]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_lines()), model_prefix=str(work / "tokenizer"), vocab_size=vocab_size,
        model_type="bpe", byte_fallback=True, character_coverage=0.98, normalization_rule_name="identity",
        remove_extra_whitespaces=False, add_dummy_prefix=add_space_prefix, split_digits=True,
        control_symbols=["<start_of_turn>", "<end_of_turn>"], user_defined_symbols=user,
        pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>",
        unk_piece="<unk>", allow_whitespace_only_pieces=True, minloglevel=2)
    proc = spm.SentencePieceProcessor(model_file=str(work / "tokenizer.model"))
    tokens, scores, types = [], [], []
    for i in range(proc.vocab_size()):
        tokens.append(proc.id_to_piece(i))
        scores.append(proc.get_score(i))
        types.append(BYTE if proc.is_byte(i) else UNKNOWN if proc.is_unknown(i) else
                     CONTROL if proc.is_control(i) else USER_DEFINED if tokens[-1] in user else NORMAL)
    return write_vocab_gguf(out, model="llama", tokens=tokens, types=types, scores=scores, bos="<bos>", eos="<eos>",
                            unk="<unk>", add_bos=True, add_space_prefix=add_space_prefix)


# ---------------------------------------------------------------------- llama.cpp as the reference

_SERVER = r"""
import json, sys
import llama_cpp
vocabs = {}
for line in sys.stdin:
    path, text, add, special = json.loads(line)
    if path not in vocabs:
        vocabs[path] = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
    v = vocabs[path]
    if text is None:  # the settings llama.cpp read from the file
        m = v._model
        out = {"bos": m.token_bos(), "eos": m.token_eos(), "add_bos": bool(llama_cpp.llama_vocab_get_add_bos(m.vocab)),
               "add_eos": bool(llama_cpp.llama_vocab_get_add_eos(m.vocab))}
    else:
        out = v.tokenize(text.encode("utf-8"), add_bos=add, special=special)
    print("@" + json.dumps(out), flush=True)
"""


class LlamaCpp:
    """llama.cpp's tokenizers of any number of GGUF files, in one child process that is started again
    after a crash (a failed assertion in llama.cpp then fails one example, not the test run)."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[str] | None = None
        self._log: Any = None

    def _start(self) -> subprocess.Popen[str]:
        if self._proc is None or self._proc.poll() is not None:
            self._log = tempfile.TemporaryFile()  # noqa: SIM115 - not a pipe: a chatty child must not block on a full one
            # GGML_NO_BACKTRACE: a failed assertion must not run gdb, whose output goes to stdout.
            self._proc = subprocess.Popen([sys.executable, "-c", _SERVER], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, stderr=self._log, text=True, encoding="utf-8",
                                          env={**os.environ, "GGML_NO_BACKTRACE": "1"})
        return self._proc

    def _ask(self, request: list[Any], timeout: float = 120.0) -> Any:
        proc = self._start()
        assert proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write(json.dumps(request) + "\n")
            proc.stdin.flush()
        except BrokenPipeError:
            pass
        ready, _, _ = select.select([proc.stdout], [], [], timeout)
        if not ready:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"llama.cpp gave no answer within {timeout} s on {request!r}")
        line = proc.stdout.readline()
        while line and not line.startswith("@"):  # anything else on stdout is not an answer
            line = proc.stdout.readline()
        if not line:
            proc.wait(timeout=10)
            self._log.seek(0)
            err = self._log.read().decode("utf-8", "replace")
            raise RuntimeError(f"llama.cpp exited with {proc.returncode} on {request!r}: {err[-1500:]}")
        return json.loads(line[1:])

    def tokenize(self, path: Path, text: str, add_special: bool, special: bool = True,
                 timeout: float = 120.0) -> list[int]:
        return list(self._ask([str(path), text, add_special, special], timeout))

    def info(self, path: Path) -> dict[str, Any]:
        return dict(self._ask([str(path), None, False, False]))

    def close(self) -> None:
        if self._proc is None:
            return
        if self._proc.stdin is not None and not self._proc.stdin.closed:
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        if self._proc.stdout is not None:
            self._proc.stdout.close()
        self._log.close()


class LlamaCppVocab:
    """llama.cpp's tokenizer of one GGUF file (`LlamaCpp` bound to its path)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._ref = LlamaCpp()

    def tokenize(self, text: str, add_special: bool = True, timeout: float = 120.0) -> list[int]:
        return self._ref.tokenize(self.path, text, add_special, timeout=timeout)

    def close(self) -> None:
        self._ref.close()

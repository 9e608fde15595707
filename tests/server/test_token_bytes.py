"""`Tokenizer.token_bytes`, the logprobs' `bytes` of a token: its own raw bytes, for byte-level BPE tokens (GPT-2's
alphabet), SentencePiece byte-fallback tokens (<0xNN>) and added tokens alike."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, normalizers

from pymlxc.backends.metal.tokenizer import Tokenizer
from pymlxc.testing.tiny import build_tokenizer

TEXTS = st.text(st.sampled_from("ab 日本語é€😀\n"), min_size=1, max_size=12)


def _byte_level() -> Tokenizer:
    return Tokenizer.from_parts(build_tokenizer("qwen3", 512))


def _sentencepiece() -> Tokenizer:
    """Llama-2-style: "▁" for a space, bytes as <0xNN> where no token spells a character, a
    decoder that strips the text's leading space."""
    vocab = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), "▁", "a", "b", "▁a", "é"]
    raw = RawTokenizer(models.BPE({t: i for i, t in enumerate(vocab)}, [("▁", "a")], unk_token="<unk>",
                                  byte_fallback=True, fuse_unk=True))
    raw.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    raw.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    raw.add_special_tokens(["<unk>", "<s>", "</s>"])
    return Tokenizer.from_parts(raw)


TOKENIZERS = {"byte_level": _byte_level(), "sentencepiece": _sentencepiece()}


@pytest.mark.parametrize("name", TOKENIZERS)
@settings(max_examples=50, deadline=None)
@given(text=TEXTS)
def test_the_tokens_bytes_join_into_the_text(name: str, text: str) -> None:
    tok = TOKENIZERS[name]
    token_bytes = tok.token_bytes
    joined = b"".join(token_bytes(t) for t in tok.encode(text, add_special_tokens=False))
    # SentencePiece's normalizer puts a word boundary before the text, which the token holds.
    assert joined == (" " + text if name == "sentencepiece" else text).encode()


def test_a_byte_fallback_token_is_its_byte_and_a_word_its_space() -> None:
    tok = TOKENIZERS["sentencepiece"]
    token_bytes = tok.token_bytes
    assert tok.decode([tok.token_to_id("<0xE2>")]) == "\ufffd"  # what the text alone would give
    assert token_bytes(tok.token_to_id("<0xE2>")) == b"\xe2"
    assert token_bytes(tok.token_to_id("▁a")) == b" a"  # decoded alone, "a": the first space is stripped
    assert token_bytes(tok.token_to_id("é")) == "é".encode()
    assert token_bytes(tok.token_to_id("</s>")) == b"</s>"


def test_a_byte_level_token_is_its_bytes_and_an_added_token_its_text() -> None:
    tok = TOKENIZERS["byte_level"]
    token_bytes = tok.token_bytes
    first, *rest = tok.encode("😀", add_special_tokens=False)
    assert tok.decode([first]) == "\ufffd" and rest  # the tiny vocabulary splits the emoji
    assert token_bytes(first) == "😀".encode()[:len(token_bytes(first))]
    assert token_bytes(tok.token_to_id("<|im_end|>")) == b"<|im_end|>"
    assert token_bytes(tok.token_to_id("<think>")) == b"<think>"

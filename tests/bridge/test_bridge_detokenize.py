"""The worker's streaming text: each token's piece at once, unfinished characters held, bytes that
can never be valid UTF-8 out as U+FFFD at once, and the pieces joined equal to the full decode."""
from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pymlxc.bridge.detokenize import TokenBytes, unfinished_tail

EDGES = [0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF]  # every continuation range's ends


def _can_finish(pending: bytes) -> bool:
    """Reference: some continuation makes `pending` one valid character (tried on the range ends)."""
    for extra in range(1, 4):
        for tail in itertools.product(EDGES, repeat=extra):
            try:
                if len((pending + bytes(tail)).decode("utf-8")) == 1:
                    return True
            except UnicodeDecodeError:
                pass
    return False


def _stream(chunks: list[bytes], trim_space: bool = False) -> tuple[list[str], str]:
    table = TokenBytes.from_table(chunks, lambda ids: "", trim_space=trim_space)
    text = table.stream()
    pieces = [text.add(i) for i in range(len(chunks))]
    return pieces, text.finish()


byte_chunks = st.lists(
    st.binary(min_size=0, max_size=4)
    | st.sampled_from(["€".encode(), "😀".encode(), b"\xe2", b"\x82\xac", b"\xf0\x9f", b"\xff", b"\xed\xa0"]),
    max_size=12,
)


@settings(max_examples=400, deadline=None)
@given(byte_chunks)
def test_pieces_and_tail_join_into_the_full_decode(chunks: list[bytes]) -> None:
    pieces, tail = _stream(chunks)
    assert "".join(pieces) + tail == b"".join(chunks).decode("utf-8", "replace")


@settings(max_examples=400, deadline=None)
@given(byte_chunks)
def test_each_token_releases_every_character_it_can(chunks: list[bytes]) -> None:
    """After each token, only a trailing run that some continuation can still make valid is held."""
    pieces, _ = _stream(chunks)
    for n in range(1, len(chunks) + 1):
        data = b"".join(chunks[:n])
        held = data[unfinished_tail(data):]
        assert len(held) <= 3 and (not held or _can_finish(held))
        assert "".join(pieces[:n]) == data[: len(data) - len(held)].decode("utf-8", "replace")


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=1, max_size=4))
def test_an_unfinishable_tail_is_not_held(data: bytes) -> None:
    cut = unfinished_tail(data)
    if cut < len(data):
        assert _can_finish(data[cut:])
    else:
        # Nothing held: no run at the end that starts a character can still be finished.
        assert not any(data[i] >= 0xC0 and _can_finish(data[i:]) for i in range(max(0, len(data) - 3), len(data)))


@pytest.mark.parametrize("chunks, pieces, tail", [
    ([b"\xe2", b"\x82", b"\xac", b"!"], ["", "", "\u20ac", "!"], ""),  # a character over three tokens
    ([b"a\xff", b"b"], ["a\ufffd", "b"], ""),  # a byte that is never valid: at once, with its token
    ([b"\xed", b"\xa0"], ["", "\ufffd\ufffd"], ""),  # a bad second byte (a surrogate): at once
    ([b"\xc3"], [""], "\ufffd"),  # unfinished at the end: the tail
    ([b"\x80"], ["\ufffd"], ""),  # a stray continuation byte
])
def test_known_byte_runs(chunks: list[bytes], pieces: list[str], tail: str) -> None:
    assert _stream(chunks) == (pieces, tail)


def test_the_streams_first_space_is_dropped_once() -> None:
    assert _stream([b" ", b" a", b" b"], trim_space=True) == (["", " a", " b"], "")
    assert _stream([b"\xe2", b"\x82\xac b"], trim_space=True) == (["", "\u20ac b"], "")


def test_a_real_tokenizer_streams_what_it_decodes(tiny_model: Path) -> None:
    """The tiny model's byte-level BPE tokenizer, over every id in turn: the joined pieces are
    transformers' decode (less the first space, as mlx-lm streams it)."""
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(tiny_model)
    table = TokenBytes(tokenizer.detokenizer, tokenizer.decode)
    assert table.bytes_of is not None and table.trim_space
    ids = list(range(len(tokenizer._tokenizer)))
    for start in range(0, len(ids), 37):
        window = ids[start:start + 37]
        text = table.stream()
        joined = "".join(text.add(i) for i in window) + text.finish()
        full = tokenizer.decode(window)
        assert joined == (full[1:] if full.startswith(" ") else full), window


# SentencePiece-style words of a tokenizer whose decoder (Metaspace) has no byte table, so the worker
# decodes a window of ids; with clean_up_tokenization_spaces the decode rewrites " ." as "." and so on.
METASPACE_WORDS = ["\u2581it", "\u2581'", "s", "\u2581more", "\u2581", ".", "\n", "\u2581Hello", "\u2581,", ",",
                   "n't", "\u2581n't", "'s", "\u2581's", "\u2581?", "!", "'", "\u2581 "]


@pytest.fixture(scope="module", params=[True, False], ids=["cleans-spaces", "keeps-spaces"])
def metaspace_tokenizer(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> object:
    from mlx_lm.utils import load_tokenizer
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(METASPACE_WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    path = tmp_path_factory.mktemp("metaspace")
    PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        clean_up_tokenization_spaces=request.param,
    ).save_pretrained(path)
    tokenizer = load_tokenizer(path)
    assert type(tokenizer.detokenizer).__name__ == "NaiveStreamingDetokenizer"
    return tokenizer


def test_a_rewriting_decoder_does_not_swallow_the_rest_of_the_stream(metaspace_tokenizer: Any) -> None:
    """ "Hello" "▁" "." decodes to "Hello " and then, spaces cleaned, "Hello.": the stream once waited
    for "Hello " to come back, and every later piece and the tail were "" (the text after it lost)."""
    ids = [METASPACE_WORDS.index(w) + 3 for w in ("\u2581Hello", "\u2581", ".", "\u2581more", "\n", "\u2581it")]
    text = TokenBytes(metaspace_tokenizer.detokenizer, metaspace_tokenizer.decode).stream()
    joined = "".join(text.add(i) for i in ids) + text.finish()
    assert joined == ("Hello. more\nit" if metaspace_tokenizer.clean_up_tokenization_spaces else "Hello . more\nit")


@settings(max_examples=300, deadline=None)
@given(ids=st.lists(st.integers(3, 2 + len(METASPACE_WORDS)), max_size=12))
def test_a_decoded_window_streams_what_mlx_lm_streams(metaspace_tokenizer: Any, ids: list[int]) -> None:
    text = TokenBytes(metaspace_tokenizer.detokenizer, metaspace_tokenizer.decode).stream()
    joined = "".join(text.add(i) for i in ids) + text.finish()
    reference = metaspace_tokenizer.detokenizer  # a fresh one per use
    segments = []
    for i in ids:
        reference.add_token(i)
        segments.append(reference.last_segment)
    reference.finalize()
    assert joined == "".join(segments) + reference.last_segment

"""Streaming text of generated tokens for the worker: each token's piece at once.

mlx-lm's streaming detokenizers hold text back (a word until the next one starts, a byte run that
is not valid UTF-8 until the stream ends). Here each token releases every character it completes:
its piece is "" only while a character is unfinished, and bytes that can never become valid UTF-8
come out as U+FFFD with the token that shows it. Token bytes come from mlx-lm's own tables (which
of its detokenizers fits the tokenizer is mlx-lm's choice), so the text is the one mlx-lm streams.

Standard library only (the tokenizer and its mlx-lm detokenizer are passed in).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

_SPM_SPACE = "\u2581".encode("utf-8")


def _needs(lead: int) -> int:
    """Bytes in a UTF-8 sequence that starts with `lead`; 0 for a byte that cannot start one."""
    if 0xC2 <= lead <= 0xDF:
        return 2
    if 0xE0 <= lead <= 0xEF:
        return 3
    if 0xF0 <= lead <= 0xF4:
        return 4
    return 0


def _second_ok(lead: int, byte: int) -> bool:
    # The second byte's range depends on the lead (no overlongs, surrogates or code points > U+10FFFF).
    low, high = {0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F), 0xF0: (0x90, 0xBF), 0xF4: (0x80, 0x8F)}.get(lead, (0x80, 0xBF))
    return low <= byte <= high


def unfinished_tail(data: bytes) -> int:
    """Where a trailing UTF-8 sequence that is incomplete but can still become valid starts, else len(data).

    Everything before that index decodes now; a byte run that no continuation can make valid is
    not held (it decodes to U+FFFD at once)."""
    for back in range(1, min(3, len(data)) + 1):
        start = len(data) - back
        lead = data[start]
        if 0x80 <= lead <= 0xBF:
            continue  # a continuation byte: its lead, if any, is further back
        need = _needs(lead)
        if need <= back:
            return len(data)  # ASCII, an invalid lead, or a sequence that is already complete
        rest = data[start + 1:]
        if rest and not _second_ok(lead, rest[0]):
            return len(data)
        return start
    return len(data)


class TextStream:
    """Token ids in, text pieces out, one per token, that join into the streamed text.

    With a table of token bytes (byte-level BPE or SentencePiece tokenizers) the bytes go through
    an incremental UTF-8 decoder. Without one, a window of ids is decoded, where an unfinished
    character shows as a trailing U+FFFD (so such a tokenizer's stray bytes wait for the next text,
    as does a trailing space), and the pieces join into what mlx-lm's NaiveStreamingDetokenizer streams.
    """

    def __init__(self, table: TokenBytes) -> None:
        self._table = table
        self._pending = b""
        self._started = False  # whether any text (even a trimmed space) has come out yet
        self._window: list[int] = []
        self._window_sent = 0  # characters of the window's decode already sent

    def add(self, token: int) -> str:
        """The text `token` completes ("" while a character is unfinished)."""
        if self._table.bytes_of is None:
            return self._add_decoded(token)
        data = self._pending + self._table.bytes_of(token)
        cut = unfinished_tail(data)
        self._pending = data[cut:]
        return self._trim(data[:cut].decode("utf-8", "replace"))

    def finish(self) -> str:
        """Text still held at the end: an unfinished character, as U+FFFD."""
        if self._table.bytes_of is None:
            return self._flush_window(final=True)
        data, self._pending = self._pending, b""
        return self._trim(data.decode("utf-8", "replace"))

    def _trim(self, text: str) -> str:
        # mlx-lm's detokenizers drop the space that starts the stream (SentencePiece's word mark).
        if text and not self._started:
            self._started = True
            if self._table.trim_space and text[0] == " ":
                return text[1:]
        return text

    # ---- tokenizers whose token bytes are not known: decode a window --------------------------------

    def _add_decoded(self, token: int) -> str:
        self._window.append(token)
        return self._flush_window(final=False)

    def _flush_window(self, *, final: bool) -> str:
        if not self._window:
            return ""
        text = self._table.decode(self._window)
        if not final:
            text = text.rstrip("\ufffd")  # maybe a character still to be finished
            if text.endswith(" "):  # held, as mlx-lm holds it: a decoder that cleans up spaces
                text = text[:-1]  # drops it once the next token is ".", "'s", ...
        # Should the decoder still rewrite sent text, the stream goes on from the new text's length, as
        # mlx-lm's does; waiting for the sent text to come back lost everything after it.
        piece = text[self._window_sent:]
        self._window_sent = len(text)
        if text.endswith("\n") or final:  # a line is done: start a fresh window (linear time)
            self._window, self._window_sent = [], 0
        return piece


class TokenBytes:
    """Each token's UTF-8 bytes, built once per loaded tokenizer from mlx-lm's detokenizer tables."""

    def __init__(self, detokenizer: Any, decode: Callable[[Sequence[int]], str]) -> None:
        self.decode = decode
        self.trim_space = False
        self.bytes_of: Callable[[int], bytes] | None = None
        kind = type(detokenizer).__name__
        table: list[bytes] | None = None
        if kind == "BPEStreamingDetokenizer":
            from mlx_lm.tokenizer_utils import _byte_decoder

            byte_of = _byte_decoder()
            table = [b"".join(bytes([byte_of[c]]) if c in byte_of else c.encode("utf-8") for c in t or "")
                     for t in detokenizer.tokenmap]
            self.trim_space = True
        elif kind == "SPMStreamingDetokenizer":
            # Word marks become spaces per token, as the tokenizer's decoder does before joining bytes.
            table = [t.replace(_SPM_SPACE, b" ") for t in detokenizer.tokenmap]
            self.trim_space = bool(getattr(detokenizer, "trim_space", True))
        if table is not None:
            self._use(table)

    @classmethod
    def from_table(
        cls, table: Sequence[bytes], decode: Callable[[Sequence[int]], str], *, trim_space: bool
    ) -> TokenBytes:
        """A table given directly: token id -> its bytes."""
        made = cls(None, decode)
        made.trim_space = trim_space
        made._use(list(table))
        return made

    def _use(self, table: list[bytes]) -> None:
        # An id past the tokenizer's table (a model whose embedding has padding rows) has no text.
        self.bytes_of = lambda token: table[token] if 0 <= token < len(table) else b""

    def stream(self) -> TextStream:
        return TextStream(self)

"""The native backend's tokenizer: a `tokenizers` pipeline plus the model directory's settings.

A Hugging Face model directory spreads what a tokenizer is over several files: `tokenizer.json`
(the pipeline), `tokenizer_config.json` (special tokens, the BOS/EOS flags, the chat template),
`special_tokens_map.json` (older special tokens), `chat_template.jinja` / `chat_template.json`
(newer checkpoints' template), `config.json` and `generation_config.json` (the ids that end
generation). `Tokenizer` reads them all once and answers with plain Python values.
"""
from __future__ import annotations

import json
import reprlib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import processors

from pymlxc.files import TOKENIZER_LIMIT, check_directory, read_json, read_text

# The named special tokens, in the order transformers passes them to chat templates.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_REPLACEMENT = "\ufffd"
_repr = reprlib.Repr()
_repr.maxstring = _repr.maxother = 60
_repr.maxlevel = 2
_show = _repr.repr


class TokenizerLoadError(ValueError):
    """A tokenizer file exists but cannot be used; the message names the file."""


def _read_json(path: Path, *, required: bool) -> dict[str, Any] | None:
    # Through pymlxc.files: a FIFO or a device in the directory is refused, not read forever.
    if not path.exists():
        if required:
            raise FileNotFoundError(f"tokenizer file not found: {path}")
        return None
    return read_json(path, what="tokenizer file", error=TokenizerLoadError)


def _token_text(value: Any, where: str | None = None) -> str | None:
    """A special token, stored as a string or as a serialized AddedToken. Anything else is refused
    naming `where` (special_tokens_map.json, as transformers refuses it), or with `where` None
    ignored (tokenizer_config.json, as transformers 5 ignores it there)."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(content := value.get("content"), str):
        return content
    if value is not None and where is not None:
        raise TokenizerLoadError(f"{where}: expected a token (a string or an object with a string 'content'), "
                                 f"got {_show(value)}")
    return None


def _ids(value: Any, where: str) -> list[int]:
    """A token id or a list of them (null: none). Anything else ("2", true, [2, null]) is refused
    naming `where`: ignored, a stop id would let generation run past its end."""
    if value is None:
        return []
    items = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in items):
        raise TokenizerLoadError(f"{where}: expected a token id or a list of token ids, got {_show(value)}")
    return items


class Tokenizer:
    """Encode, decode and stream-decode text for the model in `model_dir`."""

    def __init__(self, model_dir: str | Path) -> None:
        root = check_directory(model_dir, what="model directory")
        tokenizer_file = root / "tokenizer.json"
        if not tokenizer_file.exists():
            raise FileNotFoundError(f"tokenizer file not found: {tokenizer_file}")
        # Read here (a regular file of bounded size), parsed from the text: tokenizers' own
        # from_file would block on a FIFO and read a device without end.
        text = read_text(tokenizer_file, what="tokenizer file", max_bytes=TOKENIZER_LIMIT, error=TokenizerLoadError)
        try:
            self._backend = tokenizers.Tokenizer.from_str(text)
        except Exception as exc:  # tokenizers raises a bare Exception; say what is wrong, naming the file
            try:
                value = json.loads(text)
            except (json.JSONDecodeError, RecursionError) as bad:
                raise TokenizerLoadError(f"{tokenizer_file}: not valid JSON: {bad}") from exc
            if not isinstance(value, dict):
                raise TokenizerLoadError(
                    f"{tokenizer_file}: expected a JSON object, got {type(value).__name__}") from exc
            raise TokenizerLoadError(f"{tokenizer_file}: not a valid tokenizers file: {exc}") from exc
        del text

        tok_config = _read_json(root / "tokenizer_config.json", required=False) or {}
        special_map = _read_json(root / "special_tokens_map.json", required=False) or {}
        config = _read_json(root / "config.json", required=False) or {}
        gen_config = _read_json(root / "generation_config.json", required=False) or {}
        self._configure(root, tok_config, special_map, config, gen_config)

    @classmethod
    def from_parts(cls, backend: tokenizers.Tokenizer, *, tok_config: Mapping[str, Any] | None = None,
                   special_map: Mapping[str, Any] | None = None, config: Mapping[str, Any] | None = None,
                   gen_config: Mapping[str, Any] | None = None) -> Tokenizer:
        """A tokenizer from a ready pipeline and the contents of the HF files as dicts, for models
        that are not a directory of those files (GGUF: see `load_gguf_tokenizer`)."""
        self = cls.__new__(cls)
        self._backend = backend
        self._configure(None, tok_config or {}, special_map or {}, config or {}, gen_config or {})
        return self

    def _configure(self, root: Path | None, tok_config: Mapping[str, Any], special_map: Mapping[str, Any],
                   config: Mapping[str, Any], gen_config: Mapping[str, Any]) -> None:
        def where(file: str, field: str) -> str:  # the file and field an error names
            return f"{root / file if root is not None else file}: {field}"

        nested = config.get("text_config")
        text_config: Mapping[str, Any] = nested if isinstance(nested, dict) else {}

        self.model_type: str | None = config.get("model_type")
        self.chat_template: str | None = self._template(root, tok_config)

        # tokenizer_config.json wins; special_tokens_map.json only fills gaps.
        self.special_tokens: dict[str, str] = {}
        for name in SPECIAL_TOKEN_NAMES:
            mapped = _token_text(special_map.get(name), where("special_tokens_map.json", name))
            text = _token_text(tok_config.get(name))
            if text is None:
                text = mapped
            if text is not None:
                self.special_tokens[name] = text

        bos_id = self.token_to_id(self.bos_token) if self.bos_token is not None else None
        sources = ((config, "config.json", ""), (text_config, "config.json", "text_config."),
                   (gen_config, "generation_config.json", ""))
        ids = {key: [i for source, file, prefix in sources for i in _ids(source.get(key), where(file, prefix + key))]
               for key in ("bos_token_id", "eos_token_id")}
        if bos_id is None:
            bos_id = next(iter(ids["bos_token_id"]), None)
        self.bos_token_id: int | None = bos_id

        eos_ids: set[int] = set(ids["eos_token_id"])
        if self.eos_token is not None and (eos_id := self.token_to_id(self.eos_token)) is not None:
            eos_ids.add(eos_id)
        self.eos_token_ids: frozenset[int] = frozenset(eos_ids)

        self._apply_bos_eos_flags(tok_config, where("tokenizer_config.json", ""))  # + the flag's name

        # SentencePiece-style byte fallback decodes a run of <0xNN> tokens all at once (as U+FFFD
        # per byte when the run is not valid UTF-8), so streaming must not cut inside a run.
        self.byte_fallback_ids: frozenset[int] = frozenset(
            i for b in range(256) if (i := self.token_to_id(f"<0x{b:02X}>")) is not None)
        self.special_ids: frozenset[int] = frozenset(
            i for i, added in self._backend.get_added_tokens_decoder().items() if added.special)
        # For `token_bytes`: added tokens (special or not) decode to their own text, not through
        # the byte alphabet.
        self._added_ids = frozenset(self._backend.get_added_tokens_decoder())
        self._decoder_kind = decoder_kind(self._backend)

    @staticmethod
    def _template(root: Path | None, tok_config: Mapping[str, Any]) -> str | None:
        # Newer checkpoints keep the template in its own file, which then wins (as in transformers).
        jinja_file = root / "chat_template.jinja" if root is not None else None
        if jinja_file is not None and jinja_file.exists():
            return read_text(jinja_file, what="chat template", error=TokenizerLoadError) or None
        template_json = _read_json(root / "chat_template.json", required=False) if root is not None else None
        file = "chat_template.json" if template_json else "tokenizer_config.json"
        template = (template_json or tok_config).get("chat_template")
        # transformers fails on anything else only when the template is rendered (or, for a list of
        # non-objects, as it loads): refused here, naming the file.
        if isinstance(template, list) and all(
                isinstance(t, Mapping) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)
                for t in template):
            # Some checkpoints store named templates; "default" is the one for plain chat.
            template = {t["name"]: t["template"] for t in template}.get("default")
        elif template is not None and not isinstance(template, str):
            raise TokenizerLoadError(f"{root / file if root is not None else file}: chat_template: expected a "
                                     "string or a list of {'name', 'template'} strings, got " + _show(template))
        return template or None

    def _apply_bos_eos_flags(self, tok_config: Mapping[str, Any], where: str) -> None:
        # The post-processor of tokenizer.json decides, as in transformers 5 (and so mlx-lm),
        # which ignores add_bos_token/add_eos_token whenever tokenizer.json exists. A tokenizer.json
        # without a post-processor gets one from those flags, as transformers 4 did: such files
        # come from converted SentencePiece models that rely on the flags for their BOS.
        if self._backend.post_processor is not None:
            return
        for key in ("add_bos_token", "add_eos_token"):  # bool("false") is True: a BOS nobody asked for
            if tok_config.get(key) is not None and not isinstance(tok_config[key], bool):
                raise TokenizerLoadError(f"{where}{key}: expected true or false, got {_show(tok_config[key])}")
        if not tok_config.get("add_bos_token") and not tok_config.get("add_eos_token"):
            return
        add_bos = bool(tok_config.get("add_bos_token", False)) and self.bos_token_id is not None
        eos = self.eos_token
        eos_id = self.token_to_id(eos) if eos is not None else None
        add_eos = bool(tok_config.get("add_eos_token", False)) and eos_id is not None
        bos = self.bos_token
        single = " ".join(([f"{bos}:0"] if add_bos else []) + ["$A:0"] + ([f"{eos}:0"] if add_eos else []))
        pair = single + " " + " ".join(([f"{bos}:1"] if add_bos else []) + ["$B:1"] + ([f"{eos}:1"] if add_eos else []))
        special: list[tuple[str, int]] = []
        if add_bos:
            special.append((bos, self.bos_token_id))  # type: ignore[arg-type]
        if add_eos:
            special.append((eos, eos_id))  # type: ignore[arg-type]
        self._backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)

    # -- special tokens ------------------------------------------------------------------------
    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    @property
    def pad_token(self) -> str | None:
        return self.special_tokens.get("pad_token")

    @property
    def unk_token(self) -> str | None:
        return self.special_tokens.get("unk_token")

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows, added tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The underlying `tokenizers.Tokenizer` (for offsets, batch encoding and the like)."""
        return self._backend

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """A token's own raw bytes (OpenAI's logprobs `bytes`), so that a character split over
        tokens comes back by joining them; its decoded text cannot give them (each piece of such a
        character decodes to U+FFFD alone). Byte-level tokens spell bytes in `BYTE_LEVEL`,
        SentencePiece's <0xNN> tokens are their byte and its other tokens whole characters;
        added tokens and other decoders give the UTF-8 of the token's text."""
        piece = None if token_id in self._added_ids else self._backend.id_to_token(token_id)
        if piece is not None and self._decoder_kind == "byte_level":
            spelled = [BYTE_LEVEL.get(c) for c in piece]
            if None not in spelled:  # else a character outside the alphabet: the token is its text
                return bytes(spelled)  # type: ignore[arg-type]
        elif piece is not None and self._decoder_kind == "byte_fallback":
            if token_id in self.byte_fallback_ids:
                return bytes([int(piece[3:5], 16)])  # "<0xNN>"
            # Whole characters, SentencePiece's word boundary "▁" a space (a decode of the token
            # alone would strip it as the text's first).
            return piece.replace("\u2581", " ").encode()
        return self.decode([token_id]).encode()

    # -- encode / decode -----------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):  # tokenizers' own message ("TextInputSequence must be str") names neither
            raise TypeError(f"text must be a str, not {type(text).__name__}")
        try:
            return self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError:
            # tokenizers says "TextInputSequence must be str" for a str it cannot take as UTF-8.
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise ValueError(f"text is not valid Unicode: {exc.reason} at index {exc.start} "
                                 f"({text[exc.start]!r})") from None
            raise

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def detokenizer(self, skip_special_tokens: bool = False) -> StreamingDetokenizer:
        return StreamingDetokenizer(self, skip_special_tokens=skip_special_tokens)


def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the character a byte-level BPE token uses -> the byte.
    Printable Latin-1 bytes stand for themselves; the others are shifted to U+0100 onwards."""
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    shifted = [b for b in range(256) if b not in kept]
    table = {chr(b): b for b in kept}
    table.update({chr(256 + n): b for n, b in enumerate(shifted)})
    return table


BYTE_LEVEL: dict[str, int] = _byte_level_table()
"""GPT-2's byte-level alphabet: the character a byte-level BPE token spells a byte with -> the byte."""
# The first byte of a character and, for those that restrict it, the range of its second byte.
_SECOND_BYTE = {0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F), 0xF0: (0x90, 0xBF), 0xF4: (0x80, 0x8F)}


def _char_length(lead: int) -> int:
    """Bytes in the UTF-8 character that starts with `lead`; 0 for a byte that cannot start one."""
    if lead < 0x80:
        return 1
    if 0xC2 <= lead <= 0xDF:
        return 2
    if 0xE0 <= lead <= 0xEF:
        return 3
    if 0xF0 <= lead <= 0xF4:
        return 4
    return 0


def unfinished_tail(data: bytes) -> int:
    """How many bytes at the end of `data` begin a UTF-8 character that more bytes could still
    complete (0 when `data` ends on a character boundary or with bytes that can never be valid:
    a stray continuation byte, a fifth byte, a surrogate)."""
    for back in range(1, min(3, len(data)) + 1):
        lead = data[-back]
        if 0x80 <= lead <= 0xBF:
            continue  # a continuation byte: its lead byte is further back
        if back >= _char_length(lead):
            return 0  # a complete character, or a byte that starts none
        low, high = _SECOND_BYTE.get(lead, (0x80, 0xBF))
        return back if back == 1 or low <= data[-back + 1] <= high else 0
    return 0


def decoder_kind(backend: tokenizers.Tokenizer) -> str:
    """How the pipeline's decoder turns tokens into bytes: "byte_level" (every token spells bytes
    in GPT-2's alphabet, `BYTE_LEVEL`, decoded together, an invalid sequence becoming U+FFFD),
    "byte_fallback" (SentencePiece-style: <0xNN> tokens are bytes, other tokens whole characters)
    or "other" (no token's bytes are known apart from its text)."""
    decoder = backend.decoder
    if decoder is None:
        return "other"
    spec = json.loads(decoder.__getstate__())
    steps = spec.get("decoders", []) if spec.get("type") == "Sequence" else [spec]
    kinds = {step.get("type") for step in steps if isinstance(step, dict)}
    if kinds == {"ByteLevel"}:
        return "byte_level"
    return "byte_fallback" if "ByteFallback" in kinds else "other"


class StreamingDetokenizer:
    """Turns token ids, one at a time, into text pieces, each given as soon as its token arrives.

    Each step decodes only a window: the ids of the last emitted piece (context for decoders that
    depend on it, such as a leading space dropped at the start) and the new ids; the text the
    window had before the new ids (`_prefix_text`) is cut off the front. A piece is "" while a
    character is incomplete; bytes that can never become a character (a stray continuation byte,
    a lead byte followed by a non-continuation) come out as U+FFFD at once, one per maximal
    invalid sequence, as Python's and Rust's lossy UTF-8 decoders write them.

    The pieces concatenate to `decode(all ids)` except where decode itself differs from that
    rule: `tokenizers`' ByteFallback decoder turns a whole run of <0xNN> tokens into one U+FFFD
    per byte when any byte of the run is invalid, where the stream keeps the run's valid
    characters. Byte-fallback tokens are therefore held outside the window until they form whole
    characters (which then enter it) or prove invalid (which become U+FFFD and are dropped), so
    that the window never holds a broken run. With byte-level tokens the window's own decode says
    what is there, and the token bytes only tell an unfinished character from an invalid one.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False) -> None:
        self._backend = tokenizer.backend
        self._decode = tokenizer.backend.decode
        self._token_bytes = tokenizer.token_bytes
        self._skip = skip_special_tokens
        self._skipped = tokenizer.special_ids if skip_special_tokens else frozenset()
        self._kind = decoder_kind(tokenizer.backend)
        self._byte_ids = tokenizer.byte_fallback_ids if self._kind == "byte_fallback" else frozenset()
        self._window: list[int] = []  # ids decoded together: the last piece's, then the unsettled ones
        self._read = 0  # window[:_read] is context already emitted in full
        self._prefix_text = ""  # the part of decode(window) already emitted
        self._pending: list[int] = []  # byte-fallback ids of a character still incomplete
        self._anchor: int | None = None  # a plain token, context after invalid bytes at the start

    def add(self, token_id: int) -> str:
        """Take one more id; return the text it completes (often "", never a broken character)."""
        token_id = int(token_id)
        if token_id in self._skipped:
            return ""  # decode drops it before its decoders run: it changes no neighbour's text
        if token_id in self._byte_ids:
            self._pending.append(token_id)
            return self._settle(final=False)
        text = self._settle(final=True)  # a whole token ends any byte run: what is pending is invalid
        self._window.append(token_id)
        return text + self._emit(final=False)

    def finish(self) -> str:
        """Return whatever is held back (an incomplete character comes out as U+FFFD here)."""
        return self._settle(final=True) + self._emit(final=True)

    def _byte(self, token_id: int) -> int:
        token = self._backend.id_to_token(token_id)
        if token is None:
            raise ValueError(f"token id {token_id} is not in the vocabulary")
        return int(token[3:5], 16)  # "<0xNN>"

    def _settle(self, *, final: bool) -> str:
        """Move the pending byte-fallback ids that form whole characters into the window, and turn
        those that can never form one into U+FFFD; keep an unfinished character unless `final`."""
        if not self._pending:
            return ""
        data = bytes(self._byte(i) for i in self._pending)
        end = len(data) - (0 if final else unfinished_tail(data))
        out: list[str] = []
        pos = 0
        while pos < end:
            try:
                data[pos:end].decode("utf-8")
                good, bad_end = end, end
            except UnicodeDecodeError as exc:
                good, bad_end = pos + exc.start, pos + exc.end
            if good > pos:
                self._window.extend(self._pending[pos:good])
                out.append(self._emit(final=False))
            if bad_end > good:
                out.append(_REPLACEMENT)
                if not self._window:
                    self._anchor_window()
            pos = bad_end
        del self._pending[:end]
        return "".join(out)

    def _anchor_window(self) -> None:
        """Invalid bytes at the very start became U+FFFD outside the window, so the next token is
        not the text's first: decoders that drop a leading space must not drop its space. Put a
        plain token in the window as emitted context to say so."""
        if self._anchor is None:
            for token_id in range(self._backend.get_vocab_size()):
                if token_id in self._byte_ids or token_id in self._skipped:
                    continue
                text = self._decode([token_id], skip_special_tokens=False)
                if text and not text[0].isspace() and _REPLACEMENT not in text:
                    self._anchor = token_id
                    break
            else:
                return  # no plain token: a leading space after the U+FFFD may be dropped
        self._window = [self._anchor]
        self._read = 1
        self._prefix_text = self._decode(self._window, skip_special_tokens=self._skip)

    def _unfinished(self) -> bool:
        """Whether the window's bytes end inside a character (byte-level tokens only)."""
        data = b""
        for token_id in reversed(self._window[self._read:]):
            data = self._token_bytes(token_id) + data
            if len(data) >= 3:
                break
        return unfinished_tail(data) > 0

    def _emit(self, *, final: bool) -> str:
        if len(self._window) <= self._read:
            return ""
        text = self._decode(self._window, skip_special_tokens=self._skip)
        if not text.startswith(self._prefix_text):
            return ""  # the context changed what came before (not seen with the supported decoders)
        if text.endswith(_REPLACEMENT) and not final:
            if self._kind == "other":
                return ""  # no way to tell an unfinished character from an invalid one: wait
            if self._kind == "byte_level" and self._unfinished():
                # Give what is complete; the unfinished character stays in the window.
                piece, self._prefix_text = text[len(self._prefix_text):-1], text[:-1]
                return piece
        piece = text[len(self._prefix_text):]
        # The next window starts at this piece's first id. A piece whose ids decode to nothing on
        # their own (a leading space the decoder drops) cannot anchor the next cut: keep the
        # window whole then.
        tail = self._decode(self._window[self._read:], skip_special_tokens=self._skip)
        if tail and text.endswith(tail):
            del self._window[:self._read]
            self._prefix_text = tail
        else:
            self._prefix_text = text
        self._read = len(self._window)
        return piece


def load_gguf_tokenizer(gguf_path: str | Path, reader: Any, model_type: str | None) -> Tokenizer:
    """The tokenizer of the GGUF model at `gguf_path` (`reader`: its GGUFReader), built from the
    sources `formats/gguf_tokenizer.py` reads."""
    # formats/gguf_tokenizer.py needs the optional `gguf` package: imported for GGUF files only.
    from .formats.gguf_tokenizer import tokenizer_sources  # noqa: PLC0415

    src = tokenizer_sources(gguf_path, reader, model_type)
    if src.file is not None:
        try:
            backend = tokenizers.Tokenizer.from_file(str(src.file))
        except Exception as exc:  # noqa: BLE001 - tokenizers raises plain Exception
            raise TokenizerLoadError(f"{src.file}: not a valid tokenizers file: {exc}") from exc
    elif src.pipeline is not None:
        backend = src.pipeline
    else:  # tokenizer_sources gives one of the two
        raise TokenizerLoadError(f"{gguf_path}: neither a tokenizer.json beside it nor a tokenizer in its metadata")
    return Tokenizer.from_parts(backend, tok_config=src.tok_config, special_map=src.special_map, config=src.config,
                                gen_config=src.gen_config)

"""Training data: JSON Lines in mlx-lm's formats, tokenized, and batched with padding.

Each line is one record: `{"text": ...}`, `{"prompt": ..., "completion": ...}` or `{"messages": [...]}`
(chat turns rendered with the model's chat template). A data directory holds `train.jsonl` and
optionally `valid.jsonl`; without `valid.jsonl` a fraction of the training records can be held out.
Errors name the file and the line.
"""
from __future__ import annotations

import io
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import pymlxc.core as mx
from pymlxc.core import Array
from pymlxc.files import read_bytes

from .config import Encoder

DATASET_LIMIT = 4 << 30  # bytes of one JSONL file; larger corpora belong in several files

FORMATS = ("text", "completion", "chat")


class DatasetError(ValueError):
    """A dataset that cannot be used: missing, empty, malformed JSON, or a record of no known format.
    The message names the file and the line."""


@dataclass(frozen=True)
class Record:
    """One parsed JSON line and where it came from."""

    data: dict[str, Any]
    source: str
    line: int

    @property
    def where(self) -> str:
        return f"{self.source}:{self.line}"


@dataclass(frozen=True)
class Example:
    """Tokens of one record; loss counts the tokens at positions >= `offset` (prompt masking)."""

    tokens: tuple[int, ...]
    offset: int
    where: str


def record_format(data: dict[str, Any]) -> str:
    if "prompt" in data and "completion" in data:
        return "completion"
    if "messages" in data:
        return "chat"
    if "text" in data:
        return "text"
    raise KeyError(f"no known format: keys {sorted(data)}; expected 'text', 'prompt'+'completion' or 'messages'")


def read_jsonl(path: str | Path) -> list[Record]:
    """Every non-blank line of `path` as a JSON object, in order; all records share one format."""
    path = Path(path)
    if not path.exists():
        raise DatasetError(f"no such dataset file: {path}")
    # Only a regular file of bounded size is read: a FIFO or a device would block or never end.
    raw = read_bytes(path, what="dataset file", max_bytes=DATASET_LIMIT)
    try:
        # utf-8-sig: a leading byte-order mark (Notepad, PowerShell) is no JSON error on line 1.
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        lineno = raw.count(b"\n", 0, exc.start) + 1
        raise DatasetError(f"{path}:{lineno}: not UTF-8 text (byte {raw[exc.start]:#04x}): "
                           "save the file as UTF-8") from None
    records: list[Record] = []
    first_format: str | None = None
    for lineno, line in enumerate(io.StringIO(text, newline=None), 1):  # open()'s newlines
        if not line.strip():
            continue
        try:
            data = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{path}:{lineno}: malformed JSON: {exc.msg} (column {exc.colno})") from None
        except RecursionError:  # a line of deeply nested brackets: the parser's recursion limit
            raise DatasetError(f"{path}:{lineno}: malformed JSON: nested too deeply") from None
        if not isinstance(data, dict):
            raise DatasetError(f"{path}:{lineno}: a record must be a JSON object, not {type(data).__name__}")
        try:
            fmt = record_format(data)
        except KeyError as exc:
            raise DatasetError(f"{path}:{lineno}: {exc.args[0]}") from None
        if first_format is None:
            first_format = fmt
        elif fmt != first_format:
            raise DatasetError(f"{path}:{lineno}: a {fmt!r} record in a {first_format!r} dataset "
                               "(all records of a file must have one format)")
        records.append(Record(data, str(path), lineno))
    if not records:
        raise DatasetError(f"{path}: the dataset is empty")
    return records


def load_records(data: str | Path, valid_split: float | None = None,
                 seed: int = 0) -> tuple[list[Record], list[Record]]:
    """(train, valid) records of a data directory (`train.jsonl`, optional `valid.jsonl`) or of one
    .jsonl file. `valid_split` holds out that fraction of the training records (seeded shuffle) when
    there is no `valid.jsonl`; with neither, the validation set is empty."""
    data = Path(data)
    if data.is_dir():
        train_file, valid_file = data / "train.jsonl", data / "valid.jsonl"
        # Whatever is there under these names is read: a FIFO or a directory is refused by name (by
        # read_jsonl), not taken for a missing file (a validation set skipped without a word).
        if not (train_file.exists() or train_file.is_symlink()):
            raise DatasetError(f"{data} has no train.jsonl")
        train = read_jsonl(train_file)
        if valid_file.exists() or valid_file.is_symlink():
            return train, read_jsonl(valid_file)
    elif data.is_file():
        train = read_jsonl(data)
    else:
        raise DatasetError(f"no such data directory or file: {data}")
    if not valid_split:
        return train, []
    n_valid = max(1, round(len(train) * valid_split))
    if n_valid >= len(train):
        raise DatasetError(f"{data}: {len(train)} record(s) are too few to hold out {valid_split:.0%} for validation")
    order = np.random.default_rng(seed).permutation(len(train))
    held = set(order[:n_valid].tolist())
    return [r for i, r in enumerate(train) if i not in held], [r for i, r in enumerate(train) if i in held]


def _messages(record: Record) -> list[dict[str, Any]]:
    messages = record.data["messages"]
    if not isinstance(messages, list) or not messages:
        raise DatasetError(f"{record.where}: 'messages' must be a non-empty list of chat turns")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise DatasetError(f"{record.where}: each message needs a 'role' (and 'content'): {m!r:.80}")
        # A template renders any value as text: a number as "5", a list of content parts as its
        # Python repr, which the model would then be trained on. None is OpenAI's "no content".
        if not isinstance(m["role"], str) or not isinstance(m.get("content"), str | None):
            raise DatasetError(f"{record.where}: message {i} needs a string 'role' and a string (or null) "
                               f"'content', not {m!r:.80}")
    return messages


def _tools(record: Record, encoder: Encoder) -> list[Any] | None:
    """A chat record's `tools` (None or [] for none), rendered into its template as mlx-lm's chat
    dataset renders them: a list of objects, and a model whose encoder can render them."""
    tools = record.data.get("tools")
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise DatasetError(f"{record.where}: 'tools' must be a list of objects (tool definitions), not "
                           f"{type(tools).__name__}" + (" with other items" if isinstance(tools, list) else ""))
    if encoder.render_chat_tools is None:
        raise DatasetError(f"{record.where}: records with 'tools' need a model whose chat template takes tool "
                           "definitions, and this encoder renders messages only")
    return tools


def _no_tools(record: Record) -> None:
    """A prompt/completion record's `tools` is refused: mlx-lm's completion dataset drops it, and a
    model trained on such records would learn tool calls without the definitions its prompts had.
    Chat records (`messages`) take them."""
    tools = record.data.get("tools")
    if tools is not None and tools != []:
        raise DatasetError(f"{record.where}: prompt/completion records with 'tools' are not supported (the "
                           "prompt is rendered without tool definitions); write the record as 'messages' with "
                           "'tools', or remove the 'tools' key")


def _string(record: Record, key: str) -> str:
    value = record.data[key]
    if not isinstance(value, str):
        raise DatasetError(f"{record.where}: {key!r} must be a string, not {type(value).__name__}")
    return value


def tokenize(record: Record, encoder: Encoder, mask_prompt: bool = True) -> Example:
    """Tokens of one record, and the offset of the first token that counts in the loss.

    text: the tokenizer's encoding plus EOS (offset 0). prompt/completion: a user and an assistant
    turn through the chat template (plain concatenation plus EOS when the model has none). messages:
    the whole chat through the template; with `mask_prompt` only the last turn counts.
    """
    fmt = record_format(record.data)
    try:
        if fmt == "text":
            tokens = list(encoder.encode(_string(record, "text")))
            if encoder.eos_token_id is not None and (not tokens or tokens[-1] != encoder.eos_token_id):
                tokens.append(encoder.eos_token_id)
            offset = 0
        elif fmt == "completion":
            _no_tools(record)
            prompt, completion = _string(record, "prompt"), _string(record, "completion")
            if encoder.render_chat is not None:
                turns = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
                tokens = encoder.encode_plain(encoder.render_chat(turns, False))
                offset = len(encoder.encode_plain(encoder.render_chat(turns[:1], True)))
            else:
                head = list(encoder.encode(prompt))
                tokens = head + list(encoder.encode_plain(completion))
                if encoder.eos_token_id is not None:
                    tokens.append(encoder.eos_token_id)
                offset = len(head)
        else:
            if encoder.render_chat is None:
                raise DatasetError(f"{record.where}: chat records need a chat template, and the model has none")
            messages = _messages(record)
            tools = _tools(record, encoder)
            render = encoder.render_chat
            if tools is not None and encoder.render_chat_tools is not None:
                with_tools = encoder.render_chat_tools
                render = lambda turns, add_generation_prompt: with_tools(turns, add_generation_prompt, tools)  # noqa: E731
            tokens = encoder.encode_plain(render(messages, False))
            offset = 0
            if len(messages) > 1:
                last_is_assistant = messages[-1].get("role") == "assistant"
                offset = len(encoder.encode_plain(render(messages[:-1], last_is_assistant)))
    except DatasetError:
        raise
    except Exception as exc:  # a template or tokenizer error: say which record caused it
        raise DatasetError(f"{record.where}: cannot tokenize the record: {exc}") from exc
    if len(tokens) < 2:
        raise DatasetError(f"{record.where}: the record has {len(tokens)} token(s); training needs at least 2")
    return Example(tuple(int(t) for t in tokens), offset if mask_prompt else 0, record.where)


def tokenize_all(records: Sequence[Record], encoder: Encoder, mask_prompt: bool = True) -> list[Example]:
    return [tokenize(r, encoder, mask_prompt) for r in records]


def check_token_ids(examples: Sequence[Example], vocab_size: int) -> None:
    """Every token id must have a row in the model's embedding and logits. A tokenizer's added
    token past them (a `<pad>` appended by a fine-tuning tool) is not refused by MLX's gather: it
    reads another row, and the loss of that target is taken from a logit that does not exist."""
    for e in examples:
        if min(e.tokens) >= 0 and max(e.tokens) < vocab_size:
            continue
        bad = next(t for t in e.tokens if not 0 <= t < vocab_size)
        raise DatasetError(f"{e.where}: token id {bad} is outside the model's vocabulary of {vocab_size} "
                           "(an added token of the tokenizer that the model has no embedding for)")


def check_batch_size(examples: Sequence[Example], batch_size: int, what: str) -> None:
    """At least `batch_size` examples, as mlx-lm requires: fewer would make one smaller batch, a
    run at another batch size than asked for. `what` names the data (its file)."""
    if len(examples) < batch_size:
        raise DatasetError(f"Dataset must have at least batch_size={batch_size} examples, but {what} has only "
                           f"{len(examples)}: lower batch_size or add examples")


@dataclass(frozen=True)
class Batch:
    """Padded inputs [B, T], next-token targets [B, T], the loss mask [B, T] and its token count."""

    inputs: Array
    targets: Array
    mask: Array
    ntokens: int


def make_batch(examples: Sequence[Example], max_seq_length: int, pad_id: int = 0) -> Batch:
    """Right-pad the examples (cut to `max_seq_length` + 1 tokens) into one batch. Position t of the
    targets is token t + 1; it counts when offset <= t + 1 < length (padding and prompt do not)."""
    lengths = [min(len(e.tokens), max_seq_length + 1) for e in examples]
    width = max(lengths)
    tokens = np.full((len(examples), width), pad_id, dtype=np.int32)
    mask = np.zeros((len(examples), width - 1), dtype=bool)
    for i, (e, n) in enumerate(zip(examples, lengths, strict=True)):
        tokens[i, :n] = e.tokens[:n]
        mask[i, max(e.offset, 1) - 1:n - 1] = True
    return Batch(mx.array(tokens[:, :-1]), mx.array(tokens[:, 1:]), mx.array(mask), int(mask.sum()))


def batch_order(examples: Sequence[Example], batch_size: int, *, seed: int = 0, shuffle: bool = True,
                loop: bool = True, drop_last: bool = True) -> Iterator[tuple[int, list[int]]]:
    """(epoch, example indices) of each batch. Examples of similar length are batched together (less
    padding); the order of batches is shuffled each epoch with a generator seeded by (seed, epoch), so
    the sequence depends only on the seed: a resumed run skips what it has done and sees the same
    batches as an uninterrupted one. With `loop`, epochs repeat forever; `drop_last` leaves out the
    short remainder batch; with it, fewer examples than `batch_size` are refused (there would be no
    full batch). Without it, they make one smaller batch (a whole validation set)."""
    if not examples:
        raise DatasetError("no examples to batch")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, not {batch_size}")
    if drop_last:
        check_batch_size(examples, batch_size, "the training set")
    by_length = sorted(range(len(examples)), key=lambda i: (len(examples[i].tokens), i))
    groups = [by_length[i:i + batch_size] for i in range(0, len(by_length), batch_size)]
    if drop_last and len(groups) > 1 and len(groups[-1]) < batch_size:
        groups.pop()
    epoch = 0
    while True:
        order = np.random.default_rng([seed, epoch]).permutation(len(groups)) if shuffle else range(len(groups))
        for g in order:
            yield epoch, groups[int(g)]
        epoch += 1
        if not loop:
            return


def iterate_batches(examples: Sequence[Example], batch_size: int, max_seq_length: int, *, seed: int = 0,
                    shuffle: bool = True, loop: bool = True, drop_last: bool = True,
                    skip: int = 0) -> Iterator[tuple[int, Batch]]:
    """(epoch, Batch) pairs in `batch_order`, after skipping the first `skip` batches."""
    for n, (epoch, indices) in enumerate(batch_order(examples, batch_size, seed=seed, shuffle=shuffle, loop=loop,
                                                     drop_last=drop_last)):
        if n >= skip:
            yield epoch, make_batch([examples[i] for i in indices], max_seq_length)


def count_truncated(examples: Sequence[Example], max_seq_length: int) -> int:
    return sum(1 for e in examples if len(e.tokens) > max_seq_length + 1)


def check_trained_tokens(examples: Sequence[Example], max_seq_length: int) -> None:
    """Every example must keep a token that counts in the loss once cut to `max_seq_length` + 1
    tokens (what `make_batch` keeps). One whose prompt fills that length would train on nothing
    while the steps of batches made only of such examples reported a loss of 0."""
    for e in examples:
        kept = min(len(e.tokens), max_seq_length + 1)
        if max(e.offset, 1) >= kept:
            why = (f"its prompt alone is {e.offset} tokens, and max_seq_length is {max_seq_length}"
                   if e.offset >= max_seq_length else f"every one of its {len(e.tokens)} tokens is masked as prompt")
            raise DatasetError(f"{e.where}: no token of the record counts in the loss: {why} "
                               "(raise max_seq_length, shorten the prompt, or turn mask_prompt off)")



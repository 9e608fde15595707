"""JSON Lines datasets: formats, errors naming file and line, splits, batching and masks."""
from __future__ import annotations

import dataclasses
import itertools
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pymlxc
from pymlxc.testing import write_tiny_model
from pymlxc.training import DatasetError, Encoder, load_records, make_batch, read_jsonl, tokenize
from pymlxc.training.data import Example, batch_order, check_token_ids, check_trained_tokens, iterate_batches

EOS = 0


def _encoder(chat: bool = True) -> Encoder:
    # characters as tokens (ord % 200 + 1); a "BOS" 255 from encode, none from encode_plain
    def plain(text: str) -> list[int]:
        return [ord(c) % 200 + 1 for c in text]

    def render(messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        text = "".join(f"<{m['role']}>{m['content']}|" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    return Encoder(encode=lambda t: [255, *plain(t)], encode_plain=plain, eos_token_id=EOS,
                   render_chat=render if chat else None)


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_text_records_get_bos_and_eos(tmp_path: Path) -> None:
    [rec] = read_jsonl(_write(tmp_path / "d.jsonl", ['{"text": "abc"}']))
    ex = tokenize(rec, _encoder())
    assert ex.tokens == (255, 98, 99, 100, EOS) and ex.offset == 0


def test_completion_records_mask_the_prompt(tmp_path: Path) -> None:
    [rec] = read_jsonl(_write(tmp_path / "d.jsonl", ['{"prompt": "hi", "completion": "yo"}']))
    enc = _encoder()
    ex = tokenize(rec, enc)
    full = enc.encode_plain("<user>hi|<assistant>yo|")
    assert list(ex.tokens) == full
    assert ex.offset == len(enc.encode_plain("<user>hi|<assistant>"))
    assert tokenize(rec, enc, mask_prompt=False).offset == 0
    # without a chat template: prompt (with BOS) + completion + EOS
    plain = tokenize(rec, _encoder(chat=False))
    assert plain.tokens == (255, *enc.encode_plain("hiyo"), EOS) and plain.offset == 3


def test_chat_records_mask_all_but_the_last_turn(tmp_path: Path) -> None:
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    [rec] = read_jsonl(_write(tmp_path / "d.jsonl", [json.dumps({"messages": msgs})]))
    enc = _encoder()
    ex = tokenize(rec, enc)
    assert ex.offset == len(enc.encode_plain("<system>s|<user>q|<assistant>"))
    with pytest.raises(DatasetError, match=r"d\.jsonl:1: chat records need a chat template"):
        tokenize(rec, _encoder(chat=False))


def test_malformed_json_names_file_and_line(tmp_path: Path) -> None:
    path = _write(tmp_path / "train.jsonl", ['{"text": "a"}', "", '{"text": "b"', '{"text": "c"}'])
    with pytest.raises(DatasetError, match=r"train\.jsonl:3: malformed JSON"):
        read_jsonl(path)


@pytest.mark.parametrize("lines, message", [
    ([], "the dataset is empty"),
    (["", "   "], "the dataset is empty"),
    (['["text"]'], r":1: a record must be a JSON object"),
    (['{"txt": "a"}'], r":1: no known format"),
    (['{"text": "a"}', '{"prompt": "p", "completion": "c"}'], r":2: a 'completion' record in a 'text' dataset"),
])
def test_bad_datasets(tmp_path: Path, lines: list[str], message: str) -> None:
    with pytest.raises(DatasetError, match=message):
        read_jsonl(_write(tmp_path / "d.jsonl", lines))


def test_wrong_value_types_name_the_line(tmp_path: Path) -> None:
    recs = read_jsonl(_write(tmp_path / "d.jsonl", ['{"text": "ok"}', '{"text": 5}']))
    with pytest.raises(DatasetError, match=r"d\.jsonl:2: 'text' must be a string"):
        tokenize(recs[1], _encoder())


def test_data_directory_and_split(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match=r"has no train\.jsonl"):
        load_records(tmp_path)
    with pytest.raises(DatasetError, match="no such data directory"):
        load_records(tmp_path / "nope")
    _write(tmp_path / "train.jsonl", [json.dumps({"text": f"t{i}"}) for i in range(10)])
    train, valid = load_records(tmp_path)
    assert len(train) == 10 and valid == []
    train, valid = load_records(tmp_path, valid_split=0.2, seed=1)
    assert len(train) == 8 and len(valid) == 2
    assert {r.line for r in train} | {r.line for r in valid} == set(range(1, 11))
    assert load_records(tmp_path, valid_split=0.2, seed=1)[1] == valid  # seeded
    _write(tmp_path / "valid.jsonl", ['{"text": "v"}'])
    train, valid = load_records(tmp_path, valid_split=0.2)
    assert len(train) == 10 and [r.data["text"] for r in valid] == ["v"]


def test_batch_padding_and_mask() -> None:
    a = Example((1, 2, 3, 4), offset=2, where="x:1")
    b = Example((5, 6), offset=0, where="x:2")
    batch = make_batch([a, b], max_seq_length=16)
    np.testing.assert_array_equal(np.array(batch.inputs), [[1, 2, 3], [5, 6, 0]])
    np.testing.assert_array_equal(np.array(batch.targets), [[2, 3, 4], [6, 0, 0]])
    # a: targets 3 and 4 are at token positions >= offset 2; b: its one real target
    np.testing.assert_array_equal(np.array(batch.mask), [[False, True, True], [True, False, False]])
    assert batch.ntokens == 3
    cut = make_batch([a], max_seq_length=2)
    assert cut.inputs.shape == (1, 2) and cut.ntokens == 1


def test_batch_order_is_seeded_and_resumable() -> None:
    examples = [Example(tuple(range(2 + i % 5)), 0, f"x:{i}") for i in range(10)]
    first = [ix for _, ix in itertools.islice(batch_order(examples, 3, seed=4), 12)]
    again = [ix for _, ix in itertools.islice(batch_order(examples, 3, seed=4), 12)]
    assert first == again
    assert all(len(ix) == 3 for ix in first)  # the short remainder is dropped
    resumed = [
        np.array(b.inputs).tolist() for _, b in itertools.islice(iterate_batches(examples, 3, 64, seed=4, skip=5), 3)
    ]
    full = [np.array(b.inputs).tolist() for _, b in itertools.islice(iterate_batches(examples, 3, 64, seed=4), 8)]
    assert resumed == full[5:8]
    once = list(iterate_batches(examples, 3, 64, shuffle=False, loop=False, drop_last=False))
    assert sum(b.inputs.shape[0] for _, b in once) == 10


@settings(max_examples=30, deadline=None)
@given(st.lists(st.text(min_size=0, max_size=20), min_size=1, max_size=8))
def test_jsonl_round_trip(tmp_path_factory: pytest.TempPathFactory, texts: list[str]) -> None:
    path = tmp_path_factory.mktemp("rt") / "d.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    records = read_jsonl(path)
    assert [r.data["text"] for r in records] == texts
    assert [r.line for r in records] == list(range(1, len(texts) + 1))


def test_a_deeply_nested_line_is_named(tmp_path: Path) -> None:
    """Escaped as a bare RecursionError (the CLI's "internal error") before."""
    path = _write(tmp_path / "d.jsonl", ['{"text": "a"}', '{"text": ' + "[" * 100_000 + "]" * 100_000 + "}"])
    with pytest.raises(DatasetError, match=r"d\.jsonl:2: malformed JSON: nested too deeply"):
        read_jsonl(path)


_NOT_TEXT = st.one_of(st.integers(), st.floats(allow_nan=False), st.booleans(),
                      st.lists(st.text(max_size=3), max_size=2),
                      st.dictionaries(st.sampled_from(["type", "text"]), st.text(max_size=3), max_size=2))


@settings(max_examples=30, deadline=None)
@given(value=_NOT_TEXT, field=st.sampled_from(["role", "content"]), index=st.integers(0, 1))
def test_chat_messages_need_text_roles_and_contents(tmp_path_factory: pytest.TempPathFactory, value: object,
                                                     field: str, index: int) -> None:
    """A template renders any value: content 5 became the text "5", a list of content parts its
    Python repr, and the model was trained on that without a word."""
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    msgs[index][field] = value
    path = tmp_path_factory.mktemp("chat") / "d.jsonl"
    [rec] = read_jsonl(_write(path, [json.dumps({"messages": msgs})]))
    with pytest.raises(DatasetError, match=rf"d\.jsonl:1: message {index} needs a string 'role'"):
        tokenize(rec, _encoder())


def test_a_null_content_is_still_accepted(tmp_path: Path) -> None:
    # OpenAI's content=None (a tool-call turn): the template decides what it renders, as in mlx-lm
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": None}]
    [rec] = read_jsonl(_write(tmp_path / "d.jsonl", [json.dumps({"messages": msgs})]))
    assert tokenize(rec, _encoder()).tokens


def test_data_files_that_are_no_regular_files_are_named(tmp_path: Path) -> None:
    """A valid.jsonl that was a directory or a FIFO was skipped (no validation, silently); a
    train.jsonl of that kind was reported as missing."""
    _write(tmp_path / "train.jsonl", ['{"text": "a"}', '{"text": "b"}'])
    (tmp_path / "valid.jsonl").mkdir()
    with pytest.raises(OSError, match=r"valid\.jsonl is a directory, not a regular file"):
        load_records(tmp_path)
    (tmp_path / "valid.jsonl").rmdir()
    os.mkfifo(tmp_path / "valid.jsonl")
    with pytest.raises(OSError, match=r"valid\.jsonl is a FIFO"):
        load_records(tmp_path)
    other = tmp_path / "other"
    (other / "train.jsonl").mkdir(parents=True)
    with pytest.raises(OSError, match=r"train\.jsonl is a directory"):
        load_records(other)


@settings(max_examples=200, deadline=None)
@given(length=st.integers(2, 12), offset=st.integers(0, 14), max_seq_length=st.integers(1, 12))
def test_an_example_is_refused_exactly_when_its_batch_would_train_on_nothing(length: int, offset: int,
                                                                              max_seq_length: int) -> None:
    """An example whose prompt fills max_seq_length (or that is all prompt) was trained on at a
    loss of 0 (0 tokens); now it is named. The check agrees with make_batch's mask."""
    example = Example(tuple(range(1, length + 1)), offset, "d.jsonl:7")
    trained = make_batch([example], max_seq_length).ntokens
    if trained:
        check_trained_tokens([example], max_seq_length)
    else:
        with pytest.raises(DatasetError, match=r"d\.jsonl:7: no token of the record counts in the loss"):
            check_trained_tokens([example], max_seq_length)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 9), batch_size=st.integers(1, 12))
def test_training_batches_are_full_or_refused(n: int, batch_size: int) -> None:
    """Fewer examples than batch_size were batched as one smaller batch: a run at another batch
    size than asked for, without a word. mlx-lm refuses them; so does the training order now. The
    validation order (drop_last=False) still covers every example once, in batches of at most batch_size."""
    examples = [Example(tuple(range(2 + i % 3)), 0, f"x:{i}") for i in range(n)]
    if n < batch_size:
        with pytest.raises(DatasetError, match=rf"at least batch_size={batch_size} examples, .* has only {n}"):
            next(batch_order(examples, batch_size))
    else:
        assert all(len(ix) == batch_size for _, ix in itertools.islice(batch_order(examples, batch_size), 10))
    once = [ix for _, ix in batch_order(examples, batch_size, loop=False, drop_last=False)]
    assert sorted(i for ix in once for i in ix) == list(range(n)) and all(len(ix) <= batch_size for ix in once)


def test_bytes_that_are_not_utf8_name_the_line(tmp_path: Path) -> None:
    """The error named the file and a byte offset into it; the line is what a user can find."""
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"text": "a"}\n{"text": "b"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(DatasetError, match=r"d\.jsonl:3: not UTF-8 text \(byte 0xe9\)"):
        read_jsonl(path)


def test_a_byte_order_mark_is_no_json_error(tmp_path: Path) -> None:
    """A file saved with a BOM (Notepad, PowerShell) failed as 'malformed JSON' on line 1."""
    path = tmp_path / "d.jsonl"
    path.write_bytes("\ufeff".encode() + b'{"text": "a"}\n{"text": "b"}\n')
    assert [r.data["text"] for r in read_jsonl(path)] == ["a", "b"]


_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
_CHAT = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]


def _tools_encoder() -> Encoder:
    """`_encoder`'s, its template writing the tool names first where a record has tools."""
    base = _encoder()
    assert base.render_chat is not None

    def render_tools(messages: Sequence[Any], add_generation_prompt: bool, tools: Sequence[Any]) -> str:
        names = ",".join(t["function"]["name"] for t in tools)
        return f"[{names}]" + base.render_chat(messages, add_generation_prompt)  # type: ignore[misc]

    return dataclasses.replace(base, render_chat_tools=render_tools)


def test_chat_records_with_tools_render_them_as_the_prompt(tmp_path: Path) -> None:
    """A chat record's tools reach the template (mlx-lm's chat dataset renders them), and the
    masked prompt covers them: only the last turn counts."""
    [rec] = read_jsonl(_write(tmp_path / "d.jsonl", [json.dumps({"messages": _CHAT, "tools": _TOOLS})]))
    ex = tokenize(rec, _tools_encoder())
    plain = [ord(c) % 200 + 1 for c in "[get_weather]<user>q|<assistant>a|"]
    assert list(ex.tokens) == plain
    assert ex.offset == len("[get_weather]<user>q|<assistant>")
    for none in (None, []):  # no tools: the template without them
        [rec] = read_jsonl(_write(tmp_path / "d.jsonl", [json.dumps({"messages": _CHAT, "tools": none})]))
        assert list(tokenize(rec, _tools_encoder()).tokens) == plain[len("[get_weather]"):]


@pytest.mark.parametrize(("record", "message"), [
    ({"messages": _CHAT, "tools": _TOOLS}, r"d\.jsonl:1: records with 'tools' need a model whose chat template"),
    ({"messages": _CHAT, "tools": {"name": "f"}}, r"d\.jsonl:1: 'tools' must be a list of objects"),
    ({"messages": _CHAT, "tools": ["f"]}, r"d\.jsonl:1: 'tools' must be a list of objects"),
    ({"prompt": "q", "completion": "a", "tools": _TOOLS},
     r"d\.jsonl:1: prompt/completion records with 'tools' are not supported"),
])
def test_tools_that_cannot_be_rendered_are_refused(tmp_path: Path, record: dict, message: str) -> None:
    """Where the tools would be dropped (an encoder without them, a prompt/completion record, which
    mlx-lm renders without them) or are not tool definitions, the record is refused by line; a
    model trained on such records would learn tool calls its prompts never defined."""
    [rec] = read_jsonl(_write(tmp_path / "d.jsonl", [json.dumps(record)]))
    encoder = _encoder() if "need a model" in message else _tools_encoder()
    with pytest.raises(DatasetError, match=message):
        tokenize(rec, encoder)
    [rec] = read_jsonl(_write(tmp_path / "d.jsonl", [json.dumps({**record, "tools": None})]))
    assert tokenize(rec, encoder).tokens


def test_a_models_encoder_renders_tools_through_its_template(tmp_path: Path) -> None:
    """The metal backend's training encoder passes a record's tools to the chat template as
    `tools`, as generation does."""
    template = ("{% if tools %}TOOLS{% for t in tools %} {{ t.function.name }}{% endfor %}\n{% endif %}"
                "{% for m in messages %}<{{ m.role }}>{{ m.content }}|{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    path = write_tiny_model(tmp_path / "m", "llama", seed=0, chat_template=template)
    with pymlxc.load_model(str(path), backend="metal") as model:
        encoder = model.training_encoder()
        [rec] = read_jsonl(_write(tmp_path / "d.jsonl", [json.dumps({"messages": _CHAT, "tools": _TOOLS})]))
        ex = tokenize(rec, encoder)
        # The newline after a block tag goes, as transformers renders (trim_blocks).
        assert list(ex.tokens) == encoder.encode_plain("TOOLS get_weather<user>q|<assistant>a|")
        assert ex.offset == len(encoder.encode_plain("TOOLS get_weather<user>q|<assistant>"))


@settings(max_examples=50, deadline=None)
@given(tokens=st.lists(st.integers(-3, 40), min_size=2, max_size=8), vocab=st.integers(1, 40))
def test_token_ids_outside_the_vocabulary_are_named(tokens: list[int], vocab: int) -> None:
    example = Example(tuple(tokens), 0, "d.jsonl:4")
    if all(0 <= t < vocab for t in tokens):
        check_token_ids([example], vocab)
    else:
        bad = next(t for t in tokens if not 0 <= t < vocab)
        with pytest.raises(DatasetError, match=rf"d\.jsonl:4: token id {bad} is outside the model's vocabulary"):
            check_token_ids([example], vocab)

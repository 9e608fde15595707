"""The protocol module alone: lines round-trip, requests validate, and every refusal names its cause."""
from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pymlxc.bridge import protocol as P

json_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text()
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)
json_objects = st.dictionaries(st.text(), json_values, max_size=6)


@given(json_objects)
def test_any_object_round_trips_as_one_ascii_line(message: dict[str, Any]) -> None:
    line = P.encode(message)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert line.isascii()
    assert P.decode(line) == message
    assert P.decode(line.decode()) == message  # str lines too


ids = st.none() | st.integers() | st.text(max_size=10)
sampling = st.fixed_dictionaries(
    {},
    optional={
        "max_tokens": st.integers(0, 10_000),
        "temperature": st.just(0.0) | st.floats(P.MIN_TEMPERATURE, 5),
        "top_k": st.integers(0, 100),
        "top_p": st.just(0.0) | st.floats(P.FLOAT32_TINY, 1),
        "min_p": st.just(0.0) | st.floats(P.FLOAT32_TINY, 1),
        "repeat_penalty": st.floats(0.01, 5),
        "stop_tokens": st.lists(st.integers(0, 100_000), max_size=4),
        "seed": st.none() | st.integers(0, 2**31),
        "return_logits": st.booleans(),
    },
)
messages = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": st.text()}),
    min_size=1,
    max_size=3,
)
requests = st.one_of(
    st.builds(lambda p, s: {"cmd": "generate", "prompt": p, **s}, st.text(), sampling),
    st.builds(lambda m, s: {"cmd": "chat", "messages": m, **s}, messages, sampling),
    st.builds(lambda ps, s: {"cmd": "classify", "prompts": ps, **s}, st.lists(st.text(), max_size=3), sampling),
    st.builds(lambda ps, s: {"cmd": "batch_generate", "prompts": ps, **s}, st.lists(st.text(), max_size=3), sampling),
    st.builds(
        lambda p, a, c: {"cmd": "load", "path": p, "adapter_path": a, "context_len": c},
        st.text(),
        st.none() | st.text(),
        st.none() | st.integers(1, 10**6),
    ),
    st.builds(lambda t, a: {"cmd": "encode", "text": t, "add_special_tokens": a}, st.text(), st.booleans()),
    st.builds(lambda t: {"cmd": "decode", "tokens": t}, st.lists(st.integers(0, 10**6), max_size=5)),
    st.sampled_from([{"cmd": "info"}, {"cmd": "cancel"}, {"cmd": "quit"}]),
)


@given(requests, ids)
def test_valid_requests_round_trip_through_encode_decode_and_parse(message: dict[str, Any], rid: Any) -> None:
    if rid is not None:
        message = {**message, "id": rid}
    request = P.parse_request(P.decode(P.encode(message)))
    assert request.cmd == message["cmd"] and request.id == rid
    for key, value in message.items():
        if key not in P.ENVELOPE:
            assert request.args[key] == value
    assert set(request.args) == set(P.COMMANDS[request.cmd])  # defaults filled in
    assert P.parse_request(P.decode(P.encode(request.to_message()))) == request


@pytest.mark.parametrize(
    "message, code, mentions",
    [
        ({"prompt": "x"}, "missing_field", "cmd"),
        ({"cmd": 3}, "bad_field", "cmd"),
        ({"cmd": "dance"}, "unknown_command", "dance"),
        ({"cmd": "generate"}, "missing_field", "prompt"),
        ({"cmd": "generate", "prompt": 5}, "bad_field", "prompt"),
        ({"cmd": "generate", "prompt": "x", "max_tokens": True}, "bad_field", "max_tokens"),
        ({"cmd": "generate", "prompt": "x", "max_tokens": 2.0}, "bad_field", "max_tokens"),
        ({"cmd": "generate", "prompt": "x", "max_tokens": -1}, "bad_field", "max_tokens"),
        ({"cmd": "generate", "prompt": "x", "temperature": "hot"}, "bad_field", "temperature"),
        ({"cmd": "generate", "prompt": "x", "top_p": 1.5}, "bad_field", "top_p"),
        ({"cmd": "generate", "prompt": "x", "repeat_penalty": 0}, "bad_field", "repeat_penalty"),
        # pymlxc's own bounds (pymlxc/options.py): float32 sampling overflows outside them.
        ({"cmd": "generate", "prompt": "x", "temperature": 1e-300}, "bad_field", "temperature"),
        ({"cmd": "generate", "prompt": "x", "temperature": 1e-7}, "bad_field", "temperature"),
        ({"cmd": "generate", "prompt": "x", "temperature": 1e308}, "bad_field", "temperature"),
        ({"cmd": "generate", "prompt": "x", "top_p": 1e-300}, "bad_field", "top_p"),
        ({"cmd": "generate", "prompt": "x", "min_p": 1e-40}, "bad_field", "min_p"),
        ({"cmd": "generate", "prompt": "x", "repeat_penalty": 1e-300}, "bad_field", "repeat_penalty"),
        ({"cmd": "generate", "prompt": "x", "repeat_penalty": 1000}, "bad_field", "repeat_penalty"),
        # A lone surrogate (JSON's "\ud800") no tokenizer can encode: refused, with its position.
        ({"cmd": "generate", "prompt": "a\ud800"}, "bad_field", "position 1"),
        ({"cmd": "encode", "text": "a\ud800"}, "bad_field", "position 1"),
        ({"cmd": "chat", "messages": [{"role": "user", "content": "ab\udc00"}]}, "bad_field", "position 2"),
        ({"cmd": "generate", "prompt": "x", "stop_tokens": [1, "2"]}, "bad_field", "item 1"),
        ({"cmd": "generate", "prompt": "x", "seed": 1.5}, "bad_field", "seed"),
        ({"cmd": "generate", "prompt": "x", "temprature": 1}, "unknown_field", "temprature"),
        ({"cmd": "chat", "messages": []}, "bad_field", "empty"),
        ({"cmd": "chat", "messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": [1]},
         "bad_field", "chat_template_kwargs"),
        ({"cmd": "chat", "messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"_x": 1}},
         "bad_field", "template variable name"),
        # Names the chat call passes itself: a clash (TypeError) or another return type (tokenize).
        *[({"cmd": "chat", "messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {name: False}},
           "bad_field", name) for name in ("add_generation_prompt", "messages", "tokenize", "conversation")],
        ({"cmd": "chat", "messages": [{"role": "user", "content": "x"}],
          "chat_template_kwargs": {f"k{i}": i for i in range(65)}}, "bad_field", "at most 64"),
        ({"cmd": "chat", "messages": [{"role": "user"}]}, "bad_field", "content"),
        ({"cmd": "chat", "messages": [{"role": "user", "content": "x", "tool_calls": [{"name": "a\ud800"}]}]},
         "bad_field", "messages item 0 tool_calls[0].name has a lone surrogate"),
        ({"cmd": "chat", "messages": [{"role": "user", "content": "x", "b\udc00": 1}]}, "bad_field",
         "messages item 0 key has a lone surrogate"),
        ({"cmd": "classify", "prompts": "abc"}, "bad_field", "prompts"),
        ({"cmd": "decode", "tokens": [-1]}, "bad_field", "tokens"),
        ({"cmd": "info", "id": [1]}, "bad_field", "id"),
        ({"cmd": "info", "id": True}, "bad_field", "id"),
    ],
)
def test_bad_requests_are_refused_naming_the_problem(message: dict[str, Any], code: str, mentions: str) -> None:
    with pytest.raises(P.ProtocolError) as caught:
        P.parse_request(message)
    assert caught.value.code == code
    assert mentions in str(caught.value)


@pytest.mark.parametrize(
    "line, code",
    [
        (b"", "bad_json"),
        (b"   \r\n", "bad_json"),
        (b"{", "bad_json"),
        (b"\xff\xfe{}", "bad_json"),
        (b'{"cmd": NaN}', "bad_json"),
        (b'{"x": -Infinity}', "bad_json"),
        (b"[1, 2]", "bad_request"),
        (b'"cmd"', "bad_request"),
        (b"1" * 5000, "bad_json"),  # more digits than Python converts to an int
        (b"[" * 100_000, "bad_json"),  # deeper than the parser recurses
    ],
)
def test_undecodable_lines_raise_protocol_errors(line: bytes, code: str) -> None:
    with pytest.raises(P.ProtocolError) as caught:
        P.decode(line)
    assert caught.value.code == code


@settings(max_examples=200)
@given(st.binary(max_size=200))
def test_decode_of_arbitrary_bytes_gives_an_object_or_a_protocol_error(line: bytes) -> None:
    try:
        value = P.decode(line)
    except P.ProtocolError as e:
        assert e.code in ("bad_json", "bad_request")
    else:
        assert isinstance(value, dict)


def test_replies_refuse_non_finite_numbers_and_check_their_type() -> None:
    with pytest.raises(ValueError):
        P.encode(P.done(1, "length", prompt_tps=float("nan")))
    assert P.check_reply(json.loads(P.encode(P.token(1, 5, "a")))) == "token"
    with pytest.raises(P.ProtocolError):
        P.check_reply({"type": "gossip"})


@given(st.floats(min_value=-1.1e-38, max_value=1.1e-38, allow_subnormal=True).filter(lambda v: v != 0.0))
def test_float32_subnormal_numbers_are_refused_naming_the_field(value: float) -> None:
    with pytest.raises(P.ProtocolError, match=r"top_p .*subnormal"):
        P.parse_request({"cmd": "generate", "prompt": "x", "top_p": abs(value)})


def _chat_with(kwargs: Any) -> dict[str, Any]:
    return {"cmd": "chat", "messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": kwargs}


template_lists = st.sampled_from(["tools", "documents"])
json_dicts = st.dictionaries(st.text(), json_values, max_size=3)


@given(template_lists, json_values.filter(lambda v: v is not None and not isinstance(v, list)))
def test_tools_or_documents_not_an_array_are_refused_naming_the_variable(name: str, value: Any) -> None:
    # They reached the template: mlx-lm's apply_chat_template failed ("'int' object is not iterable").
    with pytest.raises(P.ProtocolError) as caught:
        P.parse_request(P.decode(P.encode(_chat_with({name: value}))))
    assert caught.value.code == "bad_field"
    assert str(caught.value).startswith(f"chat: chat_template_kwargs.{name} must be a list of objects")


@given(template_lists, st.lists(json_dicts, max_size=3), json_values.filter(lambda v: not isinstance(v, dict)),
       st.data())
def test_an_item_of_tools_or_documents_not_an_object_is_refused_naming_its_index(
        name: str, items: list[Any], bad: Any, data: st.DataObject) -> None:
    at = data.draw(st.integers(0, len(items)))
    with pytest.raises(P.ProtocolError) as caught:
        P.parse_request(_chat_with({name: [*items[:at], bad, *items[at:]]}))
    assert caught.value.code == "bad_field"
    assert str(caught.value).startswith(f"chat: chat_template_kwargs.{name} item {at} must be an object")


@given(template_lists, st.none() | st.lists(json_dicts, max_size=3))
def test_tools_or_documents_as_null_or_arrays_of_objects_pass(name: str, value: Any) -> None:
    assert P.parse_request(_chat_with({name: value})).args["chat_template_kwargs"] == {name: value}


@pytest.mark.parametrize("tokens, limit, refused", [(5, None, False), (5, 5, False), (6, 5, True), (10**7, 4096, True)])
def test_context_problem_refuses_only_past_the_limit(tokens: int, limit: int | None, refused: bool) -> None:
    problem = P.context_problem(tokens, limit)
    assert (problem == f"the prompt has {tokens} tokens, more than the context length of {limit}") is refused
    assert (problem is None) is not refused


def test_a_messages_other_keys_reach_the_template_as_they_are_less_nulls() -> None:
    # As transformers' apply_chat_template passes them (it drops null values itself, since templates
    # render None as "None"); version 3 refused any key but role and content.
    calls = [{"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]
    message = {"role": "assistant", "content": "", "tool_calls": calls, "name": "bob", "x-trace": [1, 2.5, True],
               "reasoning_content": None}
    request = P.parse_request({"cmd": "chat", "messages": [message]})
    assert request.args["messages"] == [{"role": "assistant", "content": "", "tool_calls": calls, "name": "bob",
                                         "x-trace": [1, 2.5, True]}]

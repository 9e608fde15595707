"""The JSON Lines protocol of the worker: line encoding, request schemas and validation, reply shapes.

Standard library only: the worker may run in a Python that has mlx-lm but not pymlxc, and the client
imports this same module, so both sides agree on one definition. PROTOCOL.md is the prose version.
"""
from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

PROTOCOL_VERSION = 5
# Versions a client of this module can talk to: 2 added `inspect_attention` and changed nothing else,
# so a version 1 worker serves every other command; 3 made `classify` logits raw logits (they were
# log-probabilities), so the client asks only a version 3 worker for them; 4 refuses a prompt past
# the context (`context_length_exceeded`) and passes a chat message's other keys to the template;
# 5 ends a batch_generate row where the context is full (its error says so).
COMPATIBLE_VERSIONS = (1, 2, 3, 4, 5)
MAX_LINE_BYTES = 16 * 1024 * 1024  # a line longer than this is refused unread (prompts are text, not tensors)
# The sampling bounds of the library's options (pymlxc/options.py imports them) and of this wire check.
FLOAT32_TINY = 1.1754943508222875e-38  # the smallest normal float32: below it, dividing by a value overflows
# A positive temperature divides the float32 logits: below MIN_TEMPERATURE 1/temperature overflows
# them for ordinary logit sizes, above MAX_TEMPERATURE it rounds them (and -inf filters) to NaN.
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-6, 1e6
# The repeat penalty multiplies or divides logits in the model's dtype (float16 overflows at 65504).
MIN_REPEAT_PENALTY, MAX_REPEAT_PENALTY = 1e-2, 1e2
# How many of the latest ids (prompt and output) the repeat penalty looks at: llama.cpp's repeat_last_n,
# on both backends (mlx-lm's own default is 20).
REPEAT_PENALTY_CONTEXT = 64
# The longest `context_len` a load takes: mlx-lm's batch caches (batch_generate, classify) hold their
# size as an int32, so a larger one loaded and then failed every batch ("std::bad_cast", "Converting
# ... to int32 would result in overflow"), naming no field.
MAX_CONTEXT_LEN = 2**31 - 1

REPLY_TYPES = ("hello", "progress", "token", "done", "result", "error")
TERMINAL_TYPES = ("done", "result", "error")  # each request gets exactly one of these
FINISH_REASONS = ("stop", "length", "cancelled")


class CommandError(Exception):
    """A command that cannot be done; the worker answers it with an `error` reply carrying `code`
    (and `fields`, facts a client can act on without reading the message)."""

    def __init__(self, code: str, message: str, **fields: Any) -> None:
        super().__init__(message)
        self.code = code
        self.fields = fields


class ProtocolError(CommandError, ValueError):
    """A line or request the protocol does not allow."""


# ---- lines ---------------------------------------------------------------------------------------


def encode(message: Mapping[str, Any]) -> bytes:
    """One message as one line: compact JSON, ASCII-only (so no byte can be a newline), then b"\\n"."""
    return json.dumps(message, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii") + b"\n"


def _no_constants(name: str) -> Any:
    raise ProtocolError("bad_json", f"{name} is not valid JSON")


def decode(line: bytes | str) -> dict[str, Any]:
    """Parse one line into a JSON object, or raise ProtocolError naming what is wrong with it."""
    if isinstance(line, bytes):
        try:
            line = line.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ProtocolError("bad_json", f"line is not UTF-8 ({e.reason} at byte {e.start})") from None
    if not line.strip():
        raise ProtocolError("bad_json", "empty line")
    try:
        value = json.loads(line, parse_constant=_no_constants)
    except ProtocolError:
        raise
    except json.JSONDecodeError as e:
        raise ProtocolError("bad_json", f"not JSON: {e.msg} at column {e.colno}") from None
    except RecursionError:
        raise ProtocolError("bad_json", "JSON nested too deeply") from None
    except ValueError as e:  # e.g. an integer with more digits than Python converts
        raise ProtocolError("bad_json", f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise ProtocolError("bad_request", f"a line must be a JSON object, not {_kind(value)}")
    return value


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return f"a {type(value).__name__}"  # not a JSON value: the library's checks see Python ones


# ---- field checks --------------------------------------------------------------------------------
# Each check returns the value as the worker uses it, or raises ValueError with what was expected.


def _int(value: Any) -> int:
    # bool is an int in Python but not in JSON; a float like 3.0 is refused too, to keep types honest.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"must be an integer, not {_kind(value)}")
    return value


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"must be a number, not {_kind(value)}")
    try:
        number = float(value)
    except OverflowError:  # an integer too large for a float
        raise ValueError(f"must be finite, not an integer of {len(str(value))} digits") from None
    if not math.isfinite(number):
        raise ValueError("must be finite")
    if number != 0.0 and abs(number) < FLOAT32_TINY:
        # Sampling runs in float32, where such a number is subnormal or 0: dividing by it overflows.
        raise ValueError(f"must be 0 or at least {FLOAT32_TINY:g} in size (a float32 subnormal), not {number!r}")
    return number


def surrogate_problem(text: str) -> str | None:
    """Where `text` holds a lone surrogate (from a bad decode upstream, or JSON's \\ud800), which no
    tokenizer can encode; None where it is valid Unicode. The library's check_text says it too."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"has a lone surrogate {text[e.start]!r} at position {e.start}: not valid Unicode text"
    return None


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"must be a string, not {_kind(value)}")
    problem = surrogate_problem(value)
    if problem is not None:
        raise ValueError(problem)
    return value


def _bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"must be a boolean, not {_kind(value)}")
    return value


def _list_of(item: Callable[[Any], Any], what: str) -> Callable[[Any], list[Any]]:
    def check(value: Any) -> list[Any]:
        if not isinstance(value, list):
            raise ValueError(f"must be an array of {what}, not {_kind(value)}")
        out = []
        for i, v in enumerate(value):
            try:
                out.append(item(v))
            except ValueError as e:
                raise ValueError(f"item {i} {e}") from None
        return out

    return check


def _at_least(check: Callable[[Any], Any], low: float) -> Callable[[Any], Any]:
    def bounded(value: Any) -> Any:
        v = check(value)
        if v < low:
            raise ValueError(f"must be >= {low}, not {v}")
        return v

    return bounded


def _at_most(check: Callable[[Any], Any], high: int) -> Callable[[Any], Any]:
    def bounded(value: Any) -> Any:
        v = check(value)
        if v > high:
            raise ValueError(f"must be <= {high}, not {v}")
        return v

    return bounded


def _unit(value: Any) -> float:
    v = _number(value)
    if not 0.0 <= v <= 1.0:
        raise ValueError(f"must be in [0, 1], not {v}")
    return v


def _temperature(value: Any) -> float:
    v = _number(value)
    if v != 0.0 and not MIN_TEMPERATURE <= v <= MAX_TEMPERATURE:
        raise ValueError(f"must be 0 (greedy) or in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}], not {v!r}")
    return v


def _repeat_penalty(value: Any) -> float:
    v = _number(value)
    if not MIN_REPEAT_PENALTY <= v <= MAX_REPEAT_PENALTY:
        raise ValueError(f"must be in [{MIN_REPEAT_PENALTY:g}, {MAX_REPEAT_PENALTY:g}], not {v!r}")
    return v


def _optional(check: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda value: None if value is None else check(value)


def _message(value: Any) -> dict[str, Any]:
    """A chat message: string role and content; its other keys go to the template as they are (as
    transformers' apply_chat_template passes them: `name`, `tool_calls`, `reasoning_content`...),
    less those that are null, which transformers leaves out."""
    if not isinstance(value, dict):
        raise ValueError(f"must be an object with role and content, not {_kind(value)}")
    for key in ("role", "content"):
        if key not in value:
            raise ValueError(f"lacks {key!r}")
        try:
            _str(value[key])
        except ValueError as e:
            raise ValueError(f"{key} {e}") from None
    problem = _surrogate_within(value)  # the other keys' strings, their own keys included
    if problem is not None:
        raise ValueError(problem.removeprefix(".").strip())  # "tool_calls[0].name has a lone surrogate ..."
    return {key: v for key, v in value.items() if v is not None}


MAX_TEMPLATE_KWARGS = 64  # variables a chat call may hand its template (enable_thinking, tools, ...)
# Names the chat call passes itself: the arguments of pymlxc's render_chat (backends/metal/chat_template.py)
# and of transformers' apply_chat_template, which mlx-lm calls. Given again as template variables they
# would clash with the call's own (a TypeError) or change what it returns (tokenize, return_dict).
RESERVED_TEMPLATE_NAMES = frozenset({
    "messages", "add_generation_prompt", "tokenizer", "guard", "seconds",
    "conversation", "chat_template", "continue_final_message", "tokenize", "sanitize_control_tokens", "padding",
    "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})


def template_name_problem(key: Any) -> str | None:
    """Why `key` cannot be a chat template variable, or None when it can."""
    if not isinstance(key, str) or not key.isidentifier() or key.startswith("_"):
        return f"{key!r} is not a template variable name"
    if key in RESERVED_TEMPLATE_NAMES:
        return f"{key!r} is set by the chat call itself, not a template variable it takes"
    return None


# Variables with a meaning fixed by transformers' apply_chat_template (which mlx-lm calls), and so
# by the templates written for it: what each item must be (a JSON object; transformers also takes a
# Python function as a tool, but neither the wire nor pymlxc's render_chat converts one).
LIST_TEMPLATE_VARIABLES = {"tools": "a tool's JSON schema", "documents": "a document's fields"}


def template_value_problem(key: str, value: Any, kind: Callable[[Any], str] = _kind) -> str | None:
    """Why `value` cannot be the template variable `key`, or None when it can (`kind` names a wrong
    value's type). `tools` and `documents` are null or a list of objects: anything else failed
    inside the template ("'int' object is not iterable") or rendered silently wrong (a string's
    characters or a dict's keys as the tools)."""
    item = LIST_TEMPLATE_VARIABLES.get(key)
    if item is None or value is None:
        return None
    if not isinstance(value, (list, tuple)):
        return f"must be a list of objects ({item} each), not {kind(value)}"
    for i, v in enumerate(value):
        if not isinstance(v, dict):
            return f"item {i} must be an object ({item}), not {kind(v)}"
    return None


class _PartError(ValueError):
    """A field check's error about a part of the field: its message starts with that part (".tools ...")."""


def _label(key: str) -> str:
    return f".{key}" if key.isidentifier() and len(key) <= 40 else f"[{key[:40]!r}]"  # repr: ASCII, no surrogate


def _surrogate_within(value: Any) -> str | None:
    """Where a string in the JSON value `value`, an object key included, holds a lone surrogate: its
    path (".tools[0].name") and the problem, or None. Iterative: a line nests values as deep as JSON
    parses them, and a RecursionError here would end the worker."""
    stack: list[tuple[Any, tuple[Any, ...]]] = [(value, ())]  # a path as nested (parent, label) pairs
    while stack:
        v, path = stack.pop()
        problem: str | None = None
        if isinstance(v, str):
            problem = surrogate_problem(v)
        elif isinstance(v, dict):
            for k in v:
                key_problem = surrogate_problem(k) if isinstance(k, str) else None
                if key_problem is not None:
                    problem = f"key {key_problem}"
                    break
            stack.extend((item, (path, _label(k))) for k, item in reversed(v.items()))
        elif isinstance(v, list):
            stack.extend((item, (path, f"[{i}]")) for i, item in reversed(list(enumerate(v))))
        if problem is not None:
            labels: list[str] = []
            while path:
                path, label = path
                labels.append(label)
            return "".join(reversed(labels)) + f" {problem}"
    return None


def check_template_kwargs(value: Any) -> dict[str, Any]:
    """Variables for a chat template: a mapping of at most MAX_TEMPLATE_KWARGS identifier keys
    outside RESERVED_TEMPLATE_NAMES (values as they are; on the wire, JSON values), `tools` and
    `documents` as `template_value_problem` allows."""
    if not isinstance(value, Mapping):
        raise ValueError(f"must be an object of template variables, not {_kind(value)}")
    if len(value) > MAX_TEMPLATE_KWARGS:
        raise ValueError(f"has {len(value)} keys; at most {MAX_TEMPLATE_KWARGS}")
    for key in value:
        problem = template_name_problem(key)
        if problem is not None:
            raise ValueError(f"key {problem}")
        problem = template_value_problem(key, value[key])
        if problem is not None:
            raise _PartError(f".{key} {problem}")
        # The template renders strings into the prompt, which no tokenizer can then encode: mlx-lm
        # failed with "TypeError: TextEncodeInput must be Union[...]", naming no field.
        problem = _surrogate_within(value[key])
        if problem is not None:
            raise _PartError(f".{key}{problem}")
    return dict(value)


CONTEXT_EXCEEDED = "context_length_exceeded"  # the error code of a prompt past the context


def context_problem(tokens: int, context_len: int | None, what: str = "the prompt") -> str | None:
    """Why a prompt of `tokens` ids is refused, or None: it must fit the context (both backends).
    Past it, what the model saw of the prompt would depend on how its prefill was cut into chunks
    through the rotating caches; for `inspect_attention` the limit also bounds the pass's memory
    (the worker's, one unchunked pass, grows with the square of the length)."""
    if context_len is not None and tokens > context_len:
        return f"{what} has {tokens} tokens, more than the context length of {context_len}"
    return None


def context_full_problem(prompt: int, generated: int, context_len: int, max_tokens: int) -> str:
    """Why a batch row ended before its `max_tokens`: its prompt and tokens fill the context (both
    backends' words; the metal backend raises them as `ContextFull`, the worker sends them so named)."""
    return (f"{prompt} prompt and {generated} generated tokens fill the context of {context_len} tokens "
            f"(context_len) before max_tokens ({max_tokens}): batch rows do not go past it")


def check_context(cmd: str, tokens: int, context_len: int | None, item: int | None = None) -> None:
    """Raise `context_length_exceeded` for a prompt (a batch's `prompts` item `item`) past the
    context, with the counts as the error's fields: a client words the refusal from them."""
    problem = context_problem(tokens, context_len, "the prompt" if item is None else f"prompts item {item}")
    if problem is not None:
        raise CommandError(CONTEXT_EXCEEDED, f"{cmd}: {problem}", prompt_tokens=tokens, context_len=context_len,
                           item=item)


def _nonempty(check: Callable[[Any], list[Any]]) -> Callable[[Any], list[Any]]:
    def nonempty(value: Any) -> list[Any]:
        v = check(value)
        if not v:
            raise ValueError("must not be empty")
        return v

    return nonempty


@dataclass(frozen=True)
class Field:
    check: Callable[[Any], Any]
    required: bool = False
    default: Any = None


# The sampling options, named and defaulted as pymlxc's GenerateConfig (temperature 0 = greedy; 0 = off).
SAMPLING: dict[str, Field] = {
    "max_tokens": Field(_at_least(_int, 0), default=256),
    "temperature": Field(_temperature, default=0.0),
    "top_k": Field(_at_least(_int, 0), default=0),
    "top_p": Field(_unit, default=0.0),
    "min_p": Field(_unit, default=0.0),
    "repeat_penalty": Field(_repeat_penalty, default=1.0),
    "stop_tokens": Field(_list_of(_at_least(_int, 0), "non-negative integers"), default=[]),
    "seed": Field(_optional(_int), default=None),
    "return_logits": Field(_bool, default=False),
}

COMMANDS: dict[str, dict[str, Field]] = {
    "load": {
        "path": Field(_str, required=True),
        "adapter_path": Field(_optional(_str)),
        "context_len": Field(_optional(_at_most(_at_least(_int, 1), MAX_CONTEXT_LEN))),
        "device": Field(_optional(_str)),
    },
    "generate": {"prompt": Field(_str, required=True), **SAMPLING},
    "chat": {"messages": Field(_nonempty(_list_of(_message, "messages")), required=True),
             "chat_template_kwargs": Field(_optional(check_template_kwargs)), **SAMPLING},
    "classify": {"prompts": Field(_list_of(_str, "strings"), required=True), **SAMPLING},
    "batch_generate": {"prompts": Field(_list_of(_str, "strings"), required=True), **SAMPLING},
    "info": {},
    "encode": {"text": Field(_str, required=True), "add_special_tokens": Field(_bool, default=True)},
    "decode": {"tokens": Field(_list_of(_at_least(_int, 0), "non-negative integers"), required=True)},
    # Exactly one of prompt and tokens (checked by the worker).
    "inspect_attention": {
        "prompt": Field(_optional(_str)),
        "tokens": Field(_optional(_nonempty(_list_of(_at_least(_int, 0), "non-negative integers")))),
        "include_queries": Field(_bool, default=False),
    },
    "cancel": {},
    "quit": {},
}
STREAMING = ("generate", "chat")  # these answer with token lines and a done line; the others with one result
ENVELOPE = ("id", "cmd")


@dataclass(frozen=True)
class Request:
    """A validated request: the command, its arguments with defaults filled in, and the caller's id."""

    cmd: str
    args: dict[str, Any] = field(default_factory=dict)
    id: str | int | None = None

    def to_message(self) -> dict[str, Any]:
        msg: dict[str, Any] = {"cmd": self.cmd, **self.args}
        if self.id is not None:
            msg["id"] = self.id
        return msg


def request_id(message: Mapping[str, Any]) -> str | int | None:
    """The id to echo in a reply: the request's own when it is a string or integer, else null."""
    rid = message.get("id")
    if isinstance(rid, bool) or not isinstance(rid, (str, int)):
        return None
    return rid


def parse_request(message: Mapping[str, Any]) -> Request:
    """Check a decoded line against its command's schema; raise ProtocolError naming the problem."""
    rid = message.get("id")
    if rid is not None and request_id(message) is None:
        raise ProtocolError("bad_field", f"id must be a string or an integer, not {_kind(rid)}")
    if "cmd" not in message:
        raise ProtocolError("missing_field", "missing field 'cmd'")
    cmd = message["cmd"]
    if not isinstance(cmd, str):
        raise ProtocolError("bad_field", f"cmd must be a string, not {_kind(cmd)}")
    schema = COMMANDS.get(cmd)
    if schema is None:
        raise ProtocolError("unknown_command", f"unknown command {cmd[:80]!r}; commands: {', '.join(COMMANDS)}")
    unknown = sorted(k for k in message if k not in schema and k not in ENVELOPE)
    if unknown:
        raise ProtocolError("unknown_field", f"{cmd}: unknown field(s) {', '.join(repr(k[:80]) for k in unknown)}")
    args: dict[str, Any] = {}
    for name, spec in schema.items():
        if name not in message:
            if spec.required:
                raise ProtocolError("missing_field", f"{cmd}: missing field {name!r}")
            args[name] = list(spec.default) if isinstance(spec.default, list) else spec.default
            continue
        try:
            args[name] = spec.check(message[name])
        except ValueError as e:
            where = name if isinstance(e, _PartError) else f"{name} "
            raise ProtocolError("bad_field", f"{cmd}: {where}{e}") from None
    return Request(cmd, args, request_id(message))


# ---- replies -------------------------------------------------------------------------------------


def _reply(kind: str, rid: str | int | None, **fields: Any) -> dict[str, Any]:
    return {"type": kind, "id": rid, **fields}


def hello(**fields: Any) -> dict[str, Any]:
    return {"type": "hello", "protocol": PROTOCOL_VERSION, **fields}


def error(code: str, message: str, rid: str | int | None = None, cmd: str | None = None,
          **fields: Any) -> dict[str, Any]:
    return _reply("error", rid, cmd=cmd, error=code, message=message, **fields)


def result(cmd: str, rid: str | int | None, **fields: Any) -> dict[str, Any]:
    return _reply("result", rid, cmd=cmd, **fields)


def token(rid: str | int | None, token_id: int, text: str) -> dict[str, Any]:
    return _reply("token", rid, token_id=token_id, token=text)


def progress(rid: str | int | None, processed: int, total: int) -> dict[str, Any]:
    return _reply("progress", rid, processed=processed, total=total)


def done(rid: str | int | None, finish_reason: str, **metrics: Any) -> dict[str, Any]:
    return _reply("done", rid, finish_reason=finish_reason, **metrics)


def check_reply(message: Mapping[str, Any]) -> str:
    """The reply's type, after checking that it is one the protocol defines (the client's guard)."""
    kind = message.get("type")
    if kind not in REPLY_TYPES:
        raise ProtocolError("bad_reply", f"reply has unknown type {kind!r}")
    return str(kind)

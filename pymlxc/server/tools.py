"""Tool calls: which format a model writes them in, the grammar that forces one, and parsing them
back out of the generated text.

Formats (the families whose chat templates we support):
- `hermes` (Qwen 2/2.5/3, Hermes): `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`,
  one block per call.
- `llama3`: one JSON object `{"name": ..., "parameters": {...}}`, optionally after `<|python_tag|>`.
- `mistral`: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`.
The tools themselves reach the model through its chat template's `tools` variable.
"""
from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .constraints import json_lark_rule

HERMES, LLAMA3, MISTRAL = "hermes", "llama3", "mistral"
_HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        call: dict[str, Any] = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                                "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            call["index"] = index
        return call


def tool_format(chat_template: str | None, model_type: str | None) -> str:
    """The format a model writes tool calls in, from its template (else its family)."""
    template = chat_template or ""
    if "<tool_call>" in template:
        return HERMES
    if "[TOOL_CALLS]" in template:
        return MISTRAL
    if "<|python_tag|>" in template or "ipython" in template:
        return LLAMA3
    kind = model_type or ""
    if kind.startswith("llama"):
        return LLAMA3
    if kind.startswith("mistral"):
        return MISTRAL
    return HERMES


def _call_schema(tool: Mapping[str, Any], fmt: str) -> dict[str, Any]:
    function = tool["function"]
    params = function.get("parameters") or {"type": "object"}
    key = "parameters" if fmt == LLAMA3 else "arguments"
    return {"type": "object", "properties": {"name": {"const": function["name"]}, key: params},
            "required": ["name", key], "additionalProperties": False}


def forced_call_grammar(tools: Sequence[Mapping[str, Any]], fmt: str) -> str:
    """A Lark grammar whose every sentence is one call of one of `tools`, in format `fmt`."""
    schemas = [_call_schema(t, fmt) for t in tools]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    if fmt == HERMES:
        return f'start: "<tool_call>\\n" call "\\n</tool_call>"\ncall: {json_lark_rule(schema)}\n'
    if fmt == MISTRAL:
        return f'start: "[TOOL_CALLS] [" call "]"\ncall: {json_lark_rule(schema)}\n'
    return f"start: call\ncall: {json_lark_rule(schema)}\n"


def _from_object(obj: Any) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            json.loads(args)
        except json.JSONDecodeError:
            return None
        return ToolCall(obj["name"], args)
    return ToolCall(obj["name"], json.dumps(args))


def parse_tool_calls(text: str, fmt: str) -> tuple[str, list[ToolCall]]:
    """The content left and the tool calls found in `text` (none: the text unchanged)."""
    if fmt == HERMES:
        calls = []
        for block in _HERMES_BLOCK.findall(text):
            try:
                call = _from_object(json.loads(block))
            except json.JSONDecodeError:
                call = None
            if call is None:
                return text, []
            calls.append(call)
        return (_HERMES_BLOCK.sub("", text).strip(), calls) if calls else (text, [])
    stripped = text.strip()
    if fmt == MISTRAL:
        if not stripped.startswith("[TOOL_CALLS]"):
            return text, []
        try:
            items = json.loads(stripped.removeprefix("[TOOL_CALLS]").strip())
        except json.JSONDecodeError:
            return text, []
        items = items if isinstance(items, list) else [items]
        parsed = [_from_object(i) for i in items]
        return ("", [c for c in parsed if c is not None]) if parsed and all(parsed) else (text, [])
    body = stripped.removeprefix("<|python_tag|>").strip()
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return text, []
    items = obj if isinstance(obj, list) else [obj]
    parsed = [_from_object(i) for i in items]
    return ("", [c for c in parsed if c is not None]) if parsed and all(parsed) else (text, [])


_HERMES_OPEN = "<tool_call>"


def streamable(text: str, fmt: str, at_start: bool) -> int:
    """How much of `text` (the output not yet streamed; `at_start`: nothing streamed before it) a
    stream may send as content now, holding back what could belong to a tool call. Hermes calls
    may come after text (Qwen 3's thinking, a sentence), as `parse_tool_calls` finds them: the
    text up to a call's opening tag is sent, less a tail that could still become one and the
    whitespace before it (a whole answer with calls strips the content around them). The other
    formats are calls only from the output's start: all of it is held while it could become one."""
    if fmt != HERMES:
        return 0 if at_start and may_be_tool_call(text, fmt) else len(text)
    at = text.find(_HERMES_OPEN)
    if at < 0:  # the longest tail that begins the tag
        at = next((len(text) - k for k in range(min(len(_HERMES_OPEN) - 1, len(text)), 0, -1)
                   if _HERMES_OPEN.startswith(text[-k:])), len(text))
    return len(text[:at].rstrip())


class StreamedContent:
    """A streamed answer's content when tools may be called (`fmt`; None: no tools): `add(text)`
    gives what to send now, `finish()` the content still to send and the calls, so that the
    content sent joins into the whole answer's (`parse_tool_calls`) and no call's text is sent.
    One difference stays: whitespace that opens an answer is sent with the text after it, before a
    later call shows that the whole answer's content (stripped around its calls) drops it."""

    def __init__(self, fmt: str | None) -> None:
        self._fmt = fmt
        self._sent: list[str] = []
        self._held = ""

    def add(self, text: str) -> str:
        self._held += text
        ready = len(self._held) if self._fmt is None else streamable(self._held, self._fmt, not self._sent)
        out, self._held = self._held[:ready], self._held[ready:]
        if out:
            self._sent.append(out)
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        held, self._held = self._held, ""
        if self._fmt is None:
            return held, []
        sent = "".join(self._sent)
        rest, calls = parse_tool_calls(sent + held, self._fmt)
        if not calls:
            return held, []
        # The whole answer's content around the calls begins with the text sent before the first
        # one, less the answer's opening whitespace, which its stripping drops.
        lead = sent if rest.startswith(sent) else sent.lstrip()
        return (rest[len(lead):] if rest.startswith(lead) else parse_tool_calls(held, self._fmt)[0]), calls


def may_be_tool_call(text: str, fmt: str) -> bool:
    """Whether `text` (the output so far) could still become a tool call: a stream holds it back."""
    head = text.lstrip()
    markers = {HERMES: ("<tool_call>",), MISTRAL: ("[TOOL_CALLS]",), LLAMA3: ("<|python_tag|>", "{", "[")}[fmt]
    return any(head.startswith(m) or m.startswith(head) for m in markers)

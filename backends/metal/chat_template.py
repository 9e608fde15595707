"""Chat prompts: the model's own Jinja chat template, rendered as transformers renders it, or a
built-in template for the families we know when the checkpoint has none.

Templates from the Hub are untrusted code, so they run in jinja2's immutable sandbox with the same
settings and helpers as transformers' `apply_chat_template` (trim_blocks, lstrip_blocks, loop
controls, `raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII and HTML as they are),
so that the text is identical to what the model was trained with.
"""
from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any, Protocol

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pymlxc.types import Message

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ChatTemplateError(ValueError):
    """The chat template failed (it called `raise_exception`, or it is not valid Jinja)."""


class ChatTokenizer(Protocol):
    """What rendering needs from a tokenizer (`backends.metal.tokenizer.Tokenizer` has it)."""

    chat_template: str | None
    model_type: str | None
    special_tokens: dict[str, str]


# -- the Jinja environment ------------------------------------------------------------------------
class _GenerationTag(Extension):
    # `{% generation %}...{% endgeneration %}` marks assistant text for training masks in some
    # templates; rendering a prompt only needs the body, unchanged.
    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML, which would change the prompt text.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Namespace(jinja2.utils.Namespace):
    # Templates may keep state in a namespace, but not under dunder-ish names that reach internals.
    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        for name in dict(*rest, **kwargs):
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, *rest, **kwargs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore names on a namespace: {name!r}")


@functools.lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """Compile a chat template once (the same template is rendered for every request)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template is not valid Jinja (line {exc.lineno}): {exc.message}") from exc


# -- messages -------------------------------------------------------------------------------------
def _message_dict(message: Message | Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(message, Message):
        data: dict[str, Any] = message.to_dict()
    elif isinstance(message, Mapping):
        data = dict(message)
    else:
        raise TypeError(f"a chat message must be a Message or a mapping, got {type(message).__name__}")
    if "role" not in data:
        raise ValueError(f"a chat message needs a 'role': {data!r}")
    # Like transformers: a key set to None (OpenAI's content=None) counts as missing, and
    # reasoning given under any of its names is offered under the names templates read.
    data = {k: v for k, v in data.items() if v is not None}
    reasoning = next((data[k] for k in _REASONING_FIELDS if k in data), None)
    if reasoning is not None:
        data = {"thinking": reasoning, **data, "reasoning_content": reasoning}
    return data


# -- built-in templates ---------------------------------------------------------------------------
def _content(message: Mapping[str, Any]) -> str:
    content = message.get("content", "")
    if not isinstance(content, str):
        raise TypeError("built-in chat templates take text content only")
    return content


def _gemma(messages: Sequence[Mapping[str, Any]], special: Mapping[str, str], add_generation_prompt: bool) -> str:
    # Gemma has no system role: the system text opens the first user turn.
    prefix = ""
    if messages and messages[0]["role"] == "system":
        prefix, messages = _content(messages[0]) + "\n\n", messages[1:]
    parts = [special.get("bos_token", "")]
    for i, m in enumerate(messages):
        role = "model" if m["role"] == "assistant" else m["role"]
        parts.append(f"<start_of_turn>{role}\n{prefix if i == 0 else ''}{_content(m).strip()}<end_of_turn>\n")
    if add_generation_prompt:
        parts.append("<start_of_turn>model\n")
    return "".join(parts)


def _chatml(messages: Sequence[Mapping[str, Any]], special: Mapping[str, str], add_generation_prompt: bool) -> str:
    parts = [f"<|im_start|>{m['role']}\n{_content(m)}<|im_end|>\n" for m in messages]
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)


def _llama3(messages: Sequence[Mapping[str, Any]], special: Mapping[str, str], add_generation_prompt: bool) -> str:
    parts = [special.get("bos_token", "")]
    for m in messages:
        parts.append(f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{_content(m).strip()}<|eot_id|>")
    if add_generation_prompt:
        parts.append("<|start_header_id|>assistant<|end_header_id|>\n\n")
    return "".join(parts)


_Builtin = Callable[[Sequence[Mapping[str, Any]], Mapping[str, str], bool], str]
BUILTIN_FAMILIES: dict[str, _Builtin] = {"gemma": _gemma, "qwen": _chatml, "llama": _llama3, "mistral": _llama3}


def builtin_template(model_type: str | None) -> _Builtin:
    """The built-in template for `model_type` (gemma*, qwen*, llama*, mistral*)."""
    for prefix, render in BUILTIN_FAMILIES.items():
        if model_type and model_type.startswith(prefix):
            return render
    raise ValueError(f"the tokenizer has no chat_template and model_type {model_type!r} has no built-in one; "
                     f"built-in families: {', '.join(f'{p}*' for p in BUILTIN_FAMILIES)}")


# -- rendering ------------------------------------------------------------------------------------
def render_chat(
    messages: Sequence[Message | Mapping[str, Any]],
    tokenizer: ChatTokenizer,
    add_generation_prompt: bool = True,
    **template_kwargs: Any,
) -> str:
    """Render `messages` into the prompt text the model expects.

    The text starts with the BOS token when the template writes it (Gemma and Llama 3 do), so
    encode it with `add_special_tokens=False`. `template_kwargs` reach the template as variables
    (for instance `enable_thinking=False` for Qwen 3); they override the special tokens.
    """
    chat = [_message_dict(m) for m in messages]
    special = {k: v for k, v in tokenizer.special_tokens.items() if k in SPECIAL_TOKEN_NAMES}
    if tokenizer.chat_template is None:
        return builtin_template(tokenizer.model_type)(chat, special, add_generation_prompt)
    template = compile_template(tokenizer.chat_template)
    variables = {**special, **template_kwargs}
    variables.setdefault("tools", None)
    variables.setdefault("documents", None)
    try:
        return template.render(messages=chat, add_generation_prompt=add_generation_prompt, **variables)
    except jinja2.exceptions.TemplateError as exc:
        raise ChatTemplateError(f"chat template failed: {exc}") from exc

"""Chat prompts: the model's own Jinja chat template, rendered as transformers renders it, or a
built-in template for the families we know when the checkpoint has none.

Templates from the Hub are untrusted code, so they run in jinja2's immutable sandbox with the same
settings and helpers as transformers' `apply_chat_template` (trim_blocks, lstrip_blocks, loop
controls, `raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII and HTML as they are),
so that the text is identical to what the model was trained with.

The sandbox stops code from reaching Python's internals, but not from running long or building
huge values (`range` nested in `range`, `'a' * 3000000000`, `tojson(indent=10**9)`). So the
environment also bounds them: every loop iteration, call, namespace write and output chunk checks
the render's deadline (`RENDER_SECONDS`, or sooner the call's own timeout and cancel, through the
`guard` of `render_chat`), and the operations that multiply sizes (repetition, concatenation, `%`
and `str.format` widths, padding, `replace`, `join`, `indent`, `wordwrap`, `tojson`'s indent, integer
powers) are checked before they run against `MAX_CHARS` characters (`MAX_ITEMS` items for lists,
`MAX_INT_BITS` for integers), as is the text the template writes in all.
"""
from __future__ import annotations

import contextvars
import functools
import json
import re
import string
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from datetime import datetime
from typing import Any, Protocol

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.runtime import Undefined
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pymlxc.types import Message, TemplateError

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


# Bounds of one render. Real chat templates render in milliseconds and write at most the prompt.
RENDER_SECONDS = 10.0
MAX_CHARS = 1 << 24  # characters of any one value the template makes, and of its whole text
MAX_ITEMS = 1 << 20  # items of any one list, tuple, dict or set it makes
MAX_INT_BITS = 1 << 16  # integers the template computes (powers, products)
MAX_INDENT = 64  # tojson's indent, in spaces or characters


class ChatTemplateError(TemplateError):
    """The chat template failed (it called `raise_exception`, is not valid Jinja, or went past the
    bounds of a render: `RENDER_SECONDS`, `MAX_CHARS`, `MAX_INT_BITS`)."""


class ChatTokenizer(Protocol):
    """What rendering needs from a tokenizer (`backends.metal.tokenizer.Tokenizer` has it)."""

    chat_template: str | None
    model_type: str | None
    special_tokens: dict[str, str]


# -- the Jinja environment ------------------------------------------------------------------------
class _GenerationTag(Extension):
    # `{% generation %}...{% endgeneration %}` marks assistant text for training masks in some
    # templates; rendering a prompt only needs the body, unchanged.
    tags = {"generation"}  # noqa: RUF012 - jinja2 declares Extension.tags a plain (not ClassVar) set

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


# -- the bounds of a render -----------------------------------------------------------------------
class _Render:
    """The deadline of the render running in this context, and the caller's guard (which raises to
    stop it: a cancel event, the call's timeout)."""

    def __init__(self, seconds: float, guard: Callable[[], None] | None) -> None:
        self.seconds = seconds
        self.deadline = time.perf_counter() + seconds
        self.guard = guard
        self.stopped: BaseException | None = None  # what the guard raised, handed on unchanged

    def tick(self) -> None:
        if self.guard is not None:
            try:
                self.guard()
            except RecursionError:
                # The template's own recursion ran out of stack inside the guard's call: the
                # template failed (wrapped as such by render_chat), nobody stopped it.
                raise
            except BaseException as exc:
                self.stopped = exc
                raise
        if time.perf_counter() > self.deadline:
            raise ChatTemplateError(f"the chat template ran longer than {self.seconds:g} s")


_RENDER: contextvars.ContextVar[_Render | None] = contextvars.ContextVar("chat_template_render", default=None)


def _tick() -> None:
    render = _RENDER.get()
    if render is not None:
        render.tick()


def _too_big(what: str, size: int, limit: int = MAX_CHARS, unit: str = "characters") -> ChatTemplateError:
    return ChatTemplateError(f"the chat template would make {what} of {size} {unit}, over the limit of {limit}")


def _children(value: Any) -> list[Any] | None:
    if isinstance(value, Mapping):
        return [*value.keys(), *value.values()]
    if isinstance(value, (list, tuple, set, frozenset)):
        return list(value)
    return None


def _weight(value: Any, limit: int = MAX_CHARS) -> int:
    """Characters of strings plus one per other item, counting a shared part each time it appears
    (as printing or tojson would write it), each distinct part measured once; capped at limit + 1."""
    if isinstance(value, str):
        return len(value)
    memo: dict[int, int] = {}
    stack: list[tuple[Any, bool]] = [(value, False)]
    while stack:
        v, expanded = stack.pop()
        if id(v) in memo:
            continue
        kids = _children(v)
        if kids is None:
            memo[id(v)] = len(v) if isinstance(v, str) else 1
        elif len(kids) > MAX_ITEMS:  # too big whatever it holds: no need to walk it
            return limit + 1
        elif not expanded:
            stack.append((v, True))
            stack.extend((k, False) for k in kids if id(k) not in memo)
        else:
            memo[id(v)] = min(limit + 1, 1 + sum(memo[id(k)] for k in kids))
    return memo[id(value)]


def _check_value(value: Any, what: str) -> Any:
    """`value` when it is within the bounds; else ChatTemplateError."""
    if isinstance(value, str):
        if len(value) > MAX_CHARS:
            raise _too_big(what, len(value))
    elif isinstance(value, int) and not isinstance(value, bool):
        if value.bit_length() > MAX_INT_BITS:
            raise _too_big(what, value.bit_length(), MAX_INT_BITS, "bits")
    elif isinstance(value, (list, tuple, set, frozenset, Mapping)):
        if len(value) > MAX_ITEMS:
            raise _too_big(what, len(value), MAX_ITEMS, "items")
        weight = _weight(value)
        if weight > MAX_CHARS:
            raise _too_big(what, weight, unit="items and characters")
    return value


def _check_size(size: int, what: str) -> None:
    if size > MAX_CHARS:
        raise _too_big(what, size)


def _count(value: Any) -> int:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else 0


_PERCENT_SPEC = re.compile(r"%[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?")


def _check_percent(fmt: str, args: Any) -> None:
    """`fmt % args` writes at most MAX_CHARS per width or precision."""
    widths = [w for m in _PERCENT_SPEC.finditer(fmt) for w in m.groups() if w]
    numbers = [int(w) for w in widths if w != "*"]
    if "*" in widths:
        numbers += [_count(a) for a in (args if isinstance(args, tuple) else (args,))]
    if numbers and max(numbers) > MAX_CHARS:
        raise _too_big("a %-formatted field", max(numbers))


def _check_format(fmt: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    """`fmt.format(*args, **kwargs)` writes at most MAX_CHARS per field width or precision."""
    try:
        specs = [spec for _, _, spec, _ in string.Formatter().parse(fmt) if spec]
    except ValueError:
        return  # str.format raises the same error itself
    numbers = [int(n) for spec in specs for n in re.findall(r"\d+", spec)]
    if any("{" in spec for spec in specs):  # widths taken from the arguments
        numbers += [_count(a) for a in (*args, *kwargs.values())]
    if numbers and max(numbers) > MAX_CHARS:
        raise _too_big("a formatted field", max(numbers))


def _joined_size(sep: str, items: Sequence[Any]) -> int:
    if len(items) > MAX_ITEMS:
        return MAX_CHARS + 1
    return len(sep) * max(len(items) - 1, 0) + sum(len(i) if isinstance(i, str) else _weight(i) for i in items)


def _replaced_size(s: str, old: str, new: str, count: int = -1) -> int:
    n = s.count(old) if old else len(s) + 1
    if count >= 0:
        n = min(n, count)
    return len(s) + n * (len(new) - len(old))


def _check_str_method(s: str, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """Check a call of the str method `name` before it runs; returns its arguments (an iterable to
    join is read into a tuple once, to measure it)."""
    arg = args[0] if args else None
    if name in ("center", "ljust", "rjust", "zfill"):
        _check_size(_count(kwargs.get("width", arg)), f"{name}()")
    elif name == "expandtabs":
        _check_size(len(s) + s.count("\t") * _count(kwargs.get("tabsize", 8 if arg is None else arg)), "expandtabs()")
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        _check_size(_replaced_size(s, args[0], args[1], _count(args[2]) if len(args) > 2 else -1), "replace()")
    elif name == "join" and args:
        items = tuple(args[0])
        _check_size(_joined_size(s, items), "join()")
        return (items, *args[1:])
    return args


# -- filters: the defaults, checked; tojson -------------------------------------------------------
def _tojson(value: Any, ensure_ascii: bool = False, indent: int | str | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML, which would change the prompt text.
    if isinstance(indent, (int, str)) and not isinstance(indent, bool):
        width = indent if isinstance(indent, int) else len(indent)
        if width > MAX_INDENT:
            raise ChatTemplateError(f"tojson's indent is {width}; at most {MAX_INDENT} is allowed")
    if separators is not None and sum(_weight(part) for part in separators) > MAX_INDENT:
        raise ChatTemplateError(f"tojson's separators are longer than {MAX_INDENT} characters")
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _filter_precheck(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """Check the filters that can multiply sizes before they run (positions after the context
    arguments: args[0] is the filtered value). Returns the arguments to use."""
    value = args[0] if args else None
    rest = args[1:]
    if name == "center":
        _check_size(_count(kwargs.get("width", rest[0] if rest else 80)), "center")
    elif name == "indent" and isinstance(value, str):
        width = kwargs.get("width", rest[0] if rest else 4)
        per_line = len(width) if isinstance(width, str) else _count(width)
        _check_size(len(value) + (value.count("\n") + 1) * per_line, "indent")
    elif name == "wordwrap" and isinstance(value, str):
        wrap = kwargs.get("wrapstring", rest[2] if len(rest) > 2 else "\n")
        _check_size(len(value) * (1 + (len(wrap) if isinstance(wrap, str) else 1)), "wordwrap")
    elif name == "replace" and isinstance(value, str) and len(rest) >= 2:
        old, new = str(rest[0]), str(rest[1])
        _check_size(_replaced_size(value, old, new, _count(rest[2]) if len(rest) > 2 else -1), "replace")
    elif name == "format" and isinstance(value, str):
        _check_percent(value, tuple(rest) or tuple(kwargs.values()))
    elif name == "join" and value is not None and not isinstance(value, Undefined):
        items = tuple(value)
        sep = kwargs.get("d", rest[0] if rest else "")
        _check_size(_joined_size(sep if isinstance(sep, str) else "", items), "join")
        return (items, *rest)
    return args


def _checked_filter(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    # The context/environment arguments Jinja passes first (pass_context and the like) are not
    # the filtered value: skip them when looking at the arguments.
    passed = 1 if getattr(fn, "jinja_pass_arg", None) is not None else 0

    @functools.wraps(fn)
    def checked(*args: Any, **kwargs: Any) -> Any:
        _tick()
        args = (*args[:passed], *_filter_precheck(name, args[passed:], kwargs))
        return _check_value(fn(*args, **kwargs), f"the result of the {name} filter")

    return checked


def _guarded_loop(iterable: Any) -> Iterator[Any]:
    # Every for loop of a template runs over this: one deadline check per iteration.
    for item in iterable:
        _tick()
        yield item


_LOOP_GUARD = "(loop guard)"  # not a name a template can write, so only the rewrite below uses it


def _bounded_concat(parts: Iterable[str]) -> str:
    # Jinja joins the output of macros, call and filter blocks and `set` blocks with this.
    parts = list(parts)
    _check_size(sum(len(p) for p in parts), "a block's text")
    return "".join(parts)


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox with the bounds of the module doc."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})
    concat = staticmethod(_bounded_concat)

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.filters = {name: _checked_filter(name, fn) for name, fn in self.filters.items()}
        self.filters[_LOOP_GUARD] = _guarded_loop

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        tree = super()._parse(source, name, filename)
        for loop in tree.find_all(nodes.For):
            loop.iter = nodes.Filter(loop.iter, _LOOP_GUARD, [], [], None, None, lineno=loop.lineno)
        return tree

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any) -> Any:
        _tick()
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and not isinstance(n, bool):
                    if isinstance(seq, str):
                        _check_size(len(seq) * max(n, 0), "a repetition")
                        continue
                    if len(seq) * max(n, 0) > MAX_ITEMS:
                        raise _too_big("a repetition", len(seq) * n, MAX_ITEMS, "items")
                    _check_size((_weight(seq) - 1) * max(n, 0) + 1, "a repetition")  # the container counts once
            if (isinstance(left, int) and isinstance(right, int)
                    and left.bit_length() + right.bit_length() > MAX_INT_BITS):
                raise _too_big("a product", left.bit_length() + right.bit_length(), MAX_INT_BITS, "bits")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
            if abs(left) > 1 and right * left.bit_length() > MAX_INT_BITS:
                raise _too_big("a power", right * left.bit_length(), MAX_INT_BITS, "bits")
        elif operator == "+" and isinstance(left, (str, list, tuple)) and type(left) is type(right):
            _check_size(_weight(left) + _weight(right), "a concatenation")
        elif operator == "%" and isinstance(left, str):
            _check_percent(left, right)
        return _check_value(super().call_binop(context, operator, left, right), f"the result of {operator!r}")

    def call(__self, __context: jinja2.runtime.Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        _tick()
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, str) and callable(__obj):
            args = _check_str_method(owner, getattr(__obj, "__name__", ""), args, kwargs)
        result = super().call(__context, __obj, *args, **kwargs)
        return _check_value(result, f"the result of {getattr(__obj, '__name__', 'a call')}()")

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        fmt: str = value.__self__

        def checked(*args: Any, **kwargs: Any) -> str:
            if value.__name__ == "format_map":
                _check_format(fmt, (), args[0] if args and isinstance(args[0], Mapping) else {})
            else:
                _check_format(fmt, args, kwargs)
            text: str = _check_value(wrapped(*args, **kwargs), "a formatted string")
            return text

        return checked


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
        # A namespace is how a template carries a value from one loop iteration to the next, so
        # what grows there is bounded here (a string doubled every iteration, say).
        _Namespace._check(name)
        _tick()
        _check_value(value, f"namespace attribute {name!r}")
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot set underscore names on a namespace: {name!r}")


@functools.lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """Compile a chat template once (the same template is rendered for every request)."""
    env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _checked_filter("tojson", _tojson)
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
    *,
    guard: Callable[[], None] | None = None,
    seconds: float | None = None,
    **template_kwargs: Any,
) -> str:
    """Render `messages` into the prompt text the model expects.

    The text starts with the BOS token when the template writes it (Gemma and Llama 3 do), so
    encode it with `add_special_tokens=False`. `template_kwargs` reach the template as variables
    (for instance `enable_thinking=False` for Qwen 3); they override the special tokens.

    A template runs at most `seconds` (default `RENDER_SECONDS`) and within the bounds of the module doc (else
    ChatTemplateError); `guard` is called at every loop iteration, call and output chunk, and what
    it raises (the call's cancel or timeout) stops the render and is raised as it is.
    """
    chat = [_message_dict(m) for m in messages]
    special = {k: v for k, v in tokenizer.special_tokens.items() if k in SPECIAL_TOKEN_NAMES}
    if tokenizer.chat_template is None:
        return builtin_template(tokenizer.model_type)(chat, special, add_generation_prompt)
    template = compile_template(tokenizer.chat_template)
    variables = {**special, **template_kwargs}
    variables.setdefault("tools", None)
    variables.setdefault("documents", None)
    render = _Render(RENDER_SECONDS if seconds is None else seconds, guard)
    token = _RENDER.set(render)
    try:
        parts, size = [], 0
        for part in template.generate(messages=chat, add_generation_prompt=add_generation_prompt, **variables):
            size += len(part)
            _check_size(size, "a prompt")
            render.tick()
            parts.append(part)
        return "".join(parts)
    except ChatTemplateError:
        raise
    except jinja2.exceptions.TemplateError as exc:
        raise ChatTemplateError(f"chat template failed: {exc}") from exc
    except Exception as exc:
        if exc is render.stopped:
            raise
        # Template code failing in Python (1/0, a too deep recursion, out of memory): its error.
        raise ChatTemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from exc
    finally:
        _RENDER.reset(token)

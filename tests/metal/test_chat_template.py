"""Chat prompts: our rendering equals transformers' `apply_chat_template`, for the families' own
templates, for Jinja features templates use, and for the built-in templates of template-less models."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pymlxc.backends.metal import chat_template as ct
from pymlxc.backends.metal.chat_template import ChatTemplateError, builtin_template, render_chat
from pymlxc.backends.metal.tokenizer import Tokenizer
from pymlxc.testing import ARCHITECTURES, write_tiny_model
from pymlxc.types import Message

transformers = pytest.importorskip("transformers")

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "  héllo wörld 你好 🙂 \n"}],
    [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": " Four. "},
     {"role": "user", "content": "And <b>3+3</b> & 'quotes'?"}],
    [{"role": "system", "content": "Be kind.\n"}, {"role": "user", "content": "a\n\nb"},
     {"role": "assistant", "content": "c"}, {"role": "user", "content": ""}],
]


@dataclass
class FakeTokenizer:
    """Anything with these three attributes can be rendered for."""

    chat_template: str | None
    model_type: str | None = "llama"
    special_tokens: dict[str, str] = field(default_factory=lambda: {"bos_token": "<s>", "eos_token": "</s>"})


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("chat")
    return {arch: write_tiny_model(root / arch, arch) for arch in ARCHITECTURES}


@pytest.fixture(scope="module")
def hf(dirs: dict[str, Path]) -> dict[str, Any]:
    return {arch: transformers.AutoTokenizer.from_pretrained(str(path)) for arch, path in dirs.items()}


def _hf_render(tok: Any, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kw: Any) -> str:
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kw)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_family_templates_match_transformers(dirs: dict[str, Path], hf: dict[str, Any], arch: str,
                                             add_generation_prompt: bool) -> None:
    tok = Tokenizer(dirs[arch])
    for messages in CONVERSATIONS:
        ours = render_chat(messages, tok, add_generation_prompt=add_generation_prompt)
        assert ours == _hf_render(hf[arch], messages, add_generation_prompt), messages


def test_message_objects_render_like_dicts(dirs: dict[str, Path]) -> None:
    tok = Tokenizer(dirs["gemma3"])
    messages = CONVERSATIONS[1]
    assert render_chat([Message(**m) for m in messages], tok) == render_chat(messages, tok)
    with pytest.raises(TypeError, match="Message or a mapping"):
        render_chat(["hi"], tok)  # type: ignore[list-item]


def test_template_kwargs_reach_the_template(dirs: dict[str, Path], hf: dict[str, Any]) -> None:
    tok = Tokenizer(dirs["qwen3"])
    messages = CONVERSATIONS[0]
    ours = render_chat(messages, tok, enable_thinking=False)
    assert ours.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert ours == _hf_render(hf["qwen3"], messages, enable_thinking=False)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma2", "gemma3_text", "gemma3"])
def test_builtin_templates_match_the_family_templates(tmp_path: Path, hf: dict[str, Any], arch: str) -> None:
    bare = Tokenizer(write_tiny_model(tmp_path, arch, chat_template=""))
    assert bare.chat_template is None
    for messages in CONVERSATIONS:
        for gen in (True, False):
            assert render_chat(messages, bare, add_generation_prompt=gen) == _hf_render(hf[arch], messages, gen)


def test_builtin_mistral_uses_llama3_headers() -> None:
    text = render_chat([{"role": "user", "content": " x "}], FakeTokenizer(None, "mistral"))
    assert text == ("<s><|start_header_id|>user<|end_header_id|>\n\nx<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_no_template_and_unknown_family_lists_the_families() -> None:
    with pytest.raises(ValueError, match="gemma\\*, qwen\\*, llama\\*, mistral\\*"):
        render_chat([{"role": "user", "content": "x"}], FakeTokenizer(None, "gpt2"))
    with pytest.raises(ValueError, match="None"):
        builtin_template(None)


def test_raise_exception_becomes_chat_template_error(dirs: dict[str, Path], hf: dict[str, Any]) -> None:
    bad_role = [{"role": "tool", "content": "x"}]
    with pytest.raises(ChatTemplateError, match="Only system, user and assistant roles"):
        render_chat(bad_role, Tokenizer(dirs["mistral"]))
    with pytest.raises(Exception, match="Only system, user and assistant roles"):
        _hf_render(hf["mistral"], bad_role)
    with pytest.raises(ChatTemplateError, match="must alternate"):
        render_chat([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], Tokenizer(dirs["gemma2"]))


# Templates that use the Jinja features real templates rely on; each must render like transformers.
FEATURE_TEMPLATES = {
    "tojson keeps non-ASCII and HTML": "{{ messages | tojson }}|{{ messages[0] | tojson(indent=2) }}",
    "namespace and loop controls": (
        "{% set ns = namespace(n=0, last='') %}{% for m in messages %}{% if m.role == 'system' %}{% continue %}"
        "{% endif %}{% set ns.n = ns.n + 1 %}{% set ns.last = m.content %}{% if ns.n > 1 %}{% break %}{% endif %}"
        "{% endfor %}{{ ns.n }}:{{ ns.last }}"
    ),
    "whitespace control": ("{% for m in messages %}\n  {% if m.role %}\n    [{{ m.role }}]\n  {% endif %}\n"
                           "{% endfor %}\n"),
    "generation blocks": "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}"
                         "{% endgeneration %}{% else %}{{ m.content }}{% endif %}|{% endfor %}",
    "special tokens and undefined": "{{ bos_token }}{{ eos_token }}{{ pad_token }}{{ tools is none }}"
                                    "{{ documents is none }}{{ add_generation_prompt }}{{ missing is defined }}",
    "None content dropped, reasoning aliased": "{% for m in messages %}{{ m.content is defined }}"
                                               "{{ m.reasoning_content }}{{ m.thinking }}{% endfor %}",
    "strftime_now": "{{ strftime_now('%Y') | length }}",
}


@pytest.mark.parametrize("name", list(FEATURE_TEMPLATES))
def test_jinja_features_match_transformers(dirs: dict[str, Path], hf: dict[str, Any], name: str) -> None:
    template = FEATURE_TEMPLATES[name]
    tok = Tokenizer(dirs["qwen2"])
    fake = FakeTokenizer(template, special_tokens=tok.special_tokens)
    conversations = [*CONVERSATIONS, [{"role": "user", "content": None},
                                      {"role": "assistant", "content": "ok", "reasoning": "hmm"}]]
    for messages in conversations:
        ours = render_chat(messages, fake)
        assert ours == _hf_render(hf["qwen2"], messages, chat_template=template), (name, messages)


def test_sandbox_refuses_internals() -> None:
    with pytest.raises(ChatTemplateError):
        render_chat([{"role": "user", "content": "x"}], FakeTokenizer("{{ ''.__class__.__mro__[1].__subclasses__() }}"))
    with pytest.raises(ChatTemplateError, match="underscore"):
        render_chat([{"role": "user", "content": "x"}], FakeTokenizer("{% set ns = namespace(_x=1) %}"))
    with pytest.raises(ChatTemplateError, match="append"):
        render_chat([{"role": "user", "content": "x"}], FakeTokenizer("{{ messages.append(1) }}"))


def test_syntax_error_is_a_chat_template_error() -> None:
    with pytest.raises(ChatTemplateError, match="not valid Jinja"):
        render_chat([{"role": "user", "content": "x"}], FakeTokenizer("{% for m in messages %}"))


# ---------------------------------------------------------------------- bounds of a render
# (the hostile templates that would hang or take gigabytes without them: tests/reliability/test_templates.py)
USER = [{"role": "user", "content": "x"}]
SIZED = {
    "repeat": ("{{ 'ab' * n }}", lambda n: 2 * n),
    "repeat reversed": ("{{ (n * ['a'])|join }}", lambda n: n * ct.MAX_CHARS // ct.MAX_ITEMS),  # MAX_ITEMS items
    "center": ("{{ 'a'|center(n) }}", lambda n: n),
    "ljust": ("{{ 'a'.ljust(n) }}", lambda n: n),
    "percent": ("{{ '%*d' % (n, 1) }}", lambda n: n),
    "str.format": ("{{ '{:>{}}'.format(1, n) }}", lambda n: n),
    "replace": ("{{ 'aaaa'|replace('a', 'b' * n) }}", lambda n: 4 * n),
}


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(sorted(SIZED)), n=st.integers(0, 2 * ct.MAX_CHARS), near=st.booleans(),
       delta=st.integers(-2, 2))
def test_size_multiplying_operations_stop_exactly_past_the_limit(case: str, n: int, near: bool, delta: int) -> None:
    template, size = SIZED[case]
    if near:  # around the largest n whose result fits (every size here grows with n)
        low, high = 0, 2 * ct.MAX_CHARS
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if size(mid) <= ct.MAX_CHARS else (low, mid - 1)
        n = max(low + delta, 0)
    if size(n) <= ct.MAX_CHARS:
        text = render_chat(USER, FakeTokenizer(template), n=n)
        assert len(text) >= min(n, 1) and len(text) <= ct.MAX_CHARS
    else:
        with pytest.raises(ChatTemplateError, match="over the limit"):
            render_chat(USER, FakeTokenizer(template), n=n)


@settings(max_examples=30, deadline=None)
@given(indent=st.integers(0, 200), exponent=st.integers(0, 40000))
def test_tojson_indent_and_integer_powers_are_bounded(indent: int, exponent: int) -> None:
    template = FakeTokenizer("{{ messages|tojson(indent=indent) }}")
    if indent <= ct.MAX_INDENT:
        assert render_chat(USER, template, indent=indent) == json.dumps(USER, indent=indent)
    else:
        with pytest.raises(ChatTemplateError, match="indent"):
            render_chat(USER, template, indent=indent)
    power = FakeTokenizer("{{ (3 ** e) % 1000 }}")
    if exponent * 2 <= ct.MAX_INT_BITS:  # 3 has 2 bits
        assert render_chat(USER, power, e=exponent) == str(pow(3, exponent, 1000))
    else:
        with pytest.raises(ChatTemplateError, match="bits"):
            render_chat(USER, power, e=exponent)


def test_a_long_render_stops_at_its_deadline_and_at_the_guard() -> None:
    slow = FakeTokenizer("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")
    with pytest.raises(ChatTemplateError, match=r"longer than 0\.2 s"):
        render_chat(USER, slow, seconds=0.2)
    calls = []

    class Stopped(Exception):
        pass

    def guard() -> None:
        calls.append(1)
        if len(calls) > 1000:
            raise Stopped("cancelled")

    with pytest.raises(Stopped):  # the guard's own exception, not wrapped
        render_chat(USER, slow, guard=guard)
    assert len(calls) == 1001


def test_python_errors_in_a_template_are_chat_template_errors() -> None:
    for template, message in [("{{ 1 / 0 }}", "ZeroDivisionError"),
                              ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "RecursionError")]:
        with pytest.raises(ChatTemplateError, match=message):
            render_chat(USER, FakeTokenizer(template))


def test_a_recursion_that_runs_out_in_the_guard_is_still_a_chat_template_error() -> None:
    # chat() always renders with a guard; a template recursing to the stack limit used to hit it
    # inside the guard's call, and its RecursionError was handed on unwrapped as if the guard had
    # stopped the render.
    for template in ["{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
                     "{% for m in messages recursive %}{{ loop([m]) }}{% endfor %}"]:
        with pytest.raises(ChatTemplateError, match="RecursionError"):
            render_chat(USER, FakeTokenizer(template), guard=lambda: None)


def test_ordinary_templates_keep_working_with_the_bounds(dirs: dict[str, Path]) -> None:
    long = [{"role": "user" if i % 2 == 0 else "assistant", "content": "word " * 2000} for i in range(50)]
    text = render_chat(long, Tokenizer(dirs["qwen2"]))
    assert text.count("word") == 100000 and text.endswith("<|im_start|>assistant\n")

"""`tools` and `documents` in chat_template_kwargs: null or a list of dicts, as transformers'
apply_chat_template takes them, refused otherwise at the call on both backends with the same
ValueError naming the variable and the item. They used to reach the template: the mlx_lm backend's
worker failed inside it ("'int' object is not iterable"), the metal backend rendered a string's
characters or a dict's keys as the tools."""
from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pymlxc
from pymlxc.backends.mlx_lm import MlxLmBackend
from pymlxc.model import TextModel
from pymlxc.options import LoadConfig, check_template_kwargs
from pymlxc.testing import write_tiny_model

BACKENDS = ("metal", "mlx_lm")
NAMES = st.sampled_from(["tools", "documents"])
MESSAGES = [{"role": "user", "content": "hi"}]
# Renders each tool's name and each document's title, so a valid value changes the prompt.
TEMPLATE = ("{% for t in tools or [] %}tool: {{ t['name'] }}\n{% endfor %}"
            "{% for d in documents or [] %}doc: {{ d['title'] }}\n{% endfor %}"
            "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")

scalars = st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=5)
values = st.recursive(
    st.none() | scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=8,
)
objects = st.dictionaries(st.text(max_size=5), values, max_size=3)
not_lists = values.filter(lambda v: v is not None and not isinstance(v, list))
not_objects = values.filter(lambda v: not isinstance(v, dict))


def _with_bad_item(draw: st.DrawFn) -> tuple[list[Any], int]:
    items = draw(st.lists(objects, max_size=3))
    at = draw(st.integers(0, len(items)))
    return [*items[:at], draw(not_objects), *items[at:]], at


bad_items = st.composite(_with_bad_item)()


# ---- the check alone (the library's; the worker's wire check is tests/bridge/test_bridge_protocol.py)


@given(NAMES, not_lists)
def test_a_value_that_is_not_a_list_is_refused_naming_the_variable(name: str, value: Any) -> None:
    with pytest.raises(ValueError, match=rf"^chat_template_kwargs\.{name} must be a list of objects .*, not "):
        check_template_kwargs({name: value})


@given(NAMES, bad_items)
def test_an_item_that_is_not_a_dict_is_refused_naming_its_index(name: str, bad: tuple[list[Any], int]) -> None:
    items, at = bad
    with pytest.raises(ValueError, match=rf"^chat_template_kwargs\.{name} item {at} must be an object "):
        check_template_kwargs({name: items})


@given(NAMES, st.none() | st.lists(objects, max_size=3), st.booleans())
def test_null_and_lists_of_dicts_pass_as_they_are(name: str, items: list[dict[str, Any]] | None,
                                                  as_tuple: bool) -> None:
    value = tuple(items) if as_tuple and items is not None else items  # the library takes any sequence
    assert check_template_kwargs({name: value, "enable_thinking": False}) == {name: value, "enable_thinking": False}


def test_a_function_as_a_tool_is_refused_naming_its_type() -> None:
    # transformers converts one to a schema; neither render_chat nor the wire does.
    def get_weather(city: str) -> str:
        return city

    with pytest.raises(ValueError, match=r"^chat_template_kwargs\.tools item 1 .*, not function$"):
        check_template_kwargs({"tools": [{"name": "a"}, get_weather]})


# ---- both backends


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, TextModel]]:
    path: Path = write_tiny_model(tmp_path_factory.mktemp("tools") / "llama", "llama", seed=3, chat_template=TEMPLATE)
    loaded: dict[str, TextModel] = {
        "metal": pymlxc.load_model(str(path), backend="metal", context_len=256),
        "mlx_lm": MlxLmBackend(sys.executable, response_timeout=30.0, load_timeout=120.0).load(
            str(path), LoadConfig(context_len=256)),
    }
    yield loaded
    for m in loaded.values():
        m.close()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kwargs, names", [
    ({"tools": 5}, r"chat_template_kwargs\.tools must be a list of objects \(a tool's JSON schema each\), not int"),
    ({"tools": "x"}, r"chat_template_kwargs\.tools must be a list .*, not str"),
    ({"documents": {"a": 1}}, r"chat_template_kwargs\.documents must be a list .*, not dict"),
    ({"tools": [5]}, r"chat_template_kwargs\.tools item 0 must be an object \(a tool's JSON schema\), not int"),
    ({"documents": [{"title": "t"}, "d"]}, r"chat_template_kwargs\.documents item 1 must be an object .*, not str"),
], ids=["tools 5", "tools str", "documents dict", "tools [5]", "documents [{}, str]"])
def test_wrong_tools_or_documents_raise_at_the_call_alike(models: dict[str, TextModel], backend: str,
                                                          kwargs: dict[str, Any], names: str) -> None:
    m = models[backend]
    with pytest.raises(ValueError, match=f"^{names}$"):
        m.chat(MESSAGES, max_tokens=2, chat_template_kwargs=kwargs)  # lazy stream: raising here is eager
    with pytest.raises(ValueError, match=f"^{names}$"):
        m.prompt_length(MESSAGES, chat_template_kwargs=kwargs)
    assert len(list(m.chat(MESSAGES, max_tokens=2))) == 2 and m.err() is None


@pytest.mark.parametrize("value, error, names", [
    (object(), TypeError, r"chat_template_kwargs\.flag is object, not JSON data .*"),
    (float("nan"), ValueError, r"chat_template_kwargs\.flag is nan, not a finite number"),
    ("a\ud800", ValueError, r"chat_template_kwargs\.flag .*surrogate.*"),
    ({"x": [1, {2: "y"}]}, TypeError, r"chat_template_kwargs\.flag\['x'\]\[1\] has a key that is not a str: 2"),
], ids=["object", "nan", "surrogate", "int key"])
def test_a_value_that_is_not_json_data_raises_alike(models: dict[str, TextModel], value: Any, error: type,
                                                     names: str) -> None:
    """Other variables' values are JSON data on both backends, as a message's other keys: the metal
    backend passed any Python value to the template, the mlx_lm backend refused it when encoding
    the line for its worker, in other words."""
    seen = {}
    for backend, m in models.items():
        with pytest.raises(error, match=f"^{names}$") as caught:
            m.chat(MESSAGES, max_tokens=2, chat_template_kwargs={"flag": value})
        with pytest.raises(error, match=f"^{names}$"):
            m.prompt_length(MESSAGES, chat_template_kwargs={"flag": value})
        seen[backend] = str(caught.value)
        assert len(list(m.chat(MESSAGES, max_tokens=2))) == 2 and m.err() is None, backend
    assert seen["metal"] == seen["mlx_lm"]


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=NAMES, bad=bad_items)
def test_any_list_with_an_item_not_an_object_raises_alike(models: dict[str, TextModel], name: str,
                                                         bad: tuple[list[Any], int]) -> None:
    items, at = bad
    for backend, m in models.items():
        with pytest.raises(ValueError, match=rf"^chat_template_kwargs\.{name} item {at} must be an object"):
            m.chat(MESSAGES, max_tokens=1, chat_template_kwargs={name: items})
        assert m.err() is None, backend


def test_lists_of_dicts_and_none_render_the_same_on_both_backends(models: dict[str, TextModel]) -> None:
    tools = [{"name": "get_weather", "parameters": {"type": "object", "properties": {}}}, {"name": "search"}]
    documents = [{"title": "Notes", "text": "..."}]
    seen = {}
    for backend, m in models.items():
        plain = m.prompt_length(MESSAGES)
        assert m.prompt_length(MESSAGES, chat_template_kwargs={"tools": None, "documents": None}) == plain, backend
        with_both = m.prompt_length(MESSAGES, chat_template_kwargs={"tools": tools, "documents": documents})
        assert with_both > m.prompt_length(MESSAGES, chat_template_kwargs={"tools": tools}) > plain, backend
        ids = [t.id for t in m.chat(MESSAGES, max_tokens=3, chat_template_kwargs={"tools": tools})]
        assert m.err() is None and m.metrics().prompt_tokens == m.prompt_length(
            MESSAGES, chat_template_kwargs={"tools": tools}), backend
        seen[backend] = (plain, with_both, ids)
    assert seen["metal"] == seen["mlx_lm"]

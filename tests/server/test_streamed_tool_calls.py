"""A streamed answer's content when tools may be called (pymlxc/server/tools.py, `StreamedContent`):
however the answer is cut into pieces, the content sent joins into the whole answer's content
(`parse_tool_calls`), and no tool call's text is sent as content."""
from __future__ import annotations

import itertools
import json

from hypothesis import given, settings
from hypothesis import strategies as st

from pymlxc.server.tools import HERMES, LLAMA3, MISTRAL, StreamedContent, parse_tool_calls

CALL = '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
words = st.sampled_from(["Sure.", " ", "\n", "<think>", "plan", "</think>", "<tool", "_call", ">", "<", "x <t",
                         "It is sunny.", "{", "[", "é", "  "])


def stream(text: str, cuts: list[int], fmt: str | None) -> tuple[list[str], str, list]:
    """The pieces sent for `text` cut at `cuts`, then `finish()`'s content and calls."""
    content = StreamedContent(fmt)
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    sent = [content.add(text[a:b]) for a, b in itertools.pairwise(bounds)]
    tail, calls = content.finish()
    return sent, tail, calls


@settings(max_examples=300, deadline=None)
@given(before=st.lists(words, max_size=6), after=st.lists(words, max_size=4), calls=st.integers(0, 2),
       cuts=st.lists(st.integers(0, 400), max_size=30))
def test_the_content_sent_joins_into_the_whole_answers(before: list[str], after: list[str], calls: int,
                                                        cuts: list[int]) -> None:
    text = "".join(before) + "\n".join([CALL] * calls) + "".join(after)
    sent, tail, got_calls = stream(text, cuts, HERMES)
    want_content, want_calls = parse_tool_calls(text, HERMES)
    assert got_calls == want_calls
    joined = "".join(sent) + tail
    if want_calls and text[:1].isspace() and want_content:
        # Whitespace that opens an answer is sent before a later call shows that the whole answer's
        # content, stripped around its calls, drops it.
        assert joined.lstrip() == want_content
    else:
        assert joined == want_content
    if want_calls:
        assert not any("<tool_call>" in piece or "weather" in piece for piece in sent)


def test_thinking_streams_before_a_call_is_held() -> None:
    """Qwen 3's thinking comes out as it is written; the call after it is held and parsed."""
    sent, tail, calls = stream("<think>\nOslo, then.\n</think>\n\n" + CALL, list(range(0, 120, 3)), HERMES)
    assert "".join(sent) == "<think>\nOslo, then.\n</think>" and tail == ""
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("weather", {"city": "Oslo"})]
    assert len([p for p in sent if p]) > 3  # sent piece by piece, not at the end


def test_a_tag_that_does_not_open_a_call_is_content() -> None:
    text = "Use <tool_calls> or <tool_call without a close"
    sent, tail, calls = stream(text, list(range(len(text))), HERMES)
    assert calls == [] and "".join(sent) + tail == text


def test_other_formats_hold_only_an_answer_that_begins_as_a_call() -> None:
    call = '[TOOL_CALLS] [{"name": "weather", "arguments": {"city": "Oslo"}}]'
    sent, tail, calls = stream(call, list(range(0, 80, 5)), MISTRAL)
    assert "".join(sent) == "" and tail == "" and [c.name for c in calls] == ["weather"]
    sent, tail, calls = stream("Hello {there}", [1, 6], LLAMA3)
    assert sent[0] == "H" and "".join(sent) + tail == "Hello {there}" and calls == []
    sent, tail, calls = stream("no tools <tool_call>", [3, 12], None)
    assert sent == ["no ", "tools <to", "ol_call>"] and tail == "" and calls == []

"""Stop strings over streamed pieces: generation stops at the first piece after which the text
holds a stop string, what is sent is the text up to the earliest stop it then holds, and nothing
that could still start one is sent early."""
from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from pymlxc.server.engine import StopStrings
from pymlxc.server.tools import HERMES, LLAMA3, parse_tool_calls

alphabet = st.sampled_from("abc\n")


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet, max_size=40), stops=st.lists(st.text(alphabet, min_size=1, max_size=4), max_size=3),
       cuts=st.lists(st.integers(0, 40), max_size=12))
def test_pieces_up_to_the_first_stop(text: str, stops: list[str], cuts: list[int]) -> None:
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    finder = StopStrings(stops)
    sent, hit = "", False
    for piece in pieces:
        out, hit = finder.feed(piece)
        sent += out
        # Sent text never holds a stop string, and a stop is seen as soon as the text holds it.
        assert not any(s in sent for s in stops)
        if hit:
            break
    if not hit:
        sent += finder.flush()
    # The text when generation stops: up to the first piece's end at which it holds a stop string
    # (a longer stop that starts earlier but would end later is never completed: 'ac' + 'a' with
    # stops 'c' and 'aca' stops at 'c').
    seen = next((text[:b] for b in bounds if any(s in text[:b] for s in stops)), text)
    first = min((seen.find(s) for s in stops if s in seen), default=-1)
    assert hit == (first >= 0)
    assert sent == (seen[:first] if first >= 0 else text)


def test_tool_calls_parse_back() -> None:
    content, calls = parse_tool_calls('<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>', HERMES)
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("f", '{"x": 1}')]
    _, calls = parse_tool_calls('<|python_tag|>{"name": "g", "parameters": {"y": "z"}}', LLAMA3)
    assert [(c.name, c.arguments) for c in calls] == [("g", '{"y": "z"}')]
    text = "no call here <tool_call>not json</tool_call>"
    assert parse_tool_calls(text, HERMES) == (text, [])

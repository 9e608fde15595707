"""app._whole, the non-streamed answer both completion routes collect: the text of every piece up
to the first that finishes, the finish reason ("length" where none gave one), the token pieces, and
the generation closed when collected."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

from hypothesis import given
from hypothesis import strategies as st

from pymlxc.server.app import _whole
from pymlxc.server.engine import Piece

pieces = st.lists(st.builds(Piece, text=st.text(max_size=3), token=st.one_of(st.none(), st.integers(0, 99)),
                            finish=st.one_of(st.none(), st.sampled_from(["stop", "length"]))), max_size=8)


@given(pieces, st.booleans())
def test_whole_answer_is_the_pieces_up_to_the_first_finish(given_pieces: list[Piece], first_apart: bool) -> None:
    async def rest(items: list[Piece]) -> AsyncGenerator[Piece, None]:
        for p in items:
            yield p

    first = given_pieces[0] if first_apart and given_pieces else None
    generation = rest(given_pieces[1:] if first is not None else given_pieces)
    text, finish, tokens = asyncio.run(_whole(first, generation))
    end = next((i + 1 for i, p in enumerate(given_pieces) if p.finish is not None), len(given_pieces))
    seen = given_pieces[:end]
    assert text == "".join(p.text for p in seen)
    assert finish == next((p.finish for p in seen if p.finish is not None), "length")
    assert tokens == [(p.token, p) for p in seen if p.token is not None]
    assert generation.ag_frame is None  # closed (or run to its end): no generation left behind

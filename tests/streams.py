"""Stream helpers shared by the TextModel tests of both backends (test_backend_contract.py and
mlx_lm/test_mlx_lm_textmodel.py)."""
from __future__ import annotations

import threading

from pymlxc.model import TextModel
from pymlxc.types import Token

LONG = 100_000  # a budget no test waits for: the tiny models never pick EOS, so only a stop ends a stream


def cancel_after(model: TextModel, n: int, prompt: str = "Once upon a time") -> list[Token]:
    """The tokens of a generation of `prompt` that only a stop ends, whose cancel event is set as
    the `n`-th token arrives (a backend may still yield what it had in flight)."""
    cancel = threading.Event()
    got: list[Token] = []
    for token in model.generate(prompt, max_tokens=LONG, cancel=cancel):
        got.append(token)
        if len(got) == n:
            cancel.set()
    return got

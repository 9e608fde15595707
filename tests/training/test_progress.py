"""The training progress bar: tqdm on a terminal, silent elsewhere."""
from __future__ import annotations

import io

from pymlxc.training.trainer import Progress, TrainReport


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _reports(n: int) -> list[TrainReport]:
    return [TrainReport(step, train_loss=1.0 / step, learning_rate=1e-4, tokens_per_sec=100.0 * step)
            for step in range(1, n + 1)]


def test_a_terminal_sees_the_steps_and_the_last_loss() -> None:
    out = Terminal()
    bar = Progress(5, stream=out)
    for r in _reports(5):
        bar.show(r)
    bar.close()
    text = out.getvalue()
    assert "5/5" in text and "loss=0.2000" in text and "lr=1.00e-04" in text


def test_a_pipe_gets_nothing() -> None:
    out = io.StringIO()
    bar = Progress(3, stream=out)
    for r in _reports(3):
        bar.show(r)
    bar.close()
    assert out.getvalue() == ""


def test_disabled_is_silent_on_a_terminal() -> None:
    out = Terminal()
    bar = Progress(3, stream=out, enabled=False)
    for r in _reports(3):
        bar.show(r)
    bar.close()
    assert out.getvalue() == ""

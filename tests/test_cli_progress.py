"""The CLI's loading bar (`pymlxc.cli.ProgressBar`, tqdm underneath): drawn on a terminal, silent
elsewhere, and at 100% with the total when the backend reports the last bytes."""
from __future__ import annotations

import io
import threading

from hypothesis import given
from hypothesis import strategies as st

from pymlxc.cli import ProgressBar


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@st.composite
def reports(draw: st.DrawFn) -> tuple[int, list[int]]:
    """A total and the non-decreasing `done` values a loader reports, starting at 0, ending at total."""
    total = draw(st.integers(1, 10**10))
    steps = sorted(draw(st.lists(st.integers(0, total), max_size=20)))
    return total, [0, *steps, total]


@given(reports())
def test_a_terminal_sees_the_bar_reach_the_total(report: tuple[int, list[int]]) -> None:
    total, dones = report
    stream = FakeTerminal()
    bar = ProgressBar("loading tiny", stream=stream)
    for done in dones:
        bar(done, total)
    bar.close()
    text = stream.getvalue()
    assert "loading tiny" in text
    final = text.rstrip().split("\r")[-1]
    assert "100%" in final, final
    assert bar._bar is not None and bar._bar.n == total  # noqa: SLF001 - the bar's own count


@given(reports())
def test_a_pipe_or_log_gets_nothing(report: tuple[int, list[int]]) -> None:
    total, dones = report
    stream = io.StringIO()  # not a terminal
    bar = ProgressBar("loading tiny", stream=stream)
    for done in dones:
        bar(done, total)
    bar.close()
    assert stream.getvalue() == ""


def test_close_without_any_report_writes_nothing() -> None:
    stream = FakeTerminal()
    ProgressBar(stream=stream).close()
    assert stream.getvalue() == ""


def test_reports_from_several_threads_add_up_to_the_total() -> None:
    stream = FakeTerminal()
    bar = ProgressBar(stream=stream)
    total = 8 * 1000
    done = 0
    lock = threading.Lock()

    def report() -> None:
        nonlocal done
        for _ in range(1000):
            with lock:  # the loader's own count, reported in order
                done += 1
                bar(done, total)

    threads = [threading.Thread(target=report) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    bar.close()
    assert bar._bar is not None and bar._bar.n == total  # noqa: SLF001
    assert "100%" in stream.getvalue().rstrip().split("\r")[-1]

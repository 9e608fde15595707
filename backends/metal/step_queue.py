"""How the decode loops queue their steps: on the process's evaluation thread, or here.

With the thread (`pymlxc.core.eval_thread`, on by default on a GPU), a loop builds step n+1 on the
thread's stream while the thread has MLX encode step n: the host's two halves of a step overlap.
Without it, `submit` is a plain `async_eval`. Either way a loop reads a step's result only after
`ready(handle)`, and only through `readable(...)`.
"""
from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pymlxc.core as mx
from pymlxc.core import eval_thread


class StepQueue:
    """One generation's view of where its steps are built and encoded."""

    def __init__(self, threaded: bool | None = None) -> None:
        device = mx.default_device()
        use = eval_thread.enabled(device) if threaded is None else threaded
        self._thread = eval_thread.shared(device) if use else None
        self._pending: list[Any] = []
        self.read = 0  # results the last `pipeline` handed out

    @property
    def threaded(self) -> bool:
        return self._thread is not None

    @contextlib.contextmanager
    def building(self) -> Iterator[None]:
        """Build a step inside this block (on the thread's stream when threaded). Never hold it
        across a `yield`: the consumer's own operations would land on the thread's stream."""
        if self._thread is None:
            yield
            return
        with self._thread.building():
            yield

    def readable(self, tokens: Any) -> Any:
        """What the loop yields for the consumer to read, built with the step: threaded, a copy of
        `tokens`. Reading an array waits on its event and clears it, and the evaluation thread
        touches the events of the next step's inputs (`tokens` is one) as it encodes that step; the
        copy is read by the consumer alone."""
        return mx.copy(tokens) if self._thread is not None else tokens

    def hand_over(self, arrays: Sequence[Any]) -> None:
        """Schedule, from this thread, what the first step reads and this thread built (prefilled
        caches, the prompt's last token): the evaluation thread may only encode its own stream.
        Waits for the submissions so far first: two threads must never evaluate one graph."""
        if self._thread is not None:
            self.drain()
            mx.async_eval(list(arrays))

    def submit(self, arrays: Sequence[Any]) -> Any:
        """Queue the evaluation of a built step; pass the result to `ready` before reading it."""
        if self._thread is None:
            mx.async_eval(list(arrays))
            return None
        ticket = self._thread.submit(list(arrays))
        self._pending.append(ticket)
        return ticket

    def ready(self, handle: Any) -> None:
        """Wait until `handle`'s step is scheduled (its values can then be read)."""
        if handle is not None:
            handle.wait()
            self._pending = [t for t in self._pending if not t.done]

    @property
    def lookahead(self) -> int:
        """Steps a loop should keep queued beyond the one being read: with the thread, two (the
        caller builds step n+2 while the thread encodes step n+1 and the device runs step n: the
        three no longer wait on each other); without it one (the host builds and encodes in turn).
        A loop that queues more must be able to rewind its caches to what was read."""
        return 2 if self._thread is not None else 1

    def pipeline(self, first: Callable[[], Any], following: Callable[[Any], Any], steps: int,
                 lookahead: int = 1) -> Iterator[Any]:
        """The decode loops' shape: yield up to `steps` readable results, with up to `lookahead` later
        steps queued before one is read (the device, or the thread, works on those while the next
        is built). `first()` builds step 1; `following(tokens)` builds step n+1 from step n's (lazy)
        tokens. Stopping early wastes the steps already queued. The first token is read with no step
        queued beyond its own (whatever `lookahead`), so that no build delays it."""
        queued: collections.deque[tuple[Any, Any]] = collections.deque()
        built = 0
        tokens: Any = None
        self.read = 0

        def build() -> None:
            nonlocal built, tokens
            with self.building():
                tokens = first() if built == 0 else following(tokens)
                shown = self.readable(tokens)
            queued.append((shown, self.submit([tokens, shown])))
            built += 1

        for n in range(steps):
            # The first token is read as soon as its own step is queued: building the next step first
            # only delays it where the host is the slower side (28-layer models on a GPU). The device
            # then idles once, while steps 2 and 3 are built.
            while built < steps and built <= n + (lookahead if n else 0):
                build()
            shown, handle = queued.popleft()
            self.ready(handle)
            self.read += 1
            yield shown

    def steps_kept(self, built: int) -> int:
        """Of the `built` steps of the last `pipeline`, those a loop's caches keep when it ends:
        every step up to the one fed the last result read. Steps queued beyond it (an early stop
        with lookahead) are left out, as if never run."""
        return min(built, self.read + 1)

    def drain(self, raise_errors: bool = True) -> None:
        """Wait for every submitted step to be scheduled (before the caller uses their outputs on
        its own stream, or lets anything else read them). `raise_errors=False` when already
        unwinding from another error."""
        pending, self._pending = self._pending, []
        error: BaseException | None = None
        for ticket in pending:
            try:
                ticket.wait()
            except BaseException as exc:  # noqa: BLE001 - the first one is re-raised below
                error = error or exc
        if error is not None and raise_errors:
            raise error


__all__ = ["StepQueue"]

"""`pymlxc serve` over the ranks of a distributed model (`pymlxc launch -n N -- serve MODEL`): rank 0
runs the HTTP server with a `RankEngine`, every other rank runs `follow(model)`.

Every rank must run the same model calls, step for step. Rank 0 takes the requests one at a time
(a queue; no continuous batching, whose steps depend on when requests arrive) and hands each to the
others before running it (`from_rank0`: the call as JSON), so all ranks run the same
`generate`/`chat`; after each token rank 0 says whether to go on (a client that left, or a stop
string reached, ends the call on every rank at the same token). A rank that disagrees (more or
fewer tokens than rank 0: a broken run) or whose call fails ends its process with an error, as the
others then cannot stay in step; the launcher and the watchdog (backends/metal/distributed) end the
rest. Requests are built as for the slot engine (text or messages; the features that need token
ids, such as logprobs and constrained output, are refused with a 400).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import queue
import sys
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from pymlxc.backends.metal.distributed.runtime import from_rank0, ranks_agreeing

from .engine import BadRequest, Finished, Job, Piece, QueueFull, token_pieces

# The codes rank 0 sends (every exchange is rank 0's code; the others only listen).
CALL, GO_ON, STOP, END, FAILED, SHUTDOWN = 1, 2, 3, 4, 5, 6
_EXIT_DELAY = 0.5  # seconds for a failed call's error to reach its client before the rank ends
_NAMES = {CALL: "a new call", GO_ON: "go on", STOP: "stop", END: "the call's end", FAILED: "a failed call",
          SHUTDOWN: "shut down"}


class RankMismatch(RuntimeError):
    """The ranks of a distributed model fell out of step; the message says where."""


def _call_of(job: Job) -> dict[str, Any]:
    p = job.params
    config = {"max_tokens": p.max_tokens, "temperature": p.temperature, "top_k": p.top_k,
              "top_p": p.top_p if p.top_p < 1.0 else 0.0, "min_p": p.min_p, "seed": p.seed,
              "repeat_penalty": p.repetition_penalty}
    if job.messages is not None:
        return {"messages": job.messages, "config": config}
    return {"prompt": job.prompt_text, "config": config}


def _start(model: Any, call: dict[str, Any], size: int) -> tuple[Any, BaseException | None]:
    """The call's token stream, started on every rank together; a call that every rank refuses
    (a bad request: its checks run before any step) is that exception; one that only some ranks
    refuse cannot be run in step (RankMismatch)."""
    config = call["config"]
    error: BaseException | None = None
    stream = None
    try:
        stream = model.chat(call["messages"], **config) if "messages" in call else model.generate(call["prompt"],
                                                                                                    **config)
    except Exception as exc:  # noqa: BLE001 - judged below, with the other ranks
        error = exc
    agreeing = ranks_agreeing(error is None)
    if agreeing not in (0, size):
        raise RankMismatch(f"{size - agreeing} of {size} ranks could not start the call"
                           + (f": {type(error).__name__}: {error}" if error is not None else ""))
    return stream, error


def _fatal(rank: int, why: str) -> None:
    time.sleep(_EXIT_DELAY)
    sys.stderr.write(f"pymlxc serve: rank {rank}: {why}; ending this rank (the ranks cannot stay in step)\n")
    sys.stderr.flush()
    os._exit(1)


@dataclass
class _Work:
    call: dict[str, Any]
    put: Any  # put(item) from the driver thread into the request's coroutine
    cancel: threading.Event = field(default_factory=threading.Event)


class RankEngine:
    """Rank 0's engine: one call at a time, each handed to the other ranks first."""

    features: frozenset[str] = frozenset()

    def __init__(self, model: Any, *, max_queue: int, context_len: int | None) -> None:
        import pymlxc.core as mx  # noqa: PLC0415 - the binding, loaded with the model already

        self.model = model
        self._size = mx.distributed.init().size()
        self.context_len = context_len
        self.tokenizer = None  # jobs as text or messages: the same public calls on every rank
        self.stop_ids: frozenset[int] = frozenset()
        self._queue: queue.Queue[_Work | None] = queue.Queue(maxsize=max_queue + 1)
        self._running = 0
        self._closed = False
        self._driver = threading.Thread(target=self._drive, name="pymlxc-rank0", daemon=True)
        self._driver.start()

    def stats(self) -> dict[str, int]:
        return {"running": self._running, "waiting": self._queue.qsize()}

    async def stream(self, job: Job) -> AsyncIterator[Piece]:
        if job.constraint is not None:  # never built without a tokenizer; refused rather than ignored
            raise ValueError("constrained output is not supported on a distributed model")
        loop = asyncio.get_running_loop()
        items: asyncio.Queue[Any] = asyncio.Queue()

        def put(item: Any) -> None:
            with contextlib.suppress(RuntimeError):  # the event loop is gone (shutting down)
                loop.call_soon_threadsafe(items.put_nowait, item)

        work = _Work(_call_of(job), put)
        try:
            self._queue.put_nowait(work)
        except queue.Full:
            raise QueueFull(f"{self._queue.qsize()} requests are waiting already") from None
        try:
            async with contextlib.aclosing(token_pieces(items, job.stop, job.params.max_tokens)) as pieces:
                async for piece in pieces:
                    yield piece
        finally:
            work.cancel.set()  # the other ranks stop with rank 0 at the next token

    def _drive(self) -> None:
        while True:
            work = self._queue.get()
            if work is None:
                from_rank0(SHUTDOWN)
                return
            self._running = 1
            try:
                self._run(work)
            finally:
                self._running = 0

    def _run(self, work: _Work) -> None:
        count = 0
        try:
            from_rank0(CALL, json.dumps(work.call).encode())
            stream, refused = _start(self.model, work.call, self._size)
            if refused is not None:  # every rank refused it: the request's error, the ranks go on
                bad = isinstance(refused, (ValueError, TypeError))
                work.put(BadRequest(str(refused)) if bad else refused)
                return
            for token in stream:
                count += 1
                work.put(token)
                if work.cancel.is_set():
                    from_rank0(STOP)
                    stream.close()
                    break
                from_rank0(GO_ON)
            else:
                error = self.model.err()
                if error is not None:
                    raise error
                from_rank0(END)
        except Exception as exc:  # noqa: BLE001 - the client hears it; the ranks cannot go on
            work.put(exc)
            with contextlib.suppress(Exception):  # a peer already gone: ending is all that is left
                from_rank0(FAILED)
            _fatal(0, f"a call failed: {type(exc).__name__}: {exc}")
        work.put(Finished(count))

    def close(self) -> None:
        """Tell the other ranks to end (after the calls queued), once."""
        if not self._closed:
            self._closed = True
            self._queue.put(None)
            self._driver.join()


def follow(model: Any) -> None:
    """The other ranks' side: run each call rank 0 hands over, token for token, until it shuts down."""
    import pymlxc.core as mx  # noqa: PLC0415 - the binding, loaded with the model already

    group = mx.distributed.init()
    rank, size = group.rank(), group.size()
    while True:
        code, payload = from_rank0(0)
        if code == SHUTDOWN:
            return
        if code != CALL:
            _fatal(rank, f"expected a new call or shut down from rank 0, got {_NAMES.get(code, code)}")
        call = json.loads(payload)
        try:
            stream, refused = _start(model, call, size)
            if refused is not None:
                continue  # rank 0 answers the client's error
            for _ in stream:
                code, _ = from_rank0(0)
                if code == STOP:
                    stream.close()
                    break
                if code != GO_ON:
                    raise RankMismatch(f"rank 0 sent {_NAMES.get(code, code)} while this rank has more tokens")
            else:
                error = model.err()
                if error is not None:
                    raise error
                code, _ = from_rank0(0)
                if code != END:
                    raise RankMismatch(f"rank 0 sent {_NAMES.get(code, code)} after this rank's last token")
        except Exception as exc:  # noqa: BLE001 - nothing to answer to: the rank ends, saying why
            _fatal(rank, f"{type(exc).__name__}: {exc}")


__all__ = ["RankEngine", "RankMismatch", "follow"]

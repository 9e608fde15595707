"""`pymlxc serve` over the ranks of a distributed model (`pymlxc launch -n N -- serve MODEL`): rank 0
runs the HTTP server, every other rank follows it.

Every rank must run the same model calls, step for step. Where the model batches (`Scheduler`),
rank 0 runs the continuous batch with a `BatchRankEngine` and the others `follow_batch`: the
scheduler is driven turn by turn on every rank (`Scheduler.run_turn`), and before each turn rank 0
hands the others what changes in it (`from_rank0`: the requests that arrived since the last turn,
as token ids and sampling with a seed rank 0 picked where none was given, and those whose client
left or reached a stop string), so that every rank admits, prefills, decodes and drops the same
rows at the same turn; what rank 0's clients do between turns is seen only at the next one. After
each turn the ranks compare whether it ran (a turn that failed on some ranks only leaves them out of
step: they end). A constrained request's grammar travels as llguidance's grammar text, which every
other rank compiles again: the masks, functions of the grammar and the tokens so far, agree.

A model that cannot batch (recurrent layers) is served one call at a time (`RankEngine` and
`follow`): rank 0 hands each call to the others before running it (the call as JSON), so all ranks
run the same `generate`/`chat`; after each token rank 0 says whether to go on (a client that left,
or a stop string reached, ends the call on every rank at the same token). Those requests are built
as for the slot engine (text or messages; logprobs and constrained output are refused with a 400).

A rank that disagrees (more or fewer tokens than rank 0: a broken run) or whose call fails ends its
process with an error, as the others then cannot stay in step; the launcher and the watchdog
(backends/metal/distributed) end the rest.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import itertools
import json
import os
import queue
import secrets
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from pymlxc.backends.metal import batching
from pymlxc.backends.metal.distributed.runtime import from_rank0, ranks_agreeing
from pymlxc.model import ModelClosedError

from .constraints import GrammarFactory
from .engine import BadRequest, BatchEngine, Finished, Job, Piece, QueueFull, token_pieces

# The codes rank 0 sends (every exchange is rank 0's code; the others only listen).
CALL, GO_ON, STOP, END, FAILED, SHUTDOWN, TURN = 1, 2, 3, 4, 5, 6, 7
_EXIT_DELAY = 0.5  # seconds for a failed call's error to reach its client before the rank ends
_NAMES = {CALL: "a new call", GO_ON: "go on", STOP: "stop", END: "the call's end", FAILED: "a failed call",
          SHUTDOWN: "shut down", TURN: "a batch turn"}


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


# ---------------------------------------------------------------------- the continuous batch in step

def _params_json(p: batching.SamplingParams) -> dict[str, Any]:
    fields = dataclasses.asdict(p)
    fields["logit_bias"] = [list(pair) for pair in p.logit_bias]
    fields["stop_ids"] = sorted(p.stop_ids)
    return fields


def _params_of(fields: dict[str, Any]) -> batching.SamplingParams:
    bias = tuple((int(i), float(b)) for i, b in fields["logit_bias"])
    return batching.SamplingParams(**{**fields, "logit_bias": bias, "stop_ids": frozenset(fields["stop_ids"])})


class _Turns:
    """A scheduler driven by turns that are the same on every rank: each turn's message (new
    requests by key, keys cancelled) applied, then the turn run. `forward(key)` is where a
    request's events go besides (rank 0: its client; the others: nowhere); `constraint(key,
    grammar)` gives a constrained request its grammar state (rank 0: the client's; the others: the
    same grammar compiled again, whose masks then follow the same tokens)."""

    def __init__(self, scheduler: batching.Scheduler, forward: Callable[[int], Callable[[batching.Event], None]],
                 constraint: Callable[[int, str], batching.Constraint]) -> None:
        self.scheduler = scheduler
        self._forward = forward
        self._constraint = constraint  # (key, grammar text) -> this rank's grammar state for the request
        self.live: dict[int, batching.Request] = {}  # key -> this rank's request, until it finishes
        self.checksum = 0  # of the last turn's events (tokens and finishes, by key): the same on every rank

    def run(self, message: dict[str, Any]) -> None:
        self.checksum = 0
        for key in message.get("cancel", ()):
            request = self.live.get(key)
            if request is not None:
                request.cancel()
        new = []
        for key, prompt, params, grammar in message.get("new", ()):
            constraint = self._constraint(key, grammar) if grammar is not None else None
            request = batching.Request(prompt, _params_of(params), self._emitter(key, self._forward(key)), constraint)
            self.live[key] = request
            new.append(request)
        self.scheduler.run_turn(new)

    def _emitter(self, key: int, forward: Callable[[batching.Event], None]) -> Callable[[batching.Event], None]:
        def emit(event: batching.Event) -> None:
            if event.finish is not None:
                self.live.pop(key, None)
            what = event.token + 1 if event.token is not None else -_FINISHES.get(event.finish or "", 9)
            self.checksum = (self.checksum * 1_000_003 + key * 65_537 + what) % (1 << 31)
            forward(event)
        return emit


_FINISHES = {"stop": 1, "length": 2, "cancelled": 3, "error": 4}


def _agree_on_turn(ok: bool, checksum: int, size: int, rank: int, error: BaseException | None) -> None:
    """After every turn: each rank says whether it ran and what it emitted (`_Turns.checksum`); a
    turn that failed on some ranks only, or whose rows got other tokens on some ranks, ends this
    rank (the steps after it would not match: another prompt's rows, another grammar state)."""
    import numpy as np  # noqa: PLC0415

    import pymlxc.core as mx  # noqa: PLC0415 - the binding, loaded with the model already

    got = np.asarray(mx.distributed.all_gather(mx.array([1 if ok else 0, checksum], mx.int32))).reshape(size, 2)
    agreeing = int(got[:, 0].sum())
    if agreeing not in (0, size):
        why = f"{size - agreeing} of {size} ranks failed a batch turn"
        _fatal(rank, why + (f" (here: {type(error).__name__}: {error})" if error is not None else ""))
    if agreeing == size and len(set(got[:, 1].tolist())) > 1:
        _fatal(rank, "the ranks' rows got different tokens in a batch turn")


def _ignore(event: batching.Event) -> None:
    """A following rank's events: rank 0 answers the clients."""


class BatchRankEngine(BatchEngine):
    """Rank 0's engine where the model batches: the continuous batch, its turns run in step with
    the other ranks' `follow_batch` (the module doc)."""

    features = BatchEngine.features

    def __init__(self, model: Any, *, max_concurrency: int, max_queue: int) -> None:
        import pymlxc.core as mx  # noqa: PLC0415 - the binding, loaded with the model already

        super().__init__(model, max_concurrency=max_concurrency, max_queue=max_queue)
        self._size = mx.distributed.init().size()
        self._max_queue = max_queue
        self._incoming: collections.deque[batching.Request] = collections.deque()
        self._clients: dict[int, batching.Request] = {}  # key -> the client's request (events, cancel)
        self._keys = itertools.count()
        self._cond = threading.Condition()
        self._closing = False
        self._turns = _Turns(self.scheduler, lambda key: self._clients[key].emit, self._client_constraint)
        self._driver = threading.Thread(target=self._drive, name="pymlxc-rank0-batch", daemon=True)
        self._driver.start()

    def _client_constraint(self, key: int, grammar: str) -> batching.Constraint:
        constraint = self._clients[key].constraint
        assert constraint is not None  # a grammar is sent only for a constrained request
        return constraint

    def submit(self, request: batching.Request) -> None:
        if request.constraint is not None and not isinstance(getattr(request.constraint, "grammar", None), str):
            raise BadRequest("a constraint without a grammar text cannot be repeated on the other ranks",
                             param="response_format")
        with self._cond:
            if self._closing:
                raise ModelClosedError("the server is shutting down")
            waiting = len(self._incoming) + self.scheduler.stats()["queued"]
            free = max(0, self.scheduler.max_batch - self.scheduler.running())
            if waiting + 1 > self._max_queue + free:
                raise QueueFull(f"{waiting} requests are waiting already (max_queue={self._max_queue})")
            self._incoming.append(request)
            self._cond.notify_all()

    def _next_message(self) -> dict[str, Any] | None:
        """What changes in the next turn, once there is a turn to run; None when closed and idle."""
        with self._cond:
            while not self._incoming and self.scheduler.idle() and not self._closing:
                self._cond.wait(0.5)
            if self._closing and not self._incoming and self.scheduler.idle():
                return None
            arrived = list(self._incoming)
            self._incoming.clear()
            cancel = [key for key, mine in self._turns.live.items()
                      if self._clients[key].cancelled and not mine.cancelled]
            new = []
            for client in arrived:
                params = client.params
                if params.seed is None:  # one draw for every rank's sampler of this row
                    params = dataclasses.replace(params, seed=secrets.randbits(31))
                key = next(self._keys)
                self._clients[key] = client
                grammar = getattr(client.constraint, "grammar", None) if client.constraint is not None else None
                new.append([key, client.prompt, _params_json(params), grammar])
        return {"new": new, "cancel": cancel}

    def _drive(self) -> None:
        try:
            while True:
                message = self._next_message()
                if message is None:
                    from_rank0(SHUTDOWN)
                    return
                payload = json.dumps(message).encode() if message["new"] or message["cancel"] else b""
                from_rank0(TURN, payload)
                error: BaseException | None = None
                try:
                    self._turns.run(message)
                except Exception as exc:  # noqa: BLE001 - its requests failed with it; the ranks compare
                    error = exc
                _agree_on_turn(error is None, self._turns.checksum, self._size, 0, error)
                with self._cond:
                    self._clients = {k: c for k, c in self._clients.items() if k in self._turns.live}
        except Exception as exc:  # noqa: BLE001 - a lost peer: the clients hear it, the rank ends
            with self._cond:
                clients = list(self._clients.values()) + list(self._incoming)
            for client in clients:
                client.emit(batching.Event(finish="error", error=exc))
            _fatal(0, f"the batch loop stopped: {type(exc).__name__}: {exc}")

    def close(self) -> None:
        """Cancel what runs, fail what waits, then tell the other ranks to end (once)."""
        with self._cond:
            if self._closing:
                return
            self._closing = True
            left = list(self._incoming)
            self._incoming.clear()
            for client in self._clients.values():
                client.cancel()
            self._cond.notify_all()
        for client in left:
            client.emit(batching.Event(finish="error", error=ModelClosedError("the server is shutting down")))
        self._driver.join()


def follow_batch(model: Any, *, max_concurrency: int, max_queue: int) -> None:
    """The other ranks' side of a batching model: run each turn rank 0 hands over, until it shuts
    down. `max_concurrency` and `max_queue` as rank 0's engine has them (the rows a turn admits)."""
    import pymlxc.core as mx  # noqa: PLC0415 - the binding, loaded with the model already

    group = mx.distributed.init()
    rank, size = group.rank(), group.size()
    scheduler = model.scheduler(max_batch=max_concurrency, max_queue=max_queue)
    scheduler.warm()  # as rank 0's engine does before it listens: the same steps on every rank
    grammars: list[GrammarFactory] = []

    def constraint(key: int, grammar: str) -> batching.Constraint:
        if not grammars:  # as the server builds rank 0's (app.create_app), at the first constrained request
            grammars.append(GrammarFactory(model.tokenizer.backend.to_str(), model.info().vocab_size, model.stop_ids))
        return grammars[0].from_grammar(grammar)

    turns = _Turns(scheduler, lambda key: _ignore, constraint)
    while True:
        code, payload = from_rank0(0)
        if code == SHUTDOWN:
            return
        if code != TURN:
            _fatal(rank, f"expected a batch turn or shut down from rank 0, got {_NAMES.get(code, code)}")
        error: BaseException | None = None
        try:
            turns.run(json.loads(payload) if payload else {})
        except Exception as exc:  # noqa: BLE001 - compared with the other ranks below
            error = exc
        _agree_on_turn(error is None, turns.checksum, size, rank, error)


__all__ = ["BatchRankEngine", "RankEngine", "RankMismatch", "follow", "follow_batch"]

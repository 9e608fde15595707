"""`pymlxc serve` over the ranks of a distributed model (`pymlxc launch -n N -- serve MODEL`): rank 0
runs the HTTP server with a `BatchRankEngine`, every other rank runs `follow_batch`.

Every rank must run the same model calls, step for step. Each rank's continuous batch
(`Scheduler`) is driven turn by turn (`Scheduler.run_turn`), and before each turn rank 0 hands the
others what changes in it (`from_rank0`: the requests that arrived since the last turn, as token
ids and sampling with a seed rank 0 drew where none was given, and those whose client left or
reached a stop string), so that every rank admits, prefills, decodes and drops the same rows at the
same turn; what rank 0's clients do between turns counts from the next one. A constrained
request's grammar travels as llguidance's grammar text, which every other rank compiles again: the
masks, functions of the grammar and the tokens so far, agree.

After each turn the ranks compare whether it ran and a checksum of what it gave each row. A turn
that failed on some ranks only, or gave some rows other tokens, ends every rank with an error (the
steps after it could not match); the launcher and the watchdog (backends/metal/distributed) end
the rest.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import os
import secrets
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from pymlxc.backends.metal import batching
from pymlxc.backends.metal.distributed.runtime import from_rank0
from pymlxc.model import ModelClosedError

from .constraints import GrammarFactory
from .engine import BadRequest, BatchEngine, QueueFull

# The codes rank 0 sends (every exchange is rank 0's code; the others only listen).
TURN, SHUTDOWN = 1, 2
_EXIT_DELAY = 0.5  # seconds for a failed call's error to reach its client before the rank ends
_NAMES = {TURN: "a batch turn", SHUTDOWN: "shut down"}


def _fatal(rank: int, why: str) -> None:
    time.sleep(_EXIT_DELAY)
    sys.stderr.write(f"pymlxc serve: rank {rank}: {why}; ending this rank (the ranks cannot stay in step)\n")
    sys.stderr.flush()
    os._exit(1)


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
    """Rank 0's engine: the continuous batch, its turns run in step with the other ranks'
    `follow_batch` (the module doc)."""

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
    """The other ranks' side: run each turn rank 0 hands over, until it shuts down.
    `max_concurrency` and `max_queue` as rank 0's engine has them (the rows a turn admits)."""
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


__all__ = ["BatchRankEngine", "follow_batch"]

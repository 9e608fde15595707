"""What the HTTP layer generates through: `BatchEngine` (the metal backend's continuous batch) or
`SlotEngine` (a `TextModel` of either backend, one generation per `parallel_slots` slot: the
mlx_lm backend's worker slots, or a metal model whose caches cannot join a batch).

Both turn a `Job` into an async stream of `Piece`s (text after stop strings, with the token's
log-probabilities) that ends with the finish reason; leaving the stream early (a client that went
away) cancels the generation and frees its cache.
"""
from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from typing import Any

from pymlxc.backends.metal import batching

QueueFull = batching.QueueFull


class BadRequest(ValueError):
    """A request the model cannot serve as asked (the message names the field)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass
class Job:
    """One generation: the prompt (ids for the batch engine; text or messages for a slot engine),
    the sampling, stop strings and constraint. `prompt_tokens`: the prompt's length in tokens
    (for the usage), set by a slot engine once it has counted them."""

    params: batching.SamplingParams
    prompt_ids: list[int] | None = None
    prompt_text: str | None = None
    messages: list[dict[str, Any]] | None = None
    stop: list[str] = field(default_factory=list)
    constraint: batching.Constraint | None = None
    prompt_tokens: int | None = None


@dataclass
class Piece:
    text: str = ""
    token: int | None = None
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    finish: str | None = None  # on the last piece: "stop" or "length"


class StopStrings:
    """Finds stop strings in streamed text, across token boundaries: text that could still be the
    start of a stop string is held back until the next piece decides it."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self._held = ""

    def feed(self, piece: str) -> tuple[str, bool]:
        """The text that is safe to send, and whether a stop string was reached (the text ends before it)."""
        text = self._held + piece
        if not self.stops:
            self._held = ""
            return text, False
        cut = min((text.find(s) for s in self.stops if s in text), default=-1)
        if cut >= 0:
            self._held = ""
            return text[:cut], True
        hold = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        self._held = text[len(text) - hold:] if hold else ""
        return text[: len(text) - hold], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held


@dataclass(frozen=True)
class Finished:
    """A generating thread's last item for its request: why the generation ended ("stop" or "length")."""

    reason: str


async def token_pieces(items: asyncio.Queue[Any], stop: Sequence[str]) -> AsyncGenerator[Piece, None]:
    """The pieces of what a generating thread puts in `items` (tokens with `.id` and `.text`, then
    `Finished`, or the exception that stopped it), with the stop strings found across tokens."""
    stops = StopStrings(stop)
    while True:
        item = await items.get()
        if isinstance(item, BaseException):
            raise item
        if isinstance(item, Finished):
            yield Piece(stops.flush(), finish=item.reason)
            return
        text, hit = stops.feed(item.text)
        yield Piece(text, item.id, finish="stop" if hit else None)
        if hit:
            return


class BatchEngine:
    """Requests into the metal model's scheduler."""

    def __init__(self, model: Any, *, max_concurrency: int, max_queue: int) -> None:
        self.model = model
        self.scheduler = model.scheduler(max_batch=max_concurrency, max_queue=max_queue)
        # Before the server listens: the first requests at each batch size would otherwise wait
        # for what the device compiles once per size (seconds each on CUDA).
        self.scheduler.warm()
        self.tokenizer = model.tokenizer
        self.vocab_size = model.info().vocab_size
        self.stop_ids = model.stop_ids
        self.context_len = self.scheduler.context_len

    features = frozenset({"logprobs", "logit_bias", "penalties", "constraint", "tools"})

    def stats(self) -> dict[str, int]:
        import pymlxc.core as mx

        return {**self.scheduler.stats(), "active_memory_bytes": mx.get_active_memory()}

    def submit(self, request: batching.Request) -> None:
        """Hand `request` to the loop that runs it (QueueFull where too many wait)."""
        self.scheduler.submit(request)

    async def stream(self, job: Job) -> AsyncGenerator[Piece, None]:
        assert job.prompt_ids is not None
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[batching.Event] = asyncio.Queue()

        def emit(event: batching.Event) -> None:
            with contextlib.suppress(RuntimeError):  # the event loop is gone (server shutting down)
                loop.call_soon_threadsafe(events.put_nowait, event)

        request = batching.Request(job.prompt_ids, job.params, emit, job.constraint)
        self.submit(request)
        detokenizer = self.tokenizer.detokenizer()
        stops = StopStrings(job.stop)
        try:
            while True:
                event = await events.get()
                if event.token is not None:
                    text, hit = stops.feed(detokenizer.add(event.token))
                    if hit:
                        yield Piece(text, event.token, event.logprob, event.top_logprobs, finish="stop")
                        return
                    yield Piece(text, event.token, event.logprob, event.top_logprobs)
                    continue
                if event.finish == "error":
                    raise event.error if event.error is not None else RuntimeError("generation failed")
                tail, hit = stops.feed(detokenizer.finish())
                # A stop string in the text released at the end stops as one in a token's text does.
                finish = "stop" if hit or event.finish != "length" else "length"
                yield Piece(tail + ("" if hit else stops.flush()), finish=finish)
                return
        finally:
            request.cancel()


class SlotEngine:
    """Any `TextModel` with a `prompt_length` (both backends): each job runs `generate`/`chat` on a
    thread, holding one of the model's slots. The prompt is counted first, on that thread: a prompt
    that fills `context_len` is a BadRequest, and `max_tokens` ends where the context does."""

    def __init__(self, model: Any, *, max_concurrency: int, max_queue: int, context_len: int | None) -> None:
        self.model = model
        self.limit = max_concurrency + max_queue
        self.context_len = context_len
        self._inflight = 0
        self._lock = threading.Lock()
        self.tokenizer = None
        self.stop_ids: frozenset[int] = frozenset()

    features: frozenset[str] = frozenset()

    def stats(self) -> dict[str, int]:
        return {"running": self._inflight}

    def _prepare(self, job: Job) -> int:
        """Count the job's prompt (kept in `job.prompt_tokens`) and return its max_tokens within the
        context. The model's own argument checks (a lone surrogate, a message it cannot take) raise
        here, before generating, as BadRequest."""
        param = "messages" if job.messages is not None else "prompt"
        try:
            count = int(self.model.prompt_length(job.messages if job.messages is not None else job.prompt_text))
        except (TypeError, ValueError) as exc:  # an invalid argument: the model's message names it
            raise BadRequest(f"{param}: {exc}", param=param) from None
        job.prompt_tokens = count
        if self.context_len is None:
            return job.params.max_tokens
        if count >= self.context_len:
            raise BadRequest(f"the prompt has {count} tokens; this model's context is {self.context_len}",
                             param=param, code="context_length_exceeded")
        return min(job.params.max_tokens, self.context_len - count)

    async def stream(self, job: Job) -> AsyncGenerator[Piece, None]:
        with self._lock:
            if self._inflight >= self.limit:
                raise QueueFull(f"{self._inflight} requests are running or waiting already")
            self._inflight += 1
        loop = asyncio.get_running_loop()
        items: asyncio.Queue[Any] = asyncio.Queue()
        cancel = threading.Event()
        p = job.params
        # SamplingParams hold the library's meanings (0 is off for top_p), as the model takes them.
        config: dict[str, Any] = {"temperature": p.temperature, "top_k": p.top_k, "top_p": p.top_p,
                                  "min_p": p.min_p, "seed": p.seed, "repeat_penalty": p.repetition_penalty,
                                  "cancel": cancel}

        def put(item: Any) -> None:
            with contextlib.suppress(RuntimeError):  # the event loop is gone (server shutting down)
                loop.call_soon_threadsafe(items.put_nowait, item)

        def work() -> None:
            try:
                max_tokens = self._prepare(job)
                stream = (self.model.chat(job.messages, max_tokens=max_tokens, **config) if job.messages is not None
                          else self.model.generate(job.prompt_text, max_tokens=max_tokens, **config))
                count = 0
                for token in stream:
                    count += 1
                    put(token)
                error = self.model.err()
                put(error if error is not None and not cancel.is_set()
                    else Finished("length" if count >= max_tokens else "stop"))
            except BaseException as exc:  # noqa: BLE001 - handed to the request's coroutine
                put(exc)

        thread = threading.Thread(target=work, name="pymlxc-slot", daemon=True)
        thread.start()
        try:
            async with contextlib.aclosing(token_pieces(items, job.stop)) as pieces:
                async for piece in pieces:
                    yield piece
        finally:
            cancel.set()
            with self._lock:
                self._inflight -= 1

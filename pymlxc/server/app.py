"""The OpenAI-compatible HTTP API (FastAPI): `create_app(model, ServerConfig)`.

Routes: GET /health, GET /v1/models, POST /v1/completions, POST /v1/chat/completions (`stream`
as server-sent events ending with `data: [DONE]`). Errors use OpenAI's shape
`{"error": {"message", "type", "param", "code"}}`: 400 for a bad body (malformed JSON, a wrong
type, a value out of range, a prompt too long), 401 for a missing or wrong API key, 413 for a body
over the limit, 429 when the queue is full, 500 when generation fails, 503 when the server stops
before the answer is done. A stream that fails after it started ends with one event
`{"error": {...}}` (what OpenAI sends, and its client raises), not with a cut connection.

A generation lasts only as long as someone waits for it: a client that disconnects (while queued,
during its prefill, or before its whole answer) cancels it. A stopping server (`Lifecycle.stop`,
which `pymlxc serve` calls on SIGTERM/SIGINT) gives the requests in flight SHUTDOWN_GRACE_S seconds
to finish, then answers them 503 (`code: server_shutting_down`).
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import math
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sse_starlette.sse import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pymlxc.backends.metal import batching
from pymlxc.options import checked_real

from . import tools as toolcalls
from .constraints import ConstraintError, GrammarFactory
from .engine import BadRequest, BatchEngine, Job, Piece, QueueFull, SlotEngine
from .schemas import FIELD_NAMES, ChatMessage, ChatRequest, CompletionRequest, NamedToolChoice, Sampling

T = TypeVar("T")
# Seconds a stopping server lets its requests in flight run on before answering them 503: less
# than the uvicorn graceful shutdown (`pymlxc serve`: 5 s), after which uvicorn cuts what is left.
SHUTDOWN_GRACE_S = 2.0


@dataclass(frozen=True)
class ServerConfig:
    model_id: str = "model"
    api_key: str | None = None
    max_concurrency: int = 16
    max_queue: int = 64
    max_body_bytes: int = 1 << 20
    max_tokens_limit: int = 4096
    cors_origins: tuple[str, ...] = ()


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.kind, self.param, self.code = status, kind, param, code


def _error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
                code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
           code: str | None = None) -> JSONResponse:
    return JSONResponse(_error_body(message, kind, param, code), status_code=status)


def _stream_error(exc: Exception) -> str:
    """The last event of a stream that failed after it started: OpenAI's error object."""
    if isinstance(exc, ApiError):
        return json.dumps(_error_body(str(exc), exc.kind, exc.param, exc.code))
    return json.dumps(_error_body(f"generation failed: {type(exc).__name__}: {exc}", "server_error"))


class ClientGone(Exception):
    """The client disconnected before its answer was done."""


def shutting_down() -> ApiError:
    return ApiError(503, "the server is shutting down; the request was not finished", "server_error",
                    code="server_shutting_down")


class Lifecycle:
    """Whether the server is stopping. `stop()` may be called from a signal handler or any thread;
    coroutines of the app's event loop `await expired()`, which returns SHUTDOWN_GRACE_S seconds
    after the stop."""

    def __init__(self, grace: float = SHUTDOWN_GRACE_S) -> None:
        self.grace = grace
        self.stopping = False
        self._event: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def stop(self) -> None:
        self.stopping = True
        loop, event = self._loop, self._event
        if loop is not None and event is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed already
                loop.call_soon_threadsafe(event.set)

    async def stopped(self) -> None:
        if self._event is None:
            self._event = asyncio.Event()
            self._loop = asyncio.get_running_loop()
        if self.stopping:  # stop() may have run before the event existed
            self._event.set()
        await self._event.wait()

    async def expired(self) -> None:
        await self.stopped()
        await asyncio.sleep(self.grace)


async def _disconnected(request: Request) -> None:
    """Return once the client has gone (the body was read already: what comes next is its disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _race(work: Coroutine[Any, Any, T], request: Request | None, lifecycle: Lifecycle) -> T:
    """`work`'s result, unless the client leaves first (ClientGone; `request` None: not watched) or
    the server has been stopping for its grace period (503). Either way `work` is cancelled, and its
    cleanup (the generation's cancel) has run when this raises."""
    task = asyncio.ensure_future(work)
    watchers = [asyncio.ensure_future(lifecycle.expired())]
    if request is not None:
        watchers.append(asyncio.ensure_future(_disconnected(request)))
    try:
        done, _ = await asyncio.wait([task, *watchers], return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        raise shutting_down() if watchers[0] in done else ClientGone()
    finally:
        for t in (task, *watchers):
            t.cancel()
        await asyncio.gather(task, *watchers, return_exceptions=True)


async def _until_stopped(source: AsyncGenerator[T, None], lifecycle: Lifecycle) -> AsyncGenerator[T, None]:
    """`source`'s items; a 503 ApiError once the server has been stopping for its grace period.
    Closing this closes `source`."""
    expired = asyncio.ensure_future(lifecycle.expired())
    step: asyncio.Future[T] | None = None
    try:
        while True:
            step = asyncio.ensure_future(source.__anext__())
            done, _ = await asyncio.wait([step, expired], return_when=asyncio.FIRST_COMPLETED)
            if step not in done:
                raise shutting_down()
            try:
                item = step.result()
            except StopAsyncIteration:
                return
            step = None
            yield item
    finally:
        expired.cancel()
        if step is not None and not step.done():
            # Cancelled inside source.__anext__, `source` ends there, running its own cleanup on
            # the step's task (this one may be cancelled itself and cannot wait for it).
            step.cancel()
        else:
            await source.aclose()


class BodyLimit:
    """ASGI middleware: a request body over `limit` bytes gets 413, by its Content-Length, else once
    the bytes read pass the limit. The body is read here, whole, before the app sees it: an error
    raised while the app reads would be the app's to answer (FastAPI makes any a 400)."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_large = _error(413, f"request body over {self.limit} bytes", code="request_too_large")
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() and int(value) > self.limit:
                await too_large(scope, receive, send)
                return
        chunks: list[bytes] = []
        seen = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left while sending
                return
            chunks.append(message.get("body", b""))
            seen += len(chunks[-1])
            if seen > self.limit:
                await too_large(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        whole: list[Message] = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]
        if scope.get("method") == "POST":
            scope = _as_json(scope)

        async def replay() -> Message:
            # The body once, then what the client sends next (its disconnect, which streams watch for).
            return whole.pop() if whole else await receive()

        await self.app(scope, replay, send)


def _as_json(scope: Scope) -> Scope:
    """`scope` with its body declared JSON: every POST body of this API is JSON, and a client that
    sends it as something else (`curl -d` sends application/x-www-form-urlencoded) would otherwise
    get its body refused as "not an object" rather than read."""
    headers = [(k, v) for k, v in scope.get("headers", []) if k != b"content-type"]
    return {**scope, "headers": [*headers, (b"content-type", b"application/json")]}


def _param(loc: list[Any]) -> str | None:
    """An error location as the request names the field: union members that pydantic adds to the
    location ("str", "list[int]", "NamedToolChoice", "literal['none',...]") left out."""
    return ".".join(str(p) for p in loc if isinstance(p, int) or p in FIELD_NAMES) or None


def _engine_for(model: Any, config: ServerConfig) -> BatchEngine | SlotEngine:
    if hasattr(model, "scheduler"):
        try:
            return BatchEngine(model, max_concurrency=config.max_concurrency, max_queue=config.max_queue)
        except batching.BatchingUnsupported:
            pass
    return SlotEngine(model, max_concurrency=config.max_concurrency, max_queue=config.max_queue,
                      context_len=model.context_len)


def create_app(model: Any, config: ServerConfig = ServerConfig(), *, engine: Any = None) -> FastAPI:
    """The API serving `model` (a loaded `TextModel`); the caller owns the model's lifetime.
    `engine`: what generates (default: the model's batch or slot engine; rank 0 of a distributed
    model passes its `ranks.RankEngine`)."""
    engine = engine if engine is not None else _engine_for(model, config)
    tokenizer = engine.tokenizer
    grammars: GrammarFactory | None = None
    tool_fmt = toolcalls.HERMES
    if tokenizer is not None:
        backend = getattr(tokenizer, "backend", None)
        if backend is not None:
            grammars = GrammarFactory(backend.to_str(), engine.vocab_size, engine.stop_ids)
        tool_fmt = toolcalls.tool_format(tokenizer.chat_template, tokenizer.model_type)
    app = FastAPI(title="pymlxc", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine = engine
    lifecycle = Lifecycle()
    app.state.lifecycle = lifecycle  # `pymlxc serve` stops it when uvicorn is told to exit
    created = int(time.time())

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = list(exc.errors())
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            where = [p for p in first.get("loc", ()) if isinstance(p, int)]
            why = (first.get("ctx") or {}).get("error") or first.get("msg", "")
            return _error(400, f"the body is not valid JSON: {why}" + (f" at character {where[0]}" if where else ""),
                          code="invalid_json")
        # A value that fits no member of a union fails once per member: the error that got deepest
        # into the value says most (a content part's type, not "content: not a string").
        located = [(_param([p for p in e.get("loc", ()) if p != "body"]), e) for e in errors]
        param, chosen = max(located, key=lambda pe: len(pe[0].split(".")) if pe[0] else 0,
                            default=(None, first))
        return _error(400, f"{param or 'body'}: {chosen.get('msg', 'invalid')}", param=param)

    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        return _error(exc.status, str(exc), exc.kind, exc.param, exc.code)

    @app.exception_handler(ClientGone)
    async def gone(_: Request, exc: ClientGone) -> JSONResponse:  # nobody reads this; not a server error
        return _error(499, "the client closed the request", code="client_closed_request")

    @app.exception_handler(Exception)
    async def failed(_: Request, exc: Exception) -> JSONResponse:
        return _error(500, f"generation failed: {type(exc).__name__}: {exc}", "server_error")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400 and isinstance(exc.__cause__, ValueError):
            # FastAPI's "There was an error parsing the body": bytes that are not UTF-8, a number
            # with more digits than Python reads.
            return _error(400, f"the body is not valid JSON: {exc.__cause__}", code="invalid_json")
        if exc.status_code == 400 and isinstance(exc.__cause__, RecursionError):
            return _error(400, "the body is not valid JSON: nested too deeply", code="invalid_json")
        return _error(
            exc.status_code, str(exc.detail), "invalid_request_error" if exc.status_code < 500 else "server_error"
        )

    async def authorize(request: Request) -> None:
        if config.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), config.api_key.encode()):
            raise ApiError(401, "invalid or missing API key", "authentication_error", code="invalid_api_key")

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", **engine.stats()}

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": config.model_id, "object": "model", "created": created,
                                            "owned_by": "pymlxc"}]}

    # ------------------------------------------------------------------ building a job
    def need(feature: str, param: str) -> None:
        if feature not in engine.features:
            raise ApiError(400, f"{param} is not supported by this model's backend", param=param)

    def sampling(
        body: Sampling, prompt_len: int, max_tokens: int | None, logprobs: int | None, prompt_param: str
    ) -> batching.SamplingParams:
        """The request's sampling as the scheduler takes it (the library's meanings). `prompt_len`:
        the prompt's tokens, 0 where the engine counts them itself (a slot engine)."""
        limit = config.max_tokens_limit
        if max_tokens is not None and max_tokens > limit:
            named = ("max_completion_tokens" if isinstance(body, ChatRequest) and body.max_completion_tokens is not None
                     else "max_tokens")
            raise ApiError(400, f"{named} is {max_tokens}, over this server's limit of {limit}", param=named)
        context = engine.context_len
        if context is not None and prompt_len >= context:
            raise ApiError(400, f"the prompt has {prompt_len} tokens; this model's context is {context}",
                           param=prompt_param, code="context_length_exceeded")
        room = limit if context is None else min(limit, context - prompt_len)
        bias: tuple[tuple[int, float], ...] = ()
        if body.logit_bias:
            need("logit_bias", "logit_bias")
            bias = _logit_bias(body.logit_bias, getattr(engine, "vocab_size", 0))
        if body.presence_penalty or body.frequency_penalty:
            need("penalties", "presence_penalty" if body.presence_penalty else "frequency_penalty")
        if logprobs is not None:
            need("logprobs", "logprobs")
        top_p, top_k = _nucleus(body.top_p, body.top_k)
        try:
            return batching.SamplingParams(
                max_tokens=room if max_tokens is None else min(max_tokens, room), temperature=body.temperature,
                top_p=top_p, top_k=top_k, min_p=body.min_p, seed=body.seed,
                presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                repetition_penalty=body.repetition_penalty, logit_bias=bias, logprobs=logprobs,
                stop_ids=engine.stop_ids)
        except (TypeError, ValueError) as exc:  # the message names the option (pymlxc/options.py)
            named = str(exc).split(" ", 1)[0]
            raise ApiError(400, str(exc), param=named if named in Sampling.model_fields else None) from None

    def encode_ids(ids: list[int], param: str) -> list[int]:
        vocab = getattr(engine, "vocab_size", 0)
        if not ids:
            raise ApiError(400, f"{param} is empty", param=param)
        if any(not 0 <= t < vocab for t in ids):
            raise ApiError(400, f"{param}: token ids must be in [0, {vocab})", param=param)
        return ids

    async def completion_job(body: CompletionRequest) -> Job:
        prompt = _one_prompt(body.prompt)
        stop = body.stop_strings()
        if body.echo and body.logprobs is not None:
            # OpenAI's echo then gives the prompt's tokens logprobs too, which no engine here computes.
            raise ApiError(400, "echo with logprobs is not supported", param="echo")
        if tokenizer is None:
            if not isinstance(prompt, str):
                raise ApiError(400, "prompt: token ids are not supported by this model's backend", param="prompt")
            if not prompt:
                raise ApiError(400, "prompt is empty", param="prompt")
            # logprobs passed on, so that an engine without them answers 400 instead of dropping them;
            # the engine counts the prompt and checks it against the context.
            return Job(sampling(body, 0, body.max_tokens, body.logprobs, "prompt"), prompt_text=prompt, stop=stop)
        if isinstance(prompt, str):
            if not prompt:
                raise ApiError(400, "prompt is empty", param="prompt")
            try:
                ids = await asyncio.to_thread(tokenizer.encode, prompt)
            except ValueError as exc:  # not Unicode text (a lone surrogate)
                raise ApiError(400, f"prompt: {exc}", param="prompt") from None
        else:
            ids = encode_ids(prompt, "prompt")
        return Job(sampling(body, len(ids), body.max_tokens, body.logprobs, "prompt"), prompt_ids=ids, stop=stop,
                   prompt_text=prompt if isinstance(prompt, str) else None)

    async def chat_job(body: ChatRequest) -> tuple[Job, bool]:
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        tools = [t.model_dump() for t in body.tools] if body.tools else None
        choice = body.tool_choice
        if tools is None and choice not in (None, "none", "auto"):
            raise ApiError(400, "tool_choice needs tools", param="tool_choice")
        use_tools = tools is not None and choice != "none"
        stop = body.stop_strings()
        if tokenizer is None:
            if use_tools:
                raise ApiError(400, "tools are not supported by this model's backend", param="tools")
            if body.response_format is not None and body.response_format.type != "text":
                need("constraint", "response_format")
            # logprobs passed on: an engine without them answers 400 rather than leave them out.
            return Job(sampling(body, 0, max_tokens, logprobs, "messages"), messages=_plain_messages(body.messages),
                       stop=stop), False
        from pymlxc.backends.metal.chat_template import ChatTemplateError, render_chat

        messages = [m.to_template() for m in body.messages]

        template_args: dict[str, Any] = {"tools": tools} if use_tools else {}
        try:
            text = await asyncio.to_thread(render_chat, messages, tokenizer, True, **template_args)
        except (ChatTemplateError, TypeError, ValueError) as exc:
            raise ApiError(400, f"messages: {exc}", param="messages") from None
        try:
            ids = await asyncio.to_thread(tokenizer.encode, text, False)
        except ValueError as exc:  # not Unicode text (a lone surrogate in a message)
            raise ApiError(400, f"messages: {exc}", param="messages") from None
        if not ids:
            raise ApiError(400, "messages render to no tokens", param="messages")
        params = sampling(body, len(ids), max_tokens, logprobs, "messages")
        constraint = None
        fmt = body.response_format
        # The constraint comes from a forced tool call or else from response_format: its error names that field
        # (with tools on `auto`, the grammar is response_format's, not the tools').
        forced = use_tools and (choice == "required" or isinstance(choice, NamedToolChoice))
        try:
            if tools is not None and forced:
                chosen = tools
                if isinstance(choice, NamedToolChoice):
                    chosen = [t for t in tools if t["function"]["name"] == choice.function.name]
                    if not chosen:
                        raise ApiError(400, f"tool_choice names {choice.function.name!r}, not among the tools",
                                       param="tool_choice")
                constraint = await asyncio.to_thread(_grammar().lark, toolcalls.forced_call_grammar(chosen, tool_fmt))
            elif fmt is not None and fmt.type == "json_object":
                constraint = await asyncio.to_thread(_grammar().json_schema, {"type": "object"})
            elif fmt is not None and fmt.type == "json_schema":
                if fmt.json_schema is None:
                    raise ApiError(400, "response_format.json_schema is required for type json_schema",
                                   param="response_format.json_schema")
                constraint = await asyncio.to_thread(_grammar().json_schema, fmt.json_schema.schema_)
        except ConstraintError as exc:
            raise ApiError(400, str(exc), param="tools" if forced else "response_format") from None
        return Job(params, prompt_ids=ids, stop=stop, constraint=constraint), use_tools

    def _grammar() -> GrammarFactory:
        if grammars is None:
            raise ConstraintError("constrained output needs the model's Hugging Face tokenizer")
        return grammars

    # ------------------------------------------------------------------ running a job
    def token_text(token: int) -> str:
        return tokenizer.decode([token]) if tokenizer is not None else ""

    def token_texts(tokens: list[int]) -> str:
        return tokenizer.decode(tokens) if tokenizer is not None else ""

    # A tokenizer of another kind (an engine's own) has no byte alphabet to read: its token's text.
    token_bytes = getattr(tokenizer, "token_bytes", None)

    def byte_list(token: int) -> list[int]:
        return list(token_bytes(token)) if token_bytes is not None else list(token_text(token).encode())

    def chat_logprob(piece: Piece) -> dict[str, Any]:
        if piece.token is None:
            raise ValueError("a logprob entry needs the piece's token")
        return {"token": token_text(piece.token), "logprob": _logprob(piece.logprob), "bytes": byte_list(piece.token),
                "top_logprobs": [{"token": token_text(t), "logprob": _logprob(lp), "bytes": byte_list(t)}
                                 for t, lp in piece.top_logprobs]}

    def completion_logprobs(tokens: list[Piece], offset: int) -> dict[str, list[Any]]:
        """The legacy completions' logprobs of `tokens` (pieces with a token), whose text starts
        `offset` characters into the completion's."""
        lp: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for piece in tokens:
            assert piece.token is not None
            text = token_text(piece.token)
            lp["tokens"].append(text)
            lp["token_logprobs"].append(_logprob(piece.logprob))
            lp["top_logprobs"].append({token_text(t): _logprob(v) for t, v in piece.top_logprobs})
            lp["text_offset"].append(offset)
            offset += len(text)
        return lp

    async def pieces(job: Job, request: Request) -> AsyncGenerator[Piece, None]:
        try:
            async with contextlib.aclosing(engine.stream(job)) as stream:
                async for piece in stream:
                    yield piece
        except QueueFull as exc:
            raise ApiError(429, str(exc), "rate_limit_error", code="queue_full") from None
        except BadRequest as exc:
            raise ApiError(400, str(exc), param=exc.param, code=exc.code) from None

    async def first_then(stream: AsyncGenerator[Piece, None]) -> tuple[Piece | None, AsyncGenerator[Piece, None]]:
        """Start the stream before the response does, so that a full queue is a 429, not a broken stream."""
        try:
            first = await stream.__anext__()
        except StopAsyncIteration:
            return None, stream
        return first, stream

    def usage(prompt: int, completion: int) -> dict[str, int]:
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def prompt_len(job: Job) -> int:
        if job.prompt_ids is not None:
            return len(job.prompt_ids)
        return job.prompt_tokens or 0  # counted by a slot engine as it started

    @app.post("/v1/completions", dependencies=[Depends(authorize)])
    async def completions(body: CompletionRequest, request: Request) -> Any:
        job = await completion_job(body)
        rid, now = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        first, stream = await _race(first_then(pieces(job, request)), request, lifecycle)
        echoed = ""  # OpenAI's echo: the prompt, then the completion, as one text
        if body.echo:
            echoed = job.prompt_text if job.prompt_text is not None else token_texts(job.prompt_ids or [])

        def chunk(text: str, finish: str | None, piece: Piece | None, offset: int = 0) -> dict[str, Any]:
            choice: dict[str, Any] = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
            if job.params.logprobs is not None and piece is not None and piece.token is not None:
                choice["logprobs"] = completion_logprobs([piece], offset)
            return {"id": rid, "object": "text_completion", "created": now, "model": config.model_id,
                    "choices": [choice]}

        if body.stream:
            async def events() -> AsyncGenerator[str, None]:
                count, finish = 0, "length"
                offset = 0  # of the next token's text in the completion's, as the whole answer counts it
                if echoed:
                    yield json.dumps(chunk(echoed, None, None))
                try:
                    async with contextlib.aclosing(_until_stopped(_chain(first, stream), lifecycle)) as chained:
                        async for piece in chained:
                            count += piece.token is not None
                            finish = piece.finish or finish
                            if piece.text or piece.token is not None:
                                yield json.dumps(chunk(piece.text, None, piece, offset))
                            if piece.token is not None:
                                offset += len(token_text(piece.token))
                except Exception as exc:  # noqa: BLE001 - the stream has started: its last event says it
                    yield _stream_error(exc)
                    return
                yield json.dumps(chunk("", finish, None))
                if body.stream_options is not None and body.stream_options.include_usage:
                    yield json.dumps({"id": rid, "object": "text_completion", "created": now, "model": config.model_id,
                                      "choices": [], "usage": usage(prompt_len(job), count)})
                yield "[DONE]"
            return _events(events())
        text, finish, tokens = await _race(_whole(first, stream), request, lifecycle)
        lp = completion_logprobs([piece for _, piece in tokens], 0) if job.params.logprobs is not None else None
        return {"id": rid, "object": "text_completion", "created": now, "model": config.model_id,
                "choices": [{"index": 0, "text": echoed + text, "finish_reason": finish, "logprobs": lp}],
                "usage": usage(prompt_len(job), len(tokens))}

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
    async def chat_completions(body: ChatRequest, request: Request) -> Any:
        job, use_tools = await chat_job(body)
        rid, now = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        first, stream = await _race(first_then(pieces(job, request)), request, lifecycle)
        want_lp = job.params.logprobs is not None

        def chunk(delta: dict[str, Any], finish: str | None, logprobs: list[dict[str, Any]] | None = None) -> str:
            return json.dumps({"id": rid, "object": "chat.completion.chunk", "created": now, "model": config.model_id,
                               "choices": [{"index": 0, "delta": delta, "finish_reason": finish,
                                            "logprobs": {"content": logprobs} if logprobs is not None else None}]})

        if body.stream:
            async def events() -> AsyncGenerator[str, None]:
                count, finish = 0, "length"
                content = toolcalls.StreamedContent(tool_fmt if use_tools else None)
                # The logprobs of tokens not sent yet: with the next chunk, as a whole answer has them.
                held_lps: list[dict[str, Any]] = []
                yield chunk({"role": "assistant", "content": ""}, None)
                try:
                    async with contextlib.aclosing(_until_stopped(_chain(first, stream), lifecycle)) as chained:
                        async for piece in chained:
                            count += piece.token is not None
                            finish = piece.finish or finish
                            if want_lp and piece.token is not None:
                                held_lps.append(chat_logprob(piece))
                            text = content.add(piece.text)
                            if text or (held_lps and not use_tools):
                                yield chunk({"content": text}, None, held_lps or None)
                                held_lps = []
                except Exception as exc:  # noqa: BLE001 - the stream has started: its last event says it
                    yield _stream_error(exc)
                    return
                tail, calls = content.finish()
                if calls:
                    finish = "tool_calls"
                    if tail:
                        yield chunk({"content": tail}, None)
                    yield chunk({"tool_calls": [c.to_openai(i) for i, c in enumerate(calls)]}, None,
                                held_lps or None)
                elif tail or held_lps:
                    yield chunk({"content": tail}, None, held_lps or None)
                yield chunk({}, finish)
                if body.stream_options is not None and body.stream_options.include_usage:
                    yield json.dumps({"id": rid, "object": "chat.completion.chunk", "created": now,
                                      "model": config.model_id, "choices": [], "usage": usage(prompt_len(job), count)})
                yield "[DONE]"
            return _events(events())
        content, finish, tokens = await _race(_whole(first, stream), request, lifecycle)
        lps = [chat_logprob(piece) for _, piece in tokens] if want_lp else []
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if use_tools:
            rest, calls = toolcalls.parse_tool_calls(content, tool_fmt)
            if calls:
                message = {"role": "assistant", "content": rest or None,
                           "tool_calls": [c.to_openai() for c in calls]}
                finish = "tool_calls"
        return {"id": rid, "object": "chat.completion", "created": now, "model": config.model_id,
                "choices": [{"index": 0, "message": message, "finish_reason": finish,
                             "logprobs": {"content": lps} if want_lp else None}],
                "usage": usage(prompt_len(job), len(tokens))}

    app.add_middleware(BodyLimit, limit=config.max_body_bytes)
    if config.cors_origins:
        from starlette.middleware.cors import CORSMiddleware

        # Any request header: OpenAI's SDKs send their own (`x-stainless-*`), and a preflight that
        # refused one would block every browser call. Added last, CORS is the outermost layer, so
        # that a 413 from BodyLimit carries its headers too (else the browser hides the error).
        app.add_middleware(CORSMiddleware, allow_origins=list(config.cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["*"])
    return app


def _events(events: AsyncGenerator[str, None]) -> EventSourceResponse:
    """A server-sent event stream. When uvicorn stops, sse-starlette would cut it at once: it sets
    its event and waits while the stream ends itself (with its error event, SHUTDOWN_GRACE_S on)."""
    return EventSourceResponse(events, ping=15, shutdown_event=anyio.Event(),
                               shutdown_grace_period=SHUTDOWN_GRACE_S + 1.0)


# OpenAI's log-probability of a token it deems impossible: JSON has no -Infinity (a stream's event
# would not parse, a whole answer's would say null), and a constraint's masked tokens have it.
IMPOSSIBLE_LOGPROB = -9999.0


def _logprob(value: float | None) -> float | None:
    return value if value is None or math.isfinite(value) else IMPOSSIBLE_LOGPROB


def _nucleus(top_p: float, top_k: int) -> tuple[float, int]:
    """OpenAI's top_p (and top_k) as the library's: top_p 1 keeps every token, the library's off
    (0); top_p 0 keeps the smallest nucleus, the top token alone, which the library's top_k 1 keeps
    (its top_p 0 would be off: sampling from the whole vocabulary)."""
    if top_p >= 1.0:
        return 0.0, top_k
    if top_p == 0.0:
        return 0.0, 1
    return top_p, top_k


def _logit_bias(given: dict[str, float], vocab: int) -> tuple[tuple[int, float], ...]:
    """`logit_bias` as (token id, amount) pairs: keys are decimal token ids (not "1_0" or " 10",
    which int() reads), amounts finite numbers in [-100, 100]."""
    bias: list[tuple[int, float]] = []
    seen: dict[int, str] = {}
    for key, amount in given.items():
        if not (key.isascii() and key.isdigit()) or len(key) > 12:
            raise ApiError(400, f"logit_bias keys must be token ids in decimal, not {key[:40]!r}", param="logit_bias")
        if not -100.0 <= amount <= 100.0:  # NaN fails this too
            raise ApiError(400, f"logit_bias[{key}] must be in [-100, 100], not {amount}", param="logit_bias")
        try:  # the sampler's own check (a subnormal amount), here where the key can be named
            amount = checked_real(f"logit_bias[{key}]", amount)
        except ValueError as exc:
            raise ApiError(400, str(exc), param="logit_bias") from None
        if int(key) >= vocab:
            raise ApiError(400, f"logit_bias names token id {key}, outside the vocabulary of {vocab}",
                           param="logit_bias")
        token = int(key)
        if token in seen:
            # "65" and "065" are one token: two amounts for it would leave one of them silently unapplied.
            raise ApiError(400, f"logit_bias names token id {token} twice ({seen[token]!r} and {key!r})",
                           param="logit_bias")
        seen[token] = key
        bias.append((token, float(amount)))
    return tuple(bias)


def _plain_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as a slot engine's model takes them: as the chat template reads them
    (`ChatMessage.to_template`), `name`, `tool_call_id` and an assistant's `tool_calls` included,
    which the mlx_lm worker hands its template (protocol 4)."""
    return [message.to_template() for message in messages]


def _one_prompt(prompt: str | list[int] | list[str]) -> str | list[int]:
    """A completion request's prompt: a string, token ids, or a list of one string."""
    if isinstance(prompt, str):
        return prompt
    ids = [t for t in prompt if isinstance(t, int)]
    if len(ids) == len(prompt):
        return ids
    if len(prompt) != 1:
        raise ApiError(400, "prompt: one prompt per request", param="prompt")
    return str(prompt[0])


async def _whole(first: Piece | None, rest: AsyncGenerator[Piece, None]) -> tuple[str, str, list[tuple[int, Piece]]]:
    """A non-streamed answer: its text, its finish reason ("length" where no piece gave one) and
    each generated token with its piece (for the usage count and the logprobs)."""
    texts, finish, tokens = [], "length", []
    async with contextlib.aclosing(_chain(first, rest)) as chained:
        async for piece in chained:
            texts.append(piece.text)
            finish = piece.finish or finish
            if piece.token is not None:
                tokens.append((piece.token, piece))
    return "".join(texts), finish, tokens


async def _chain(first: Piece | None, rest: AsyncGenerator[Piece, None]) -> AsyncGenerator[Piece, None]:
    """`first`, then the rest; closing this closes `rest` (its generation is cancelled)."""
    try:
        if first is not None:
            yield first
            if first.finish is not None:
                return
        async for piece in rest:
            yield piece
            if piece.finish is not None:
                return
    finally:
        await rest.aclose()


Handler = Callable[[Request], Awaitable[Any]]

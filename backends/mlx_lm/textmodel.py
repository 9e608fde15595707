"""`MlxLmModel`: the `TextModel` protocol, answered by mlx-lm in worker processes.

Each of `parallel_slots` workers holds the model; a call takes a free one for its whole duration, so
concurrent callers are serialised per worker. A worker that dies or stalls is killed and its call
fails with the reason (and the worker's last stderr lines); the next call on that slot starts a
fresh worker and loads the model again.

Errors follow pymlxc.model's TextModel rules: invalid arguments raise at once; a stop during a
stream (cancellation, the timeout, close() meanwhile: ModelClosedError) ends the iterator quietly,
and any other failure (the worker dying or stalling, an error reply) is raised from it; both are kept
in the calling thread's `err()`, which each of its calls resets.

A cancel or timeout ends the call within about CANCEL_WAIT_S even when the worker does not answer
its `cancel`: the worker then finishes (or, hung, is killed after CANCEL_GRACE_S) in the background,
holding its slot until then.
"""
from __future__ import annotations

import atexit
import base64
import concurrent.futures
import contextlib
import itertools
import math
import queue
import threading
import time
import weakref
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from pymlxc.bridge import protocol as P
from pymlxc.model import (
    GenerationCancelled,
    ModelClosedError,
    check_context,
    check_decode_ids,
    check_flag,
    check_messages,
    check_text,
    detached_error,
)
from pymlxc.options import GenerateConfig, LoadConfig, check_stop_tokens, check_template_kwargs, make_config
from pymlxc.types import AttentionSnapshot, BatchResult, ClassifyResult, GenerateMetrics, Message, ModelInfo, Token

from .errors import WorkerContextLengthError, WorkerError, WorkerReplyError, reply_error
from .process import WorkerProcess

POLL_S = 0.05  # how often a waiting call looks at its cancel event and deadline
CANCEL_WAIT_S = 1.0  # how long a stopped call waits for its worker's last line before it returns
CANCEL_GRACE_S = 10.0  # a worker that has not finished this long after `cancel` is taken as hung and killed
CLOSE_GRACE_S = 2.0


def _sampling(config: GenerateConfig) -> dict[str, Any]:
    """The protocol's sampling fields, from a GenerateConfig (timeout and cancel stay on this side).
    A value JSON cannot carry raises ValueError naming the option, at the call, before any worker."""
    fields = {
        "max_tokens": config.max_tokens,
        "temperature": config.temperature,
        "top_k": config.top_k,
        "top_p": config.top_p,
        "min_p": config.min_p,
        "repeat_penalty": config.repeat_penalty,
        "stop_tokens": list(config.stop_tokens),
        "seed": config.seed,
        "return_logits": config.return_logits,
    }
    for name, value in fields.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number, not {value}")
    return fields


def _metrics(reply: Mapping[str, Any]) -> GenerateMetrics:
    return GenerateMetrics(
        prompt_tokens=int(reply.get("prompt_tokens", 0)),
        generated_tokens=int(reply.get("generation_tokens", 0)),
        prefill_duration=float(reply.get("prompt_time", 0.0)),
        decode_duration=float(reply.get("generation_time", 0.0)),
        total_duration=float(reply.get("total_time", 0.0)),
        prefill_tokens_per_sec=float(reply.get("prompt_tps", 0.0)),
        decode_tokens_per_sec=float(reply.get("generation_tps", 0.0)),
        peak_memory_bytes=int(reply.get("peak_memory_bytes", 0)),
        active_memory_bytes=int(reply.get("active_memory_bytes", 0)),
    )


def _check_json_values(values: Mapping[str, Any], what: str) -> None:
    """Each of `values` as the worker will receive it (JSON): else TypeError or ValueError naming it."""
    for key, value in values.items():
        try:
            P.encode({key: value})
        except (TypeError, ValueError) as e:
            raise type(e)(f"{what}[{key!r}] cannot be sent to the worker as JSON: {e}") from None
        except RecursionError:
            raise ValueError(f"{what}[{key!r}] cannot be sent to the worker as JSON: nested too deeply") from None


def _prompt(prompt: str, what: str = "prompt") -> str:
    if not isinstance(prompt, str):
        raise TypeError(f"{what} must be a string, not {type(prompt).__name__}")
    if not prompt:
        raise ValueError(f"{what} is empty")
    check_text(prompt, what)  # here, as on the metal backend: the worker's tokenizer would fail on it
    return prompt


def _prompts(values: Sequence[str]) -> list[str]:
    """A non-empty list of non-empty prompts (as the metal backend takes them)."""
    if isinstance(values, str) or not isinstance(values, Sequence):
        raise TypeError(f"prompts must be a sequence of strings, not {type(values).__name__}")
    if not values:
        raise ValueError("no prompts given")
    return [_prompt(v, f"prompts item {i}") for i, v in enumerate(values)]


def _heads(encoded: str, heads: int, seq_len: int, head_dim: int) -> list[np.ndarray]:
    values = np.frombuffer(base64.b64decode(encoded), dtype="<f4").astype(np.float32)
    if values.size != heads * seq_len * head_dim:
        raise WorkerError(f"inspect_attention: {values.size} values for {heads} x {seq_len} x {head_dim}")
    return list(values.reshape(heads, seq_len, head_dim))


def _snapshot(reply: Mapping[str, Any]) -> AttentionSnapshot:
    """The worker's inspect_attention reply (base64 float32 arrays per layer) as numpy arrays."""
    if reply.get("encoding") != "base64-float32-le":
        raise WorkerError(f"inspect_attention: unknown array encoding {reply.get('encoding')!r}")
    seq_len, layers = int(reply["seq_len"]), reply["layers"]
    keys = [_heads(layer["keys"], layer["kv_heads"], seq_len, layer["head_dim"]) for layer in layers]
    queries = None
    if layers and layers[0].get("queries") is not None:
        queries = [_heads(layer["queries"], layer["query_heads"], seq_len, layer["head_dim"]) for layer in layers]
    return AttentionSnapshot(
        architecture=str(reply["architecture"]),
        num_layers=int(reply["num_layers"]),
        num_kv_heads=int(reply["num_kv_heads"]),
        num_query_heads=int(reply["num_query_heads"]),
        seq_len=seq_len,
        head_dim=int(reply["head_dim"]),
        keys=keys,
        queries=queries,
        token_ids=tuple(int(t) for t in reply["token_ids"]),
    )


def _await_terminal(worker: WorkerProcess, rid: int, deadline: float) -> bool:
    """Read `worker`'s lines until the terminal one of request `rid` (True) or `deadline` (False)."""
    while time.monotonic() < deadline:
        line = worker.poll(min(POLL_S, max(0.0, deadline - time.monotonic())))
        if line is not None and line.get("id") == rid and line["type"] in P.TERMINAL_TYPES:
            return True
    return False


class _Slot:
    """One worker with the model loaded, started again on demand after it was discarded."""

    def __init__(self, start: Callable[[], tuple[WorkerProcess, dict[str, Any]]]) -> None:
        self._start = start
        self.worker: WorkerProcess | None = None

    def ensure(self) -> tuple[WorkerProcess, dict[str, Any] | None]:
        """The live worker, and the load reply if it had to be started."""
        if self.worker is not None and self.worker.alive():
            return self.worker, None
        self.discard()
        self.worker, loaded = self._start()
        return self.worker, loaded

    def discard(self) -> None:
        worker, self.worker = self.worker, None
        if worker is not None:
            worker.kill()

    def close(self) -> None:
        worker, self.worker = self.worker, None
        if worker is not None:
            worker.close(CLOSE_GRACE_S)


class _Stop:
    """Why a call should stop early, if it should: the model closed, its cancel event or its deadline."""

    def __init__(self, config: GenerateConfig, closed: Callable[[], bool]) -> None:
        self.cancel = config.cancel
        self.timeout = config.timeout
        self.deadline = None if config.timeout is None else time.monotonic() + config.timeout
        self.closed = closed

    def reason(self) -> GenerationCancelled | ModelClosedError | None:
        if self.closed():
            return ModelClosedError("the model was closed during the call")
        if self.cancel is not None and self.cancel.is_set():
            return GenerationCancelled("generation cancelled")
        if self.deadline is not None and time.monotonic() >= self.deadline:
            return GenerationCancelled(f"generation timed out after {self.timeout:g}s")
        return None


# The models not closed yet. They are closed at exit, while their workers' reader threads still run:
# left to __del__ during interpreter shutdown, closing a worker's pipes under those frozen daemon
# threads aborted the process.
_OPEN_MODELS: weakref.WeakSet[MlxLmModel] = weakref.WeakSet()


@atexit.register
def _close_open_models() -> None:
    for model in list(_OPEN_MODELS):
        with contextlib.suppress(Exception):
            model.close()


class MlxLmModel:
    """A model loaded by mlx-lm in `parallel_slots` worker processes (see the module docstring)."""

    def __init__(
        self,
        path: str,
        config: LoadConfig,
        *,
        python: str,
        response_timeout: float = 120.0,
        load_timeout: float = 600.0,
        startup_timeout: float = 60.0,
        worker_args: Sequence[str] = (),
    ) -> None:
        self.context_len = config.context_len  # what the worker bounds its KV caches to (bridge/engine.py)
        self._load = {
            "cmd": "load",
            "id": "load",
            "path": path,
            "adapter_path": config.adapter_path,
            "context_len": config.context_len,
            "device": "cpu" if config.gpu_layers == 0 else None,
        }
        self._python, self._worker_args = python, tuple(worker_args)
        self.response_timeout, self.load_timeout, self.startup_timeout = response_timeout, load_timeout, startup_timeout
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._errors: dict[int, BaseException | None] = {}  # err() per calling thread
        self._holders: dict[int, int] = {}  # slots held per thread, by its unfinished calls
        self._metrics = GenerateMetrics()
        self._closed = False
        self._slots = [_Slot(self._start_worker) for _ in range(config.parallel_slots)]
        self._free: queue.Queue[_Slot] = queue.Queue()
        _OPEN_MODELS.add(self)
        try:
            # Start the workers side by side: each spends seconds importing mlx-lm and loading.
            with concurrent.futures.ThreadPoolExecutor(len(self._slots)) as pool:
                loaded = list(pool.map(lambda slot: slot.ensure()[1], self._slots))
        except BaseException:
            self.close()
            raise
        first = loaded[0]
        assert first is not None  # a slot started just now reports its load reply
        self._model_type = str(first.get("model_type", "unknown"))
        self._info = ModelInfo(**first["info"])
        self.eos_token_ids: tuple[int, ...] = tuple(first.get("eos_token_ids", ()))
        # The protocol version the workers announced (all run the same bridge): commands newer than it are refused here.
        self.protocol = min(slot.worker.protocol for slot in self._slots if slot.worker is not None)
        # The longest request line the workers read (all run with the same arguments); None: not announced.
        limits = [s.worker.max_line_bytes for s in self._slots if s.worker is not None]
        self._max_line_bytes: int | None = None if None in limits else min(x for x in limits if x is not None)
        for slot in self._slots:
            self._free.put(slot)

    def _start_worker(self) -> tuple[WorkerProcess, dict[str, Any]]:
        worker = WorkerProcess(self._python, startup_timeout=self.startup_timeout, extra_args=self._worker_args)
        try:
            worker.send(self._load, doing="loading the model")
            reply = worker.receive(self.load_timeout, doing="loading the model")
            if reply.get("type") == "error":
                raise reply_error(str(reply.get("error")), str(reply.get("message")))
            return worker, reply
        except BaseException:
            worker.kill()
            raise

    # ---- state --------------------------------------------------------------------------------------

    @property
    def model_type(self) -> str:
        return self._model_type

    def info(self) -> ModelInfo:
        return self._info

    def metrics(self) -> GenerateMetrics:
        with self._lock:
            return GenerateMetrics(**self._metrics.to_dict())

    def err(self) -> BaseException | None:
        """Why this thread's last call failed or stopped early; None if it finished."""
        with self._lock:
            return self._errors.get(threading.get_ident())

    def _set_err(self, e: BaseException | None) -> None:
        # A copy without traceback (TextModel's rule): `e` itself is often raised afterwards, and its
        # frames would then stay alive in err() until this thread's next call.
        kept = None if e is None else detached_error(e)
        with self._lock:
            self._errors[threading.get_ident()] = kept

    def _fail(self, e: BaseException) -> BaseException:
        """Keep why the call failed in err() and return it; a failure caused by close() (the worker
        quit or was killed under the call) is a ModelClosedError, whatever the worker showed."""
        if self._closed and not isinstance(e, ModelClosedError):
            closed = ModelClosedError(f"the model was closed during the call ({type(e).__name__}: {e})")
            closed.__cause__ = e
            e = closed
        self._set_err(e)
        return e

    def _set_metrics(self, reply: Mapping[str, Any]) -> None:
        with self._lock:
            self._metrics = _metrics(reply)

    def _begin(self, config: Mapping[str, Any] | None = None) -> GenerateConfig:
        """Start a call, as the metal backend does: refuse a closed model, check the options (the
        one GenerateConfig both backends validate with, before anything reaches a worker), reset err()."""
        if self._closed:
            raise ModelClosedError("the model is closed")
        cfg: GenerateConfig = make_config(GenerateConfig, **(config or {}))
        check_stop_tokens(cfg.stop_tokens, self._info.vocab_size)
        self._set_err(None)
        return cfg

    def worker_pids(self) -> list[int]:
        """The pids of the live workers (for tests and diagnostics)."""
        return [s.worker.pid for s in self._slots if s.worker is not None and s.worker.alive()]

    # ---- one request on one worker ------------------------------------------------------------------

    def _acquire(self, stop: _Stop) -> _Slot:
        me = threading.get_ident()
        while True:
            if self._closed:
                raise ModelClosedError("the model is closed")
            reason = stop.reason()
            if reason is not None:
                raise reason
            try:
                slot = self._free.get(timeout=POLL_S)
            except queue.Empty:
                with self._lock:
                    if self._holders.get(me, 0) >= len(self._slots):
                        # Only this thread could free a slot, and it is waiting here: it would wait forever.
                        raise RuntimeError(
                            f"all {len(self._slots)} parallel_slots are held by this thread's unfinished "
                            "streams; finish or close them before another call"
                        ) from None
                continue
            with self._lock:
                self._holders[me] = self._holders.get(me, 0) + 1
            return slot

    def _unhold(self, thread: int) -> None:
        with self._lock:
            left = self._holders.get(thread, 0) - 1
            if left > 0:
                self._holders[thread] = left
            else:
                self._holders.pop(thread, None)

    def _exchange(
        self, cmd: str, args: dict[str, Any], stop: _Stop, stopped: list[BaseException]
    ) -> Generator[dict[str, Any], None, None]:
        """Send one request on a free worker; yield its reply lines up to and including the terminal one.

        When the call must stop early, a `cancel` is sent, the reason is appended to `stopped`, and the
        lines that follow are still yielded (the caller decides what to keep) until the terminal one,
        or for at most CANCEL_WAIT_S: then the iterator ends without it and the worker is settled in
        the background (see `_release`).
        """
        rid = next(self._ids)
        try:
            # Checked before a worker is taken: nothing is sent half-made. The line as it will be sent.
            request = P.encode({"cmd": cmd, "id": rid, **args})
        except ValueError as e:  # e.g. a float JSON cannot carry (NaN) that slipped past the options' checks
            raise ValueError(f"{cmd}: the request cannot be sent as JSON: {e}") from None
        except TypeError as e:  # a value of no JSON type (an object, a set)
            raise TypeError(f"{cmd}: the request cannot be sent as JSON: {e}") from None
        # A line past the worker's limit is skipped unread and refused without our id: the call would
        # wait the whole response timeout and then kill a healthy worker.
        size = len(request) - 1  # the worker's limit does not count the newline
        if self._max_line_bytes is not None and size > self._max_line_bytes:
            raise ValueError(
                f"{cmd}: the request is {size} bytes as a JSON line, more than the worker's limit of "
                f"{self._max_line_bytes} (its --max-line-bytes)"
            )
        slot = self._acquire(stop)
        holder = threading.get_ident()  # a generator may be resumed on another thread: unhold this one
        finished = False
        cancelled_at: float | None = None
        try:
            worker, _ = slot.ensure()
            worker.send({"cmd": cmd, "id": rid, **args}, doing=cmd)
            heard = time.monotonic()
            while True:
                if cancelled_at is None and (reason := stop.reason()) is not None:
                    stopped.append(reason)
                    worker.send({"cmd": "cancel", "id": f"cancel-{rid}"}, doing=cmd)
                    cancelled_at = time.monotonic()
                line = worker.poll(POLL_S, doing=cmd)
                now = time.monotonic()
                if line is None:
                    if cancelled_at is not None and now - cancelled_at > CANCEL_WAIT_S:
                        return  # the caller has its reason in `stopped`; the worker is settled in finally
                    if now - heard > self.response_timeout:
                        raise worker.stalled(self.response_timeout, cmd)
                    continue
                heard = now
                if line.get("id") != rid:
                    continue  # the acknowledgement of our own cancel
                finished = line["type"] in P.TERMINAL_TYPES
                yield line
                if finished:
                    return
        except WorkerError:
            slot.discard()
            raise
        finally:
            self._unhold(holder)
            if finished or slot.worker is None:
                self._free.put(slot)
            else:
                self._release(slot, rid, cancelled_at)

    def _release(self, slot: _Slot, rid: int, cancelled_at: float | None) -> None:
        """Free `slot` once its request `rid`, left unfinished by its caller, has ended: cancel it (if
        not yet) and wait up to CANCEL_WAIT_S for its terminal line; past that, a background thread
        waits up to CANCEL_GRACE_S after the cancel, kills a worker that is still silent, and only
        then frees the slot, so that the caller returns at once and no later call meets stale lines."""
        worker = slot.worker
        try:
            if worker is None or not worker.alive():
                slot.discard()
            else:
                if cancelled_at is None:
                    worker.send({"cmd": "cancel", "id": f"cancel-{rid}"})
                    cancelled_at = time.monotonic()
                if not _await_terminal(worker, rid, cancelled_at + CANCEL_WAIT_S):
                    threading.Thread(target=self._settle, args=(slot, worker, rid, cancelled_at),
                                     daemon=True, name="mlx_lm-settle").start()
                    return
        except WorkerError:
            slot.discard()
        self._free.put(slot)

    def _settle(self, slot: _Slot, worker: WorkerProcess, rid: int, cancelled_at: float) -> None:
        try:
            if not _await_terminal(worker, rid, cancelled_at + CANCEL_GRACE_S):
                worker.stalled(CANCEL_GRACE_S, "cancelling")  # kills it; the next call starts a fresh one
                slot.discard()
        except WorkerError:
            slot.discard()
        finally:
            self._free.put(slot)

    def _call(
        self, cmd: str, args: dict[str, Any], config: GenerateConfig
    ) -> tuple[dict[str, Any], BaseException | None]:
        """A request with a single reply (or a generation of no tokens, whose `done` line is its
        reply): the reply, and why it stopped early if it did. Errors raise (and are kept in
        err()), a stop that got no reply in time included."""
        stopped: list[BaseException] = []
        try:
            for line in self._exchange(cmd, args, _Stop(config, self._is_closed), stopped):
                if line["type"] == "error":
                    if line.get("error") == "cancelled" and stopped:
                        raise stopped[0]
                    # A chat of no tokens (prompt_length) only renders: its failure is the template's.
                    raise reply_error(str(line.get("error")), str(line.get("message")), cmd,
                                      rendering_only=config.max_tokens == 0, reply=line)
                if line["type"] in ("result", "done"):  # done: a generation asked for no tokens
                    return line, (stopped[0] if stopped else None)
            if stopped:
                raise stopped[0]
            raise WorkerError(f"the worker ended {cmd} without a result")
        except (WorkerError, WorkerReplyError, GenerationCancelled, ModelClosedError) as e:
            raise self._fail(e)  # noqa: B904 - _fail sets __cause__ when it wraps e

    def _is_closed(self) -> bool:
        return self._closed

    def _messages(self, messages: Sequence[Message | Mapping[str, Any]]) -> list[dict[str, Any]]:
        """`messages` checked as on the metal backend (`check_messages`), as the worker takes them."""
        checked = check_messages(messages)
        if self.protocol < 4 and any(set(m) - {"role", "content"} for m in checked):
            # Such a worker refuses any other key ("has unknown key(s)"), which the metal backend passes on.
            raise WorkerError(f"the worker speaks protocol {self.protocol}; a message's keys other than role and "
                              "content need protocol 4")
        return checked

    # ---- TextModel ----------------------------------------------------------------------------------

    def generate(self, prompt: str, **config: Any) -> Iterator[Token]:
        """Stream the tokens that follow `prompt`. After the stream ends, `err()` says whether it failed."""
        cfg = self._begin(config)
        return self._stream("generate", {"prompt": _prompt(prompt), **_sampling(cfg)}, cfg)

    def chat(self, messages: Sequence[Message | Mapping[str, Any]], *,
             chat_template_kwargs: Mapping[str, Any] | None = None, **config: Any) -> Iterator[Token]:
        """Stream the assistant's reply to `messages`, formatted by the model's chat template;
        `chat_template_kwargs` reach the template as variables (e.g. enable_thinking=False)."""
        cfg = self._begin(config)
        args: dict[str, Any] = {"messages": self._messages(messages), **_sampling(cfg)}
        template_kwargs = check_template_kwargs(chat_template_kwargs)
        _check_json_values(template_kwargs, "chat_template_kwargs")
        if template_kwargs:
            args["chat_template_kwargs"] = template_kwargs
        return self._stream("chat", args, cfg)

    def _stream(self, cmd: str, args: dict[str, Any], config: GenerateConfig) -> Iterator[Token]:
        """Tokens as their lines arrive (the worker sends each as it is sampled). A stop (cancel,
        timeout, close) ends the iterator quietly; any other failure (the worker dying or stalling,
        an error reply) is raised from it. Both are kept in err(), as pymlxc.model says."""
        stopped: list[BaseException] = []
        lines = self._exchange(cmd, args, _Stop(config, self._is_closed), stopped)
        ended = False
        try:
            for line in lines:
                kind = line["type"]
                if kind == "token" and not stopped:
                    yield Token(int(line["token_id"]), str(line["token"]))
                elif kind == "done":
                    ended = True
                    self._set_metrics(line)
                    if line.get("finish_reason") == "cancelled":
                        self._fail(
                            stopped[0] if stopped else GenerationCancelled("the worker cancelled the generation")
                        )
                elif kind == "error":
                    ended = True
                    raise reply_error(str(line.get("error")), str(line.get("message")), cmd, reply=line)
            if not ended and stopped:  # the worker did not answer the cancel in time
                self._fail(stopped[0])
        except (GenerationCancelled, ModelClosedError) as e:
            self._fail(e)
        except (WorkerError, WorkerReplyError) as e:
            failure = self._fail(e)
            if not isinstance(failure, ModelClosedError):  # close() under the call is a stop, not a failure
                raise failure from None
        finally:
            lines.close()  # if our consumer stopped early: cancel the request and free the worker now

    def classify(self, prompts: Sequence[str], **config: Any) -> list[ClassifyResult]:
        """The token sampled after each prompt (one batched prefill). With `return_logits`, each
        result's `logits` are the raw logits it was sampled from (after repeat_penalty, before
        temperature; not log-probabilities), as the metal backend returns them."""
        cfg = self._begin(config)
        items = _prompts(prompts)
        if cfg.return_logits and self.protocol < 3:
            # Older workers send log-probabilities, which would pass for logits silently.
            raise WorkerError(f"the worker speaks protocol {self.protocol}; classify logits need protocol 3")
        reply, _ = self._call("classify", {"prompts": items, **_sampling(cfg)}, cfg)
        self._set_metrics(reply)
        return [
            ClassifyResult(Token(int(r["token_id"]), str(r["token"])), r.get("logits"))
            for r in reply["results"]
        ]

    def batch_generate(self, prompts: Sequence[str], **config: Any) -> list[BatchResult]:
        """Generate for all prompts at once. Cancelled or timed out: the tokens so far (none when the
        worker did not answer the cancel in time), each with the reason, and `err()` set."""
        cfg = self._begin(config)
        items = _prompts(prompts)
        try:
            reply, stopped = self._call("batch_generate", {"prompts": items, **_sampling(cfg)}, cfg)
        except (GenerationCancelled, ModelClosedError) as e:
            return [BatchResult([], f"{type(e).__name__}: {e}") for _ in items]
        self._set_metrics(reply)
        if stopped is not None:
            self._fail(stopped)
        return [
            BatchResult([Token(int(t["token_id"]), str(t["token"])) for t in r["tokens"]], r.get("error"))
            for r in reply["results"]
        ]

    # ---- extras -------------------------------------------------------------------------------------

    def inspect_attention(self, prompt: str | Sequence[int], include_queries: bool = False) -> AttentionSnapshot:
        """Keys (after RoPE) of every layer and KV head for `prompt` (text, encoded as `generate`
        encodes it, or token ids, at most `context_len` of them), and every head's queries when
        asked, computed by mlx-lm."""
        self._begin()  # first, as every call: a refusal below leaves no earlier call's error in err()
        args: dict[str, Any]
        if isinstance(prompt, str):
            # Checked as generate checks it: an empty prompt used to answer for the BOS token alone.
            args = {"prompt": _prompt(prompt)}
        else:
            if isinstance(prompt, (bytes, bytearray, Mapping)) or not isinstance(prompt, Iterable):
                raise TypeError(f"prompt must be a str or a sequence of token ids, not {type(prompt).__name__}")
            # Ints, not bools or floats; an id outside the vocabulary (a negative one too) is the
            # worker's check, a WorkerBadRequest: a ValueError, as on the metal backend.
            tokens = check_decode_ids(prompt)
            if not tokens:
                raise ValueError("prompt has no token ids")
            check_context(len(tokens), self.context_len)  # the worker's check, without sending the line
            args = {"tokens": tokens}
        check_flag("include_queries", include_queries)  # here, as on the metal backend, not the worker's bad_field
        if self.protocol < 2:
            raise WorkerError(f"the worker speaks protocol {self.protocol}; inspect_attention needs protocol 2")
        reply, _ = self._call("inspect_attention", {**args, "include_queries": include_queries}, GenerateConfig())
        return _snapshot(reply)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, by the model's tokenizer in the worker."""
        self._begin()
        if not isinstance(text, str):
            raise TypeError(f"text must be a string, not {type(text).__name__}")
        check_flag("add_special_tokens", add_special_tokens)
        check_text(text, "text")
        reply, _ = self._call("encode", {"text": text, "add_special_tokens": add_special_tokens}, GenerateConfig())
        return [int(t) for t in reply["tokens"]]

    def prompt_length(self, prompt: str | Sequence[Message | Mapping[str, Any]], *,
                      chat_template_kwargs: Mapping[str, Any] | None = None) -> int:
        """How many tokens the model reads for `prompt`: text as `generate` encodes it, or messages
        as `chat` renders them (what a server checks against its context before generating)."""
        cfg = self._begin({"max_tokens": 0})
        if not isinstance(prompt, Sequence) or isinstance(prompt, (bytes, Mapping)):
            raise TypeError(f"prompt must be a str or a sequence of messages, not {type(prompt).__name__}")
        args: dict[str, Any]
        if isinstance(prompt, str):
            cmd, args = "generate", {"prompt": _prompt(prompt)}
        else:
            cmd, args = "chat", {"messages": self._messages(prompt)}
            template_kwargs = check_template_kwargs(chat_template_kwargs)
            if template_kwargs:
                args["chat_template_kwargs"] = template_kwargs
        # A generation of no tokens: the worker encodes (or renders) the prompt as for a real one,
        # and its done line counts the tokens; a prompt past the context is counted by its refusal.
        try:
            reply, _ = self._call(cmd, {**args, **_sampling(cfg)}, cfg)
        except WorkerContextLengthError as e:
            self._set_err(None)  # counted: this call did what it was asked
            return e.prompt_tokens
        return int(reply["prompt_tokens"])

    def decode(self, tokens: Sequence[int]) -> str:
        self._begin()
        # int() would take 1.5, True or "7" as ids (and a str as its digits): refused by type instead.
        reply, _ = self._call("decode", {"tokens": check_decode_ids(tokens)}, GenerateConfig())
        return str(reply["text"])

    # ---- lifetime -----------------------------------------------------------------------------------

    def close(self) -> None:
        """Quit every worker (killing any that linger) and reap them. Idempotent."""
        self._closed = True
        _OPEN_MODELS.discard(self)
        for slot in self._slots:
            slot.close()

    def __enter__(self) -> MlxLmModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # a backstop only; close() is the way
        try:
            if not getattr(self, "_closed", True):
                self.close()
        except Exception:
            pass

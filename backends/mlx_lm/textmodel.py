"""`MlxLmModel`: the `TextModel` protocol, answered by mlx-lm in worker processes.

Each of `parallel_slots` workers holds the model; a call takes a free one for its whole duration, so
concurrent callers are serialised per worker. A worker that dies or stalls is killed and its call
fails with the reason (and the worker's last stderr lines); the next call on that slot starts a
fresh worker and loads the model again.

Errors follow pymlxc.model: invalid arguments raise at once; an error during a stream (the worker
dying, an error reply, cancellation, the timeout) ends the iterator quietly and is kept in `err()`,
which each new call resets. Check `err()` after a stream ends to tell a finish from a failure.
"""
from __future__ import annotations

import base64
import concurrent.futures
import itertools
import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from pymlxc.bridge import protocol as P
from pymlxc.model import GenerationCancelled, ModelClosedError
from pymlxc.options import GenerateConfig, LoadConfig, make_config
from pymlxc.types import AttentionSnapshot, BatchResult, ClassifyResult, GenerateMetrics, Message, ModelInfo, Token

from .errors import WorkerError, WorkerReplyError
from .process import WorkerProcess

POLL_S = 0.05  # how often a waiting call looks at its cancel event and deadline
CANCEL_GRACE_S = 10.0  # a worker that has not finished this long after `cancel` is taken as hung
CLOSE_GRACE_S = 2.0


def _sampling(config: GenerateConfig) -> dict[str, Any]:
    """The protocol's sampling fields, from a GenerateConfig (timeout and cancel stay on this side)."""
    return {
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


def _strings(values: Sequence[str], what: str) -> list[str]:
    if isinstance(values, str) or not isinstance(values, Sequence):
        raise TypeError(f"{what} must be a sequence of strings, not {type(values).__name__}")
    bad = [i for i, v in enumerate(values) if not isinstance(v, str)]
    if bad:
        raise TypeError(f"{what} must be strings; item {bad[0]} is {type(values[bad[0]]).__name__}")
    return list(values)


def _messages(messages: Sequence[Message | Mapping[str, str]]) -> list[dict[str, str]]:
    if isinstance(messages, (str, Mapping)) or not isinstance(messages, Sequence) or not messages:
        raise TypeError("messages must be a non-empty sequence of Message or {'role', 'content'} dicts")
    out = []
    for i, m in enumerate(messages):
        d = m.to_dict() if isinstance(m, Message) else m
        if not isinstance(d, Mapping) or set(d) != {"role", "content"}:
            raise TypeError(f"message {i} must be a Message or a dict with exactly 'role' and 'content'")
        if not isinstance(d["role"], str) or not isinstance(d["content"], str):
            raise TypeError(f"message {i}: role and content must be strings")
        out.append({"role": d["role"], "content": d["content"]})
    return out


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
    """Why a call should stop early, if it should: its cancel event or its deadline."""

    def __init__(self, config: GenerateConfig) -> None:
        self.cancel = config.cancel
        self.timeout = config.timeout
        self.deadline = None if config.timeout is None else time.monotonic() + config.timeout

    def reason(self) -> GenerationCancelled | None:
        if self.cancel is not None and self.cancel.is_set():
            return GenerationCancelled("generation cancelled")
        if self.deadline is not None and time.monotonic() >= self.deadline:
            return GenerationCancelled(f"generation timed out after {self.timeout:g}s")
        return None


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
        self._err: BaseException | None = None
        self._metrics = GenerateMetrics()
        self._closed = False
        self._slots = [_Slot(self._start_worker) for _ in range(config.parallel_slots)]
        self._free: queue.Queue[_Slot] = queue.Queue()
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
        for slot in self._slots:
            self._free.put(slot)

    def _start_worker(self) -> tuple[WorkerProcess, dict[str, Any]]:
        worker = WorkerProcess(self._python, startup_timeout=self.startup_timeout, extra_args=self._worker_args)
        try:
            worker.send(self._load, doing="loading the model")
            reply = worker.receive(self.load_timeout, doing="loading the model")
            if reply.get("type") == "error":
                raise WorkerReplyError(str(reply.get("error")), str(reply.get("message")))
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
        with self._lock:
            return self._err

    def _set_err(self, e: BaseException | None) -> None:
        with self._lock:
            self._err = e

    def _set_metrics(self, reply: Mapping[str, Any]) -> None:
        with self._lock:
            self._metrics = _metrics(reply)

    def _begin(self) -> None:
        if self._closed:
            raise ModelClosedError("the model is closed")
        self._set_err(None)

    def worker_pids(self) -> list[int]:
        """The pids of the live workers (for tests and diagnostics)."""
        return [s.worker.pid for s in self._slots if s.worker is not None and s.worker.alive()]

    # ---- one request on one worker ------------------------------------------------------------------

    def _acquire(self, stop: _Stop) -> _Slot:
        while True:
            if self._closed:
                raise ModelClosedError("the model is closed")
            reason = stop.reason()
            if reason is not None:
                raise reason
            try:
                return self._free.get(timeout=POLL_S)
            except queue.Empty:
                continue

    def _exchange(self, cmd: str, args: dict[str, Any], stop: _Stop, stopped: list[GenerationCancelled]) -> Iterator[dict[str, Any]]:
        """Send one request on a free worker; yield its reply lines up to and including the terminal one.

        When the call must stop early, a `cancel` is sent, the reason is appended to `stopped`, and the
        lines that follow are still yielded (the caller decides what to keep) until the terminal one.
        """
        slot = self._acquire(stop)
        rid = next(self._ids)
        finished = False
        try:
            worker, _ = slot.ensure()
            worker.send({"cmd": cmd, "id": rid, **args}, doing=cmd)
            heard = time.monotonic()
            cancelled_at: float | None = None
            while True:
                if cancelled_at is None and (reason := stop.reason()) is not None:
                    stopped.append(reason)
                    worker.send({"cmd": "cancel", "id": f"cancel-{rid}"}, doing=cmd)
                    cancelled_at = time.monotonic()
                line = worker.poll(POLL_S, doing=cmd)
                now = time.monotonic()
                if line is None:
                    if now - heard > self.response_timeout:
                        raise worker.stalled(self.response_timeout, cmd)
                    if cancelled_at is not None and now - cancelled_at > CANCEL_GRACE_S:
                        raise worker.stalled(CANCEL_GRACE_S, f"{cmd}, after cancel")
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
            if not finished:
                self._abandon(slot, rid)
            self._free.put(slot)

    def _abandon(self, slot: _Slot, rid: int) -> None:
        """The caller stopped reading mid-request: cancel it and read up to its end, or drop the worker."""
        worker = slot.worker
        if worker is None or not worker.alive():
            return
        try:
            worker.send({"cmd": "cancel", "id": f"cancel-{rid}"})
            deadline = time.monotonic() + CANCEL_GRACE_S
            while time.monotonic() < deadline:
                line = worker.poll(POLL_S)
                if line is not None and line.get("id") == rid and line["type"] in P.TERMINAL_TYPES:
                    return
            slot.discard()
        except WorkerError:
            slot.discard()

    def _call(self, cmd: str, args: dict[str, Any], config: GenerateConfig) -> tuple[dict[str, Any], GenerationCancelled | None]:
        """A request with a single reply: the reply, and why it stopped early if it did. Errors raise (and are kept)."""
        stopped: list[GenerationCancelled] = []
        try:
            for line in self._exchange(cmd, args, _Stop(config), stopped):
                if line["type"] == "error":
                    if line.get("error") == "cancelled" and stopped:
                        raise stopped[0]
                    raise WorkerReplyError(str(line.get("error")), str(line.get("message")))
                if line["type"] == "result":
                    return line, (stopped[0] if stopped else None)
            raise WorkerError(f"the worker ended {cmd} without a result")
        except (WorkerError, WorkerReplyError, GenerationCancelled) as e:
            self._set_err(e)
            raise

    # ---- TextModel ----------------------------------------------------------------------------------

    def generate(self, prompt: str, **config: Any) -> Iterator[Token]:
        """Stream the tokens that follow `prompt`. After the stream ends, `err()` says whether it failed."""
        cfg = make_config(GenerateConfig, **config)
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be a string, not {type(prompt).__name__}")
        self._begin()
        return self._stream("generate", {"prompt": prompt, **_sampling(cfg)}, cfg)

    def chat(self, messages: Sequence[Message | dict[str, str]], **config: Any) -> Iterator[Token]:
        """Stream the assistant's reply to `messages`, formatted by the model's chat template."""
        cfg = make_config(GenerateConfig, **config)
        msgs = _messages(messages)
        self._begin()
        return self._stream("chat", {"messages": msgs, **_sampling(cfg)}, cfg)

    def _stream(self, cmd: str, args: dict[str, Any], config: GenerateConfig) -> Iterator[Token]:
        stopped: list[GenerationCancelled] = []
        lines = self._exchange(cmd, args, _Stop(config), stopped)
        try:
            for line in lines:
                kind = line["type"]
                if kind == "token" and not stopped:
                    yield Token(int(line["token_id"]), str(line["token"]))
                elif kind == "done":
                    self._set_metrics(line)
                    if line.get("finish_reason") == "cancelled":
                        self._set_err(stopped[0] if stopped else GenerationCancelled("the worker cancelled the generation"))
                elif kind == "error":
                    self._set_err(WorkerReplyError(str(line.get("error")), str(line.get("message"))))
        except (WorkerError, WorkerReplyError, GenerationCancelled, ModelClosedError) as e:
            self._set_err(e)
        finally:
            lines.close()  # if our consumer stopped early: cancel the request and free the worker now

    def classify(self, prompts: Sequence[str], **config: Any) -> list[ClassifyResult]:
        """The token sampled after each prompt (one batched prefill); `logits` are log-probabilities."""
        cfg = make_config(GenerateConfig, **config)
        items = _strings(prompts, "prompts")
        self._begin()
        if not items:
            return []
        reply, _ = self._call("classify", {"prompts": items, **_sampling(cfg)}, cfg)
        self._set_metrics(reply)
        return [
            ClassifyResult(Token(int(r["token_id"]), str(r["token"])), r.get("logits"))
            for r in reply["results"]
        ]

    def batch_generate(self, prompts: Sequence[str], **config: Any) -> list[BatchResult]:
        """Generate for all prompts at once. Cancelled or timed out: the tokens so far, and `err()` set."""
        cfg = make_config(GenerateConfig, **config)
        items = _strings(prompts, "prompts")
        self._begin()
        if not items:
            return []
        reply, stopped = self._call("batch_generate", {"prompts": items, **_sampling(cfg)}, cfg)
        self._set_metrics(reply)
        if stopped is not None:
            self._set_err(stopped)
        return [
            BatchResult([Token(int(t["token_id"]), str(t["token"])) for t in r["tokens"]], r.get("error"))
            for r in reply["results"]
        ]

    # ---- extras -------------------------------------------------------------------------------------

    def inspect_attention(self, prompt: str | Sequence[int], include_queries: bool = False) -> AttentionSnapshot:
        """Keys (after RoPE) of every layer and KV head for `prompt` (text, encoded as `generate`
        encodes it, or token ids), and every head's queries when asked, computed by mlx-lm."""
        if isinstance(prompt, str):
            args: dict[str, Any] = {"prompt": prompt}
        else:
            tokens = list(prompt)
            if not tokens or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens):
                raise TypeError("prompt must be a string or a non-empty sequence of non-negative token ids")
            args = {"tokens": tokens}
        self._begin()
        if self.protocol < 2:
            raise WorkerError(f"the worker speaks protocol {self.protocol}; inspect_attention needs protocol 2")
        reply, _ = self._call("inspect_attention", {**args, "include_queries": include_queries}, GenerateConfig())
        return _snapshot(reply)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, by the model's tokenizer in the worker."""
        self._begin()
        reply, _ = self._call("encode", {"text": text, "add_special_tokens": add_special_tokens}, GenerateConfig())
        return [int(t) for t in reply["tokens"]]

    def decode(self, tokens: Sequence[int]) -> str:
        self._begin()
        reply, _ = self._call("decode", {"tokens": [int(t) for t in tokens]}, GenerateConfig())
        return str(reply["text"])

    # ---- lifetime -----------------------------------------------------------------------------------

    def close(self) -> None:
        """Quit every worker (killing any that linger) and reap them. Idempotent."""
        self._closed = True
        for slot in self._slots:
            slot.close()

    def __enter__(self) -> "MlxLmModel":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # a backstop only; close() is the way
        try:
            if not getattr(self, "_closed", True):
                self.close()
        except Exception:
            pass

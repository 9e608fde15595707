"""The worker's main loop: read requests, answer each with exactly one terminal line, keep serving.

Run it as `python -m pymlxc.bridge`, or `python path/to/bridge` where pymlxc is not installed.
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import threading
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import protocol as P
from .channel import EOF, Line, LineReader, LineWriter, claim_stdin, claim_stdout

if TYPE_CHECKING:
    from .engine import Engine


def custom_code(path: str) -> str | None:
    """Where the model directory asks for its own Python code (transformers' `auto_map`), if it does."""
    for name, key in (("tokenizer_config.json", None), ("config.json", "AutoTokenizer")):
        try:
            with open(os.path.join(path, name), encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, ValueError):
            continue  # absent or unreadable: mlx-lm reports it with its own message
        auto_map = config.get("auto_map") if isinstance(config, dict) else None
        if not isinstance(auto_map, dict):
            continue
        if key is None and auto_map:
            return f"auto_map in {name} names {sorted(auto_map)}"
        if key is not None and key in auto_map:
            return f"auto_map in {name} names {key} {auto_map[key]!r}"
    return None


class Control:
    """Out-of-band state shared with the reader thread: which requests a `cancel` has stopped.

    Lines are numbered as they arrive; a cancel stops every request that arrived before it, whether
    it is running now or still waiting in the queue, and none after it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._mark = 0
        self._running: int | None = None

    def stop_before(self, seq: float) -> bool:
        """Stop requests older than `seq`; True if one of them is running now."""
        with self._lock:
            self._mark = max(self._mark, int(min(seq, sys.maxsize)))
            return self._running is not None and self._running < seq

    def stopped(self, seq: int) -> bool:
        return seq < self._mark

    def running(self, seq: int | None) -> None:
        with self._lock:
            self._running = seq


class Worker:
    def __init__(self, writer: LineWriter) -> None:
        self.out = writer
        self.control = Control()
        self.engine: Engine | None = None
        self.handlers: dict[str, Callable[[P.Request, int], dict[str, Any]]] = {
            "load": self.load,
            "info": self.info,
            "encode": self.encode,
            "decode": self.decode,
            "generate": self.generate,
            "chat": self.generate,
            "classify": self.classify,
            "batch_generate": self.batch_generate,
            "inspect_attention": self.inspect_attention,
            "cancel": self.cancel,
        }

    # ---- the reader thread's view -----------------------------------------------------------------

    def intercept(self, line: Line) -> bool:
        """Answer `cancel` on arrival. Everything else, `quit` and end of input included, waits its
        turn, so a script that pipes in requests and then `quit` gets every answer."""
        try:
            request = P.parse_request(P.decode(line.data))
        except P.ProtocolError:
            return False  # the main loop will report it, in order
        if request.cmd != "cancel":
            return False
        active = self.control.stop_before(line.seq)
        self.out.send(P.result("cancel", request.id, active=active))
        return True

    # ---- the main loop ----------------------------------------------------------------------------

    def serve(self, inbox: queue.Queue[Line | None]) -> int:
        while True:
            line = inbox.get()
            if line is EOF:
                return 0
            message: dict[str, Any] = {}
            try:
                if line.problem is not None:
                    raise line.problem
                message = P.decode(line.data)
                request = P.parse_request(message)
            except P.ProtocolError as e:
                cmd = message.get("cmd")
                self.out.send(P.error(e.code, str(e), P.request_id(message), cmd if isinstance(cmd, str) else None))
                continue
            if request.cmd == "quit":
                self.out.send(P.result("quit", request.id))
                return 0
            reply = self.run(request, line.seq)
            try:
                self.out.send(reply)
            except ValueError as e:  # a value JSON cannot carry (NaN): still one terminal reply
                self.out.send(P.error("failed", f"reply could not be encoded: {e}", request.id, request.cmd))

    def run(self, request: P.Request, seq: int) -> dict[str, Any]:
        """Run one request; its terminal reply, returned so that it is sent only once the request no
        longer counts as running (a `cancel` read right after it then reports `active: false`)."""
        self.control.running(seq)
        try:
            return self.handlers[request.cmd](request, seq)
        except P.CommandError as e:
            return P.error(e.code, str(e), request.id, request.cmd, **e.fields)
        except BrokenPipeError:
            raise  # the client is gone: stop, do not try to tell it
        except Exception as e:  # mlx-lm failing must not end the worker; the traceback helps on stderr
            traceback.print_exc(file=sys.stderr)
            if self.engine is not None:
                self.engine.recover()
            return P.error("failed", f"{type(e).__name__}: {e}", request.id, request.cmd)
        finally:
            self.control.running(None)

    # ---- commands ---------------------------------------------------------------------------------

    def _engine(self) -> Engine:
        if self.engine is None:
            raise P.CommandError("no_model", "no model is loaded; send a load command first")
        return self.engine

    def load(self, request: P.Request, seq: int) -> dict[str, Any]:
        a = request.args
        # Checked before importing mlx-lm (seconds), and because mlx_lm.load would take a missing
        # path for a Hugging Face repo id and try the network.
        for field in ("path", "adapter_path"):
            if a[field] is not None and not os.path.isdir(a[field]):
                raise P.CommandError("load_failed", f"{field} {a[field]!r} is not a directory")
        if a["device"] not in (None, "default", "gpu", "cpu"):
            raise P.CommandError("bad_field", f"load: device must be 'default', 'gpu' or 'cpu', not {a['device']!r}")
        custom = custom_code(a["path"])
        if custom is not None:  # transformers would ask whether to run it; the answer is always no
            raise P.CommandError("load_failed", f"the model at {a['path']!r} needs custom tokenizer code ({custom}), "
                                                "which pymlxc never runs")
        try:
            from .engine import Engine
        except ImportError as e:
            raise P.CommandError("load_failed", f"mlx-lm cannot be imported in {sys.executable}: {e}") from e
        self.engine = None  # free the old model before loading the new one
        engine = Engine(a["path"], a["adapter_path"], a["context_len"], a["device"])
        reply = P.result("load", request.id, **engine.describe())
        self.engine = engine  # only now: a load that cannot describe its model fails and leaves none
        return reply

    def info(self, request: P.Request, seq: int) -> dict[str, Any]:
        return P.result("info", request.id, **self._engine().describe())

    def encode(self, request: P.Request, seq: int) -> dict[str, Any]:
        tokens = self._engine().encode(request.args["text"], request.args["add_special_tokens"])
        return P.result("encode", request.id, tokens=tokens)

    def decode(self, request: P.Request, seq: int) -> dict[str, Any]:
        return P.result("decode", request.id, text=self._engine().decode(request.args["tokens"]))

    def cancel(self, request: P.Request, seq: int) -> dict[str, Any]:
        # Reached only if the reader did not intercept it (it always does); answer the same way.
        return P.result("cancel", request.id, active=False)

    def generate(self, request: P.Request, seq: int) -> dict[str, Any]:
        engine = self._engine()  # first: with no model, answer without importing mlx-lm
        from .engine import Hooks

        a = request.args
        tokens = (
            engine.prompt_tokens(a["prompt"])
            if request.cmd == "generate"
            else engine.chat_tokens(a["messages"], a.get("chat_template_kwargs"))
        )
        # Whatever max_tokens says: a client counts a prompt by a generation of no tokens, and reads
        # the count of one past the context from the error's fields.
        P.check_context(request.cmd, len(tokens), engine.context_len)
        hooks = Hooks(
            cancelled=lambda: self.control.stopped(seq),
            progress=lambda done, total: self.out.send(P.progress(request.id, done, total)),
        )
        for event in engine.generate(tokens, a, hooks):
            if "finish_reason" in event:
                return P.done(request.id, **event)
            self.out.send(P.token(request.id, event["token_id"], event["token"]))
        raise RuntimeError("the generation ended without its summary")  # engine.generate always yields one

    def classify(self, request: P.Request, seq: int) -> dict[str, Any]:
        results, metrics = self._engine().classify(
            request.args["prompts"], request.args, lambda: self.control.stopped(seq)
        )
        return P.result("classify", request.id, results=results, **metrics)

    def batch_generate(self, request: P.Request, seq: int) -> dict[str, Any]:
        results, metrics = self._engine().batch_generate(
            request.args["prompts"], request.args, lambda: self.control.stopped(seq)
        )
        return P.result("batch_generate", request.id, results=results, **metrics)


    def inspect_attention(self, request: P.Request, seq: int) -> dict[str, Any]:
        engine = self._engine()
        a = request.args
        if (a["prompt"] is None) == (a["tokens"] is None):
            raise P.CommandError("bad_field", "inspect_attention: give exactly one of prompt and tokens")
        tokens = engine.prompt_tokens(a["prompt"]) if a["prompt"] is not None else engine.check_tokens(a["tokens"])
        return P.result("inspect_attention", request.id, **engine.inspect_attention(tokens, a["include_queries"]))


def _positive_int(text: str) -> int:
    # 0 would refuse every line, and a negative limit made the reader see end of input at once.
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, not {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    # The reader asks for limit + 1 bytes, a C ssize_t: past it the reader died at the first line and
    # the worker exited 0 without a word, having announced the limit in its hello.
    if value >= sys.maxsize:
        raise argparse.ArgumentTypeError(f"must be at most {sys.maxsize - 1}, not {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pymlxc.bridge", description="mlx-lm over JSON Lines on stdin/stdout"
    )
    parser.add_argument(
        "--max-line-bytes", type=_positive_int, default=P.MAX_LINE_BYTES, help="longest request line accepted"
    )
    args = parser.parse_args(argv)
    writer = LineWriter(claim_stdout())
    worker = Worker(writer)
    inbox: queue.Queue[Line | None] = queue.Queue()
    reader = LineReader(claim_stdin(), args.max_line_bytes, inbox, worker.intercept)
    try:
        writer.send(P.hello(pid=os.getpid(), python=sys.version.split()[0], max_line_bytes=args.max_line_bytes))
        reader.start()
        return worker.serve(inbox)
    except BrokenPipeError:
        return 0  # the client went away; nothing left to tell it

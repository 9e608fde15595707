"""The command line of the server: `pymlxc serve MODEL ...` and `python -m pymlxc.server MODEL ...`."""
from __future__ import annotations

import argparse
import ipaddress
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="a model directory, a .gguf file or a Hugging Face repo id")
    parser.add_argument("--host", default=DEFAULT_HOST, help="address to listen on (default: loopback only)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--backend", default=None, help="metal (continuous batching) or mlx_lm (worker slots)")
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' (default: $PYMLXC_API_KEY, else none)")
    parser.add_argument("--max-concurrency", type=int, default=16,
                        help="requests generating at once (the batch's rows; mlx_lm: worker slots)")
    parser.add_argument("--max-queue", type=int, default=64, help="requests waiting beyond those; more get 429")
    parser.add_argument("--context-len", type=int, default=None, help="tokens of context per request")
    parser.add_argument("--adapter", default=None, help="a LoRA adapter directory to load with the model")
    parser.add_argument("--model-id", default=None, help="the name /v1/models reports (default: MODEL)")
    parser.add_argument("--max-tokens-limit", type=int, default=4096, help="the largest max_tokens a request may ask")
    parser.add_argument("--max-body-bytes", type=int, default=1 << 20, help="the largest request body")
    parser.add_argument("--cors-origin", action="append", default=[],
                        help="allow browser requests from this origin (repeatable; default: CORS off)")
    parser.add_argument("--distributed", choices=("tensor", "pipeline"), default=None,
                        help="split the model over the ranks of `pymlxc launch`: rank 0 serves, every rank runs "
                             "the continuous batch in step (docs/distributed.md)")


def _positive(name: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise ValueError(f"--{name} must be >= 1, not {value}")


def run(args: argparse.Namespace) -> int:
    for name in ("max_concurrency", "context_len", "max_tokens_limit", "max_body_bytes"):
        _positive(name.replace("_", "-"), getattr(args, name))
    if args.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, not {args.max_queue}")
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, not {args.port}")
    try:
        loopback = ipaddress.ip_address(args.host).is_loopback
    except ValueError:
        loopback = args.host == "localhost"
    api_key = args.api_key if args.api_key is not None else os.environ.get("PYMLXC_API_KEY") or None
    if not loopback and api_key is None:
        print(f"pymlxc serve: warning: listening on {args.host} without an API key", file=sys.stderr)
    try:
        import uvicorn  # noqa: F401 - checked here, used by _serve

        from .app import ServerConfig, create_app
    except ImportError as exc:
        raise RuntimeError(f"the server needs its extra: pip install 'pymlxc[server]' ({exc})") from None
    import pymlxc

    options: dict[str, object] = {"parallel_slots": args.max_concurrency}
    if args.context_len is not None:
        options["context_len"] = args.context_len
    if args.adapter is not None:
        options["adapter_path"] = args.adapter
    if args.distributed is not None:
        options["distributed"] = args.distributed
    config = ServerConfig(model_id=args.model_id or args.model, api_key=api_key, max_concurrency=args.max_concurrency,
                          max_queue=args.max_queue, max_body_bytes=args.max_body_bytes,
                          max_tokens_limit=args.max_tokens_limit, cors_origins=tuple(args.cors_origin))
    with pymlxc.load_model(args.model, backend=args.backend, **options) as model:
        if args.distributed is not None:
            return _serve_ranks(model, config, args)
        app = create_app(model, config)
        _serve(app, args.host, args.port)
    return 0


def _serve(app: Any, host: str, port: int) -> None:
    """Run `app` under uvicorn until it is told to exit (SIGINT, SIGTERM); then the app's requests
    in flight get their grace period and a 503 (app.py's Lifecycle), before uvicorn's own graceful
    shutdown (5 s) would cut them with a bare 500 or a broken stream."""
    import uvicorn

    lifecycle = app.state.lifecycle

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            lifecycle.stop()
            super().handle_exit(sig, frame)

    Server(uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5)).run()


def _serve_ranks(model: Any, config: Any, args: argparse.Namespace) -> int:
    """A distributed model: rank 0 serves HTTP, the other ranks run its continuous batch in step (ranks.py)."""
    import pymlxc.core as mx

    from .app import create_app
    from .ranks import BatchRankEngine, follow_batch

    if mx.distributed.init().rank() != 0:
        follow_batch(model, max_concurrency=args.max_concurrency, max_queue=args.max_queue)
        return 0
    engine = BatchRankEngine(model, max_concurrency=args.max_concurrency, max_queue=args.max_queue)

    def stopped(signum: int, frame: object) -> None:
        raise _Stopped  # uvicorn re-raises the SIGTERM it shut down on: end here, the other ranks told

    previous = signal.signal(signal.SIGTERM, stopped)
    try:
        app = create_app(model, config, engine=engine)
        _serve(app, args.host, args.port)
    except _Stopped:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        engine.close()  # the other ranks end with this one
    return 0


class _Stopped(Exception):
    """SIGTERM reached rank 0 of a distributed server."""


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pymlxc.server", description="An OpenAI-compatible server.")
    configure(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except KeyboardInterrupt:
        return 130
    except (OSError, ValueError, RuntimeError) as exc:
        print(f"pymlxc serve: error: {exc}", file=sys.stderr)
        return 1

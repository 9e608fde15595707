"""The `pymlxc` command line: generate, chat, info and discover, plus the commands that modules add.

Commands live in a registry (`Command`, `register_command`); besides the built-in ones here, every
module of `pymlxc.commands` and every `pymlxc.commands` entry point may add its own (see that
package's doc). Tokens go to stdout as they come; progress, metrics and errors go to stderr.
"""
from __future__ import annotations

import _thread
import argparse
import importlib
import inspect
import json
import os
import pkgutil
import sys
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from importlib import metadata
from typing import IO, Any

from tqdm import tqdm

from . import settings

PROG = "pymlxc"


@dataclass(frozen=True)
class Command:
    """A subcommand: `configure` adds its arguments, `run` does it and returns the exit status.
    `reads_stdin`: it reads its input from stdin (`pymlxc launch` then gives every rank a copy)."""

    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    reads_stdin: bool = False


_commands: dict[str, Command] = {}


def register_command(command: Command) -> None:
    """Add (or replace) a subcommand."""
    _commands[command.name] = command


def commands() -> dict[str, Command]:
    return dict(_commands)


# ---------------------------------------------------------------------- output helpers

class ProgressBar:
    """`(done, total)` callback feeding a tqdm bar of bytes on `stream` (stderr by default). tqdm
    draws nothing when the stream is not a terminal, so logs and pipes stay clean."""

    def __init__(self, label: str = "loading", stream: IO[str] | None = None) -> None:
        self.label, self.stream = label, stream or sys.stderr
        self._bar: tqdm[Any] | None = None
        self._lock = threading.Lock()  # a backend may report from its loading thread

    def __call__(self, done: int, total: int) -> None:
        with self._lock:
            if self._bar is None:
                self._bar = tqdm(total=max(total, 0), desc=self.label, unit="B", unit_scale=True, unit_divisor=1024,
                                 file=self.stream, disable=None, leave=True, dynamic_ncols=True)
            if total != self._bar.total:
                self._bar.total = max(total, 0)
            self._bar.update(max(done, 0) - self._bar.n)

    def close(self) -> None:
        with self._lock:
            if self._bar is not None:
                self._bar.close()


def _mb(n: int) -> str:
    return f"{n / 2**20:.1f} MB"


def format_metrics(m: Any) -> str:
    return (f"prompt {m.prompt_tokens} tokens in {m.prefill_duration:.2f}s ({m.prefill_tokens_per_sec:.1f} tok/s), "
            f"generated {m.generated_tokens} tokens in {m.decode_duration:.2f}s ({m.decode_tokens_per_sec:.1f} tok/s), "
            f"peak memory {_mb(m.peak_memory_bytes)}, active {_mb(m.active_memory_bytes)}")


def _error(message: str) -> None:
    print(f"{PROG}: error: {message}", file=sys.stderr)


# ---------------------------------------------------------------------- loading

def add_load_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="model directory, .gguf file, or Hugging Face repo id (org/name[@revision]"
                        "[:QUANT]; downloaded into the hub cache)")
    parser.add_argument("--backend", default=None, help="backend name (default: the best available)")
    parser.add_argument("--context-len", type=int, default=None, help="context length in tokens")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU (gpu_layers=0)")
    parser.add_argument("--quiet", "-q", action="store_true", help="no progress bar or metrics")
    parser.add_argument("--distributed", choices=("tensor", "pipeline"), default=None,
                        help="split the model over the ranks of `pymlxc launch` (docs/distributed.md)")


def load(args: argparse.Namespace) -> Any:
    """Load `args.model` as `add_load_arguments` describes, with a progress bar on stderr when the
    backend reports progress. A repo id is downloaded first (huggingface_hub's bars unless --quiet)
    and `args.model` becomes the local path, which commands such as `fuse` read files from."""
    from pymlxc import hub, registry
    from pymlxc.options import LoadConfig, make_config

    options: dict[str, Any] = {}
    if args.context_len is not None:
        options["context_len"] = args.context_len
    if args.cpu:
        options["gpu_layers"] = 0
    if getattr(args, "distributed", None) is not None:  # commands with their own load arguments lack it
        options["distributed"] = args.distributed
    config = make_config(LoadConfig, backend=args.backend, **options)
    backend = registry.default_backend() if config.backend is None else registry.get(config.backend)
    if not backend.available():
        raise registry.BackendUnavailableError(
            f"backend {backend.name!r} is unavailable: {backend.unavailable_reason()}"
        )
    name, args.model = args.model, str(hub.resolve(args.model, progress=not args.quiet))
    if args.quiet or "progress" not in inspect.signature(backend.load).parameters:
        return backend.load(str(args.model), config)
    bar = ProgressBar(f"loading {name}")
    try:
        return backend.load(str(args.model), config, progress=bar)  # type: ignore[call-arg]
    finally:
        bar.close()


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=0.0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--repeat-penalty", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)


def sampling_options(args: argparse.Namespace) -> dict[str, Any]:
    """The options of `add_sampling_arguments`, checked as `GenerateConfig` checks them: here, before
    the model is loaded (or downloaded), and named as the command line spells them."""
    from pymlxc.options import GenerateConfig, make_config

    options = {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_k": args.top_k,
               "top_p": args.top_p, "min_p": args.min_p, "repeat_penalty": args.repeat_penalty, "seed": args.seed}
    try:
        make_config(GenerateConfig, **options)
    except (TypeError, ValueError) as exc:
        message = str(exc)
        name = message.split(" ", 1)[0]
        if name in options:  # "top_p must be ..." -> "--top-p must be ..."
            message = "--" + name.replace("_", "-") + message[len(name):]
        raise ValueError(message) from None
    return options


def _print_stream(tokens: Iterable[Any], out: IO[str]) -> str:
    pieces = []
    for token in tokens:
        pieces.append(token.text)
        out.write(token.text)
        out.flush()
    return "".join(pieces)


# ---------------------------------------------------------------------- built-in commands

def _configure_generate(p: argparse.ArgumentParser) -> None:
    add_load_arguments(p)
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--chat", action="store_true", help="send the prompt as a user message through the chat template")
    add_sampling_arguments(p)


def _run_generate(args: argparse.Namespace) -> int:
    options = sampling_options(args)
    with load(args) as model:
        if args.chat:
            stream = model.chat([{"role": "user", "content": args.prompt}], **options)
        else:
            stream = model.generate(args.prompt, **options)
        _print_stream(stream, sys.stdout)
        sys.stdout.write("\n")
        sys.stdout.flush()
        if model.err() is not None:
            _error(str(model.err()))
            return 1
        if not args.quiet:
            print(format_metrics(model.metrics()), file=sys.stderr)
    return 0


MAX_MESSAGE_CHARS = 1 << 22  # one chat message read from stdin; far more than any context holds


def _configure_chat(p: argparse.ArgumentParser) -> None:
    add_load_arguments(p)
    p.add_argument("--system", default=None, help="a system message to start the conversation with")
    add_sampling_arguments(p)


def _run_chat(args: argparse.Namespace) -> int:
    options = sampling_options(args)
    interactive = sys.stdin.isatty()
    with load(args) as model:
        history: list[dict[str, str]] = []
        if args.system:
            history.append({"role": "system", "content": args.system})
        if interactive:
            print("type a message; /exit or end of input (Ctrl-D) quits", file=sys.stderr)
        while True:
            if interactive:
                sys.stderr.write("> ")
                sys.stderr.flush()
            line = sys.stdin.readline(MAX_MESSAGE_CHARS + 1)  # bounded: `< /dev/zero` is no endless line
            if not line:
                break
            if len(line) > MAX_MESSAGE_CHARS and not line.endswith("\n"):
                raise ValueError(f"a message on stdin is longer than {MAX_MESSAGE_CHARS} characters")
            text = line.rstrip("\n")
            if text.strip() == "/exit":
                break
            if not text.strip():
                continue
            history.append({"role": "user", "content": text})
            answer = _print_stream(model.chat(history, **options), sys.stdout)
            sys.stdout.write("\n")
            sys.stdout.flush()
            if model.err() is not None:
                _error(str(model.err()))
                return 1
            history.append({"role": "assistant", "content": answer})
            if not args.quiet:
                print(format_metrics(model.metrics()), file=sys.stderr)
    return 0


def _configure_info(p: argparse.ArgumentParser) -> None:
    add_load_arguments(p)
    p.add_argument("--json", action="store_true", help="print JSON")


def _run_info(args: argparse.Namespace) -> int:
    with load(args) as model:
        info = model.info().to_dict()
    if args.json:
        print(json.dumps(info))
    else:
        for key, value in info.items():
            print(f"{key}: {value}")
    return 0


def _configure_discover(p: argparse.ArgumentParser) -> None:
    p.add_argument("root", nargs="?", default=None,
                   help="folder to search (default: the Hugging Face hub cache, listing each model's repo id)")
    p.add_argument("--json", action="store_true", help="one JSON object per line")


def _run_discover(args: argparse.Namespace) -> int:
    from pymlxc.discover import discover, discover_hub
    from pymlxc.files import check_directory
    from pymlxc.hub import hub_cache_dir

    if args.root is not None:  # a typo is an error, not "no models"
        check_directory(args.root, what="folder to search")
    where = args.root if args.root is not None else f"the Hugging Face cache {hub_cache_dir()}"
    found = 0
    for model in (discover(args.root) if args.root is not None else discover_hub()):
        found += 1
        record = {"path": str(model.path), "model_type": model.model_type, "format": model.format,
                  "quant_bits": model.quant_bits, "quant_group": model.quant_group, "files": model.num_files}
        if model.reference is not None:
            record = {"reference": model.reference, **record}
        if args.json:
            print(json.dumps(record))
        else:
            quant = f"{model.quant_bits}-bit/{model.quant_group}" if model.quant_bits else "unquantized"
            lead = f"{model.reference}\t" if model.reference is not None else ""
            print(f"{lead}{model.path}\t{model.model_type or '?'}\t{model.format}\t{quant}\t{model.num_files} file(s)")
    if not found and not args.json:
        print(f"no models under {where}", file=sys.stderr)
    return 0


for _command in (
    Command("generate", "generate text after a prompt", _configure_generate, _run_generate),
    Command("chat", "chat interactively (reads messages from stdin)", _configure_chat, _run_chat, reads_stdin=True),
    Command("info", "describe a model", _configure_info, _run_info),
    Command("discover", "list the model directories under a folder, or the models in the Hugging Face cache",
            _configure_discover, _run_discover),
):
    register_command(_command)


# ---------------------------------------------------------------------- extensions and entry point

_extensions_loaded = False


def load_extensions() -> list[str]:
    """Import the command modules of `pymlxc.commands` and the entry points; returns failures."""
    global _extensions_loaded
    if _extensions_loaded:
        return []
    _extensions_loaded = True
    failures = []
    try:
        package = importlib.import_module("pymlxc.commands")
        for info in pkgutil.iter_modules(package.__path__):
            try:
                module = importlib.import_module(f"pymlxc.commands.{info.name}")
                module.register_commands(register_command)
            except Exception as exc:  # noqa: BLE001 - one broken extension must not break the CLI
                failures.append(f"pymlxc.commands.{info.name}: {type(exc).__name__}: {exc}")
    except ImportError:
        pass
    for entry in metadata.entry_points(group="pymlxc.commands"):
        try:
            entry.load()(register_command)
        except Exception as exc:  # noqa: BLE001
            failures.append(f"{entry.name}: {type(exc).__name__}: {exc}")
    return failures


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="Run language models on MLX through mlx-c.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in sorted(_commands):
        command = _commands[name]
        p = sub.add_parser(name, help=command.help, description=command.help)
        command.configure(p)
        p.set_defaults(_run=command.run, _parser=p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    previous_hook = sys.unraisablehook
    sys.unraisablehook = _interrupts_redelivered(previous_hook)
    try:
        try:
            return _main(argv)
        finally:
            # Flushed here, not at the interpreter's exit, where a reader gone (`| head`) would make
            # Python print "Exception ignored ... BrokenPipeError" and exit with status 120.
            if sys.stdout is not None:
                sys.stdout.flush()
    except BrokenPipeError:
        _discard_stdout()
        return 0
    except KeyboardInterrupt:  # redelivered (see below) after _main had returned
        print(file=sys.stderr)
        return 130
    finally:
        sys.unraisablehook = previous_hook


def _interrupts_redelivered(previous: Callable[[Any], object]) -> Callable[[Any], None]:
    """An unraisable-exception hook that hands a Ctrl-C landed in a finalizer back to the main
    thread instead of dropping it, and passes anything else to `previous`.

    Python runs the SIGINT handler wherever the main thread is, destructors included: those of
    `ffi.gc` (`core._gen._free_vector` runs for every vector an evaluation frees), `__del__`
    methods, a collected generator's close. A KeyboardInterrupt raised there cannot propagate:
    Python prints "Exception ignored ... KeyboardInterrupt" and goes on, so Ctrl-C during
    `generate` was lost about once in 120 runs and the command ran on to --max-tokens."""

    def hook(unraisable: Any) -> None:
        if unraisable.exc_type is None or not issubclass(unraisable.exc_type, KeyboardInterrupt):
            previous(unraisable)
            return
        # Tripped from this thread, the signal would be handled at once, inside this hook, and
        # dropped again. A thread of its own trips it when it next gets the GIL, and the main
        # thread raises it at its next check for signals (should that be in a finalizer again, it
        # comes back here).
        _thread.start_new_thread(_thread.interrupt_main, ())

    return hook


def _discard_stdout() -> None:
    """The reader went away: not an error; later writes and the interpreter's own flush go nowhere."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def parse_arguments(argv: Sequence[str] | None) -> argparse.Namespace:
    """The arguments, or argparse's usage error (SystemExit 2). One that the command does not know is
    refused with that command's usage: argparse's own refusal shows the top-level usage instead."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        getattr(args, "_parser", parser).error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def _main(argv: Sequence[str] | None) -> int:
    try:
        for failure in load_extensions():
            print(f"{PROG}: warning: command extension failed to load: {failure}", file=sys.stderr)
        args = parse_arguments(argv)
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:
        _discard_stdout()
        return 0
    except (OSError, ValueError, TypeError, KeyError, RuntimeError, FloatingPointError) as exc:
        # FloatingPointError: training's diverged loss or weights, named with the step
        message = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)
        _error(message or type(exc).__name__)
        return 1
    except MemoryError as exc:  # the device's or the host's (memory_check.DeviceMemoryError among them)
        _error(f"out of memory: {exc}" if str(exc) else "out of memory")
        return 1
    except ImportError as exc:  # an optional dependency missing (the `gguf` package, a backend's library)
        _error(str(exc))
        return 1
    except Exception as exc:  # noqa: BLE001 - a bug: one line, not a traceback, unless asked for
        if _wants_traceback():
            raise
        _error(f"internal error: {type(exc).__name__}: {exc} (set PYMLXC_TRACEBACK=1 to see where)")
        return 1


def _wants_traceback() -> bool:
    """`settings.traceback`; False where the environment's settings do not read (their own error
    was reported at import already)."""
    try:
        return settings.current().traceback
    except settings.SettingsError:
        return False


if __name__ == "__main__":
    # Run the canonical module's main, so that extensions importing `pymlxc.cli` share its registry.
    from pymlxc.cli import main as _canonical_main

    sys.exit(_canonical_main())

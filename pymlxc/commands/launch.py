"""`pymlxc launch -n N [--mode tensor|pipeline] -- COMMAND ...`: run a pymlxc command as N ranks on
this machine (the ring backend over 127.0.0.1, or NCCL with one GPU per rank), the model split by
`--mode`. Rank 0 answers: its output is shown, the other ranks run the same steps silently. A rank
that fails ends the run (see `pymlxc.launch`). For several machines use `mlx.launch` with
`pymlxc COMMAND --distributed MODE` (docs/distributed.md)."""
from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pymlxc.cli import Command


def _configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("-n", "--ranks", type=int, required=True, help="how many processes (ranks)")
    p.add_argument("--mode", choices=("tensor", "pipeline"), default="tensor",
                   help="how the model is split: tensor (heads and MLP columns per rank) or pipeline (layers per rank)")
    p.add_argument("--backend", choices=("ring", "nccl"), default="ring",
                   help="ring (TCP over 127.0.0.1; CPUs and Macs) or nccl (one GPU per rank)")
    p.add_argument("--timeout", type=float, default=None, help="seconds before every rank is stopped")
    p.add_argument("--grace", type=float, default=10.0,
                   help="seconds the other ranks get to end on their own after one fails")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- COMMAND ...",
                   help="the pymlxc command every rank runs, e.g. -- generate MODEL 'Hello', or -- serve MODEL "
                        "(rank 0 serves HTTP, the others follow)")


MAX_RANKS = 256  # processes on one machine; more would only exhaust ports, files and memory


def _check(args: argparse.Namespace) -> str | None:
    """What is wrong with the options, before any rank starts; None when nothing."""
    if args.ranks < 1:
        return f"-n must be at least 1, not {args.ranks}"
    if args.ranks > MAX_RANKS:
        return f"-n must be at most {MAX_RANKS} (ranks on this machine), not {args.ranks}"
    if args.backend == "ring" and args.ranks < 2:
        # A ring of one rank never connects: the run would fail after a long wait.
        return "-n must be at least 2 with --backend ring (a single process needs no launch: run the command itself)"
    if args.timeout is not None and not (math.isfinite(args.timeout) and args.timeout > 0):
        return f"--timeout must be a positive number of seconds, not {args.timeout}"
    if not (math.isfinite(args.grace) and args.grace >= 0):
        return f"--grace must be a number of seconds >= 0, not {args.grace}"
    return None


def _takes_distributed(command: Command) -> bool:
    """Whether the command has the --distributed option that the ranks are run with."""
    probe = argparse.ArgumentParser(add_help=False)
    command.configure(probe)
    return "--distributed" in probe._option_string_actions  # noqa: SLF001 - argparse's option table


def _check_command(cmd: list[str]) -> str | None:
    """What is wrong with the command the ranks would run: one that is not a pymlxc command, or one
    that loads no model to split (its ranks would each refuse the --distributed added to it)."""
    from pymlxc.cli import commands  # noqa: PLC0415 - cli imports this package

    known = commands()
    splittable = sorted(name for name, command in known.items() if _takes_distributed(command))
    if cmd[0] not in splittable:
        what = "is not a pymlxc command" if cmd[0] not in known else "loads no model to split over ranks"
        return f"{cmd[0]!r} {what}; the commands that run as ranks: {', '.join(splittable)}"
    return None


def _run(args: argparse.Namespace) -> int:
    from pymlxc.cli import commands, parse_arguments  # noqa: PLC0415 - cli imports this package
    from pymlxc.launch import LaunchError, run_local  # noqa: PLC0415 - light CLI start-up

    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        print("pymlxc launch: no command given (e.g. pymlxc launch -n 2 -- generate MODEL 'Hello')", file=sys.stderr)
        return 2
    problem = _check(args) or _check_command(cmd)
    if problem is not None:
        print(f"pymlxc launch: {problem}", file=sys.stderr)
        return 2
    argv = [*cmd, "--distributed", args.mode]
    parse_arguments(argv)  # a usage error is the command's own (status 2) before any rank starts
    command = [sys.executable, "-c", "import sys; from pymlxc.cli import main; sys.exit(main())", *argv]
    # A command that reads stdin (chat) gets a copy in every rank; the others keep /dev/null, so that
    # a launch in the background of a shell is not stopped for reading the terminal.
    stdin = sys.stdin.fileno() if commands()[cmd[0]].reads_stdin and sys.stdin is not None else None
    try:
        results = run_local(args.ranks, command, backend=args.backend, timeout=args.timeout, grace=args.grace,
                            echo=True, stdin=stdin)
    except LaunchError as exc:
        print(f"pymlxc launch: {exc}", file=sys.stderr)
        return 1
    sys.stderr.write(results[0].stderr)
    return 0


def register_commands(register: Callable[[Any], None]) -> None:
    from pymlxc.cli import Command  # noqa: PLC0415 - cli imports this package

    register(Command("launch", "run a command as N ranks of one distributed model on this machine", _configure, _run))


__all__ = ["register_commands"]

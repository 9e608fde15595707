"""What the ranks of a distributed model share: the group, and the options of each call.

Every rank runs the same calls (the same script under `mlx.launch`, or rank 0's requests repeated
by the others) and so the same steps, each step's collectives matched one to one. Nothing that
differs between processes may decide how many steps a call takes: sampling draws from one seed
that rank 0 picks and every rank takes, and a wall-clock `timeout` or a `cancel` event, which each
process would see at a different step, is refused.
"""
from __future__ import annotations

import dataclasses
import secrets

import numpy as np

import pymlxc.core as mx
from pymlxc.core import MLXError
from pymlxc.core import distributed as dist
from pymlxc.options import GenerateConfig

from .errors import ShardingError
from .watchdog import watch_group

MODES = ("tensor", "pipeline")


def join_group(mode: str) -> dist.Group:
    """The group of the processes launched together (strict: a process that was not launched as
    one of several, or whose peers cannot be reached, gets an error, not a group of one), with the
    heartbeat that ends every rank when one stalls (`watchdog.py`) started the first time."""
    if mode not in MODES:
        raise ValueError(f"distributed must be one of {', '.join(MODES)} (or None), not {mode!r}")
    try:
        group = dist.init(strict=True)
    except MLXError as exc:
        raise ShardingError(f"distributed={mode!r} needs processes started together by `pymlxc launch -n N ...` "
                            f"or `mlx.launch -n N ...` (one per rank): {exc}") from exc
    watch_group(group)
    return group


def agree_options(options: GenerateConfig) -> GenerateConfig:
    """`options` as every rank must run them: rank 0's seed where none is given (a collective:
    every rank calls this once per call), no timeout or cancel event."""
    if options.timeout is not None or options.cancel is not None:
        raise ValueError("timeout and cancel are not supported on a distributed model: every rank must take the "
                         "same number of steps (stop with max_tokens or stop_tokens)")
    group = dist.init()
    if group.size() == 1:
        return options
    # Rank 0's 60 random bits as three 20-bit parts (exact in any dtype a backend may sum in); the
    # masks keep the seed in range whatever comes back (two 31-bit parts once gave a negative seed
    # on the CPU ring backend, likely summed with another step's data by ranks out of step: see
    # batching.Scheduler.submit_all).
    mine = secrets.randbits(60) if group.rank() == 0 else 0
    parts = [(mine >> shift) & _PART for shift in (40, 20, 0)] if options.seed is None else [0, 0, 0]
    agreed = dist.all_sum(mx.array(parts, mx.int32), group=group).tolist()
    if options.seed is not None:
        return options
    seed = 0
    for part in agreed:
        seed = (seed << 20) | (int(part) & _PART)
    return dataclasses.replace(options, seed=seed)


_PART = (1 << 20) - 1


def from_rank0(code: int, payload: bytes = b"", group: dist.Group | None = None) -> tuple[int, bytes]:
    """Rank 0's (code, payload) on every rank of `group` (a collective: every rank calls it, the
    others' arguments are ignored): the way rank 0 hands the others the work they follow. A code
    and a length first (int32), then the bytes, as sums over the group where only rank 0 adds."""
    group = group if group is not None else dist.init()
    mine = group.rank() == 0
    head = dist.all_sum(mx.array([code, len(payload)] if mine else [0, 0], mx.int32), group=group).tolist()
    code, n = int(head[0]), int(head[1])
    if n == 0:
        return code, b""
    data = mx.array(np.frombuffer(payload, np.uint8) if mine else np.zeros(n, np.uint8))
    return code, np.asarray(dist.all_sum(data, group=group)).tobytes()


__all__ = ["MODES", "agree_options", "from_rank0", "join_group"]

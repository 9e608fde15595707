"""A heartbeat between the ranks, so that a rank that stalls (stopped by SIGSTOP, stuck, or its
machine gone quiet) ends the others within a bounded time instead of leaving them waiting forever.

A rank that dies closes its sockets, and MLX's ring backend then raises "connection to a peer was
lost" at the next step; a rank that is stopped keeps its sockets open, and its peers would wait in
their next collective for ever. MLX gives no timeout on a collective, and a thread blocked inside
MLX's evaluation cannot be interrupted from Python, so the watchdog runs beside it: rank 0 listens
on a TCP port of its own, every other rank connects to it, and each side sends a byte every
`INTERVAL` seconds from a daemon thread (the binding releases the GIL inside MLX's calls, so the
thread runs while the main one waits). When a peer has sent nothing for `timeout` seconds the rank
prints which one to stderr and ends with status `PEER_STALLED_EXIT`; rank 0 first tells the others
why (they end at once with the same message). A rank that ends normally says goodbye first, and is
not watched after that (its closed sockets make MLX itself fail any later step that needs it).

Rank 0's address is the one the launcher gave it (the ring's hostfile, NCCL_HOST_IP or JACCL's
coordinator), else 127.0.0.1. If a rank cannot reach that port, every rank agrees to run without a
watchdog (a warning says so), rather than one side ending a healthy run.
"""
from __future__ import annotations

import atexit
import contextlib
import json
import os
import selectors
import socket
import sys
import threading
import time
import warnings
from typing import cast

import pymlxc.core as mx
from pymlxc.core import distributed as dist

INTERVAL = 1.0  # seconds between heartbeats
STALL_TIMEOUT = 20.0  # seconds of silence after which a peer counts as stalled
PEER_STALLED_EXIT = 75  # the status a rank ends with when a peer stalls (EX_TEMPFAIL)
_CONNECT_TIMEOUT = 10.0

_BEAT, _BYE, _STALLED = b"h", b"b", b"s"


def rank0_host() -> str:
    """The address rank 0 is reached at, from what the launcher set."""
    hostfile = os.environ.get("MLX_HOSTFILE")
    if hostfile:
        try:
            with open(hostfile) as fh:
                hosts = json.load(fh)
            first = hosts[0][0] if isinstance(hosts[0], list) else hosts[0]["ips"][0]
            return str(first).rpartition(":")[0] or str(first)
        except (OSError, ValueError, LookupError, TypeError):
            pass  # an unusual hostfile: MLX reads it; the watchdog falls back to loopback
    for var in ("NCCL_HOST_IP", "MLX_JACCL_COORDINATOR"):
        value = os.environ.get(var)
        if value:
            return value.rpartition(":")[0] if ":" in value else value
    return "127.0.0.1"


class Watchdog:
    """The heartbeat of one rank (see the module doc); `start` joins the group's ranks to it."""

    def __init__(self, rank: int, size: int, timeout: float) -> None:
        self.rank, self.size, self.timeout = rank, size, timeout
        self._peers: dict[socket.socket, int] = {}  # socket -> the peer's rank
        self._heard: dict[int, float] = {}
        self._done: set[int] = set()  # peers that said goodbye
        self._lock = threading.Lock()
        self._closed = False

    # ------------------------------------------------------------------ set-up (every rank, together)
    def start(self, group: dist.Group) -> bool:
        """Connect the ranks (a collective: every rank calls it once); False when some rank could
        not connect, and then no rank watches."""
        listener = None
        host = rank0_host()
        port = 0
        ok = 1
        if self.rank == 0:
            listener = socket.create_server((host, 0), backlog=self.size)
            port = listener.getsockname()[1]
        got = dist.all_sum(mx.array([port], mx.int32), group=group).tolist()
        port = int(got[0])
        if self.rank != 0:
            try:
                s = socket.create_connection((host, port), timeout=_CONNECT_TIMEOUT)
                s.sendall(self.rank.to_bytes(4, "little"))
                self._peers[s] = 0
            except OSError as exc:
                warnings.warn(f"rank {self.rank} cannot reach rank 0's watchdog at {host}:{port} ({exc}): the "
                              "ranks run without one (a stalled rank would not be detected)", RuntimeWarning,
                              stacklevel=3)
                ok = 0
        agreed = int(dist.all_sum(mx.array([ok], mx.int32), group=group).tolist()[0])
        if agreed != self.size:
            for s in self._peers:
                s.close()
            if listener is not None:
                listener.close()
            return False
        if listener is not None:
            listener.settimeout(_CONNECT_TIMEOUT)
            try:
                for _ in range(self.size - 1):  # they connected before the agreement: in the backlog
                    s, _ = listener.accept()
                    s.settimeout(_CONNECT_TIMEOUT)
                    self._peers[s] = int.from_bytes(_read_exactly(s, 4), "little")
            finally:
                listener.close()
        now = time.monotonic()
        for s, peer in self._peers.items():
            s.setblocking(False)
            self._heard[peer] = now
        threading.Thread(target=self._run, name="pymlxc-distributed-watchdog", daemon=True).start()
        atexit.register(self.close)
        return True

    # ------------------------------------------------------------------ the thread
    def _send_all(self, what: bytes) -> None:
        for s in list(self._peers):
            # A full buffer or a closed peer: its silence or its goodbye speak for it.
            with contextlib.suppress(OSError):
                s.send(what)

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        for s in self._peers:
            sel.register(s, selectors.EVENT_READ)
        next_beat = 0.0
        while True:
            now = time.monotonic()
            with self._lock:
                if self._closed:
                    return
                if now >= next_beat:
                    self._send_all(_BEAT)
                    next_beat = now + INTERVAL
            for key, _ in sel.select(timeout=INTERVAL / 4):
                s = cast(socket.socket, key.fileobj)
                peer = self._peers[s]
                try:
                    data = s.recv(4096)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    data = b""
                if not data:  # closed without goodbye: judged by its silence from now on
                    sel.unregister(s)
                    continue
                if _STALLED in data:
                    self._end("rank 0 ended the run: another rank stopped answering (see rank 0's error)")
                if _BYE in data:
                    self._done.add(peer)
                self._heard[peer] = time.monotonic()
            now = time.monotonic()
            for peer, heard in self._heard.items():
                if peer not in self._done and now - heard > self.timeout:
                    if self.rank == 0:
                        with self._lock:
                            self._send_all(_STALLED)
                    self._end(f"rank {peer} sent no heartbeat for {now - heard:.0f} s (stalled, stopped or "
                              f"unreachable; timeout {self.timeout:g} s)")

    def _end(self, why: str) -> None:
        sys.stderr.write(f"pymlxc distributed: rank {self.rank} of {self.size} is ending: {why}\n")
        sys.stderr.flush()
        os._exit(PEER_STALLED_EXIT)  # the main thread is blocked inside MLX: nothing else can end it

    def close(self) -> None:
        """Say goodbye and stop (at exit): the peers stop watching this rank."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._send_all(_BYE)
            for s in self._peers:
                s.close()


def _read_exactly(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = s.recv(n - len(out))
        if not chunk:
            raise OSError("a rank closed its watchdog connection during set-up")
        out += chunk
    return out


_current: Watchdog | None = None


def watch_group(group: dist.Group, timeout: float = STALL_TIMEOUT) -> Watchdog | None:
    """Start this process's watchdog over `group` the first time (every rank calls it the same
    number of times, as it is a collective then); the watchdog, or None on a group of one or when
    a rank could not connect."""
    global _current
    if group.size() == 1:
        return None
    if _current is None:
        dog = Watchdog(group.rank(), group.size(), timeout)
        _current = dog if dog.start(group) else None
    return _current


__all__ = ["INTERVAL", "PEER_STALLED_EXIT", "STALL_TIMEOUT", "Watchdog", "rank0_host", "watch_group"]

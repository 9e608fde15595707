"""Child processes of the test process, read from /proc: to prove that no worker outlives its model."""
from __future__ import annotations

import os
from pathlib import Path


def children(pid: int | None = None) -> set[int]:
    """Live child processes of `pid` (default: this process), zombies included, from /proc.

    Read from every process's parent pid in `/proc/<pid>/stat`, not from the per-thread
    `task/*/children` lists, which proc(5) calls unreliable: one missed a worker once in a full
    run (the workers of a model with parallel slots are started on pool threads that exit)."""
    parent = pid or os.getpid()
    found: set[int] = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ")".
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[1]) == parent:
            found.add(int(entry.name))
    return found

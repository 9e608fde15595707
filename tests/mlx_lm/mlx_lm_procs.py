"""Child processes of the test process, read from /proc: to prove that no worker outlives its model."""
from __future__ import annotations

import os
from pathlib import Path


def children(pid: int | None = None) -> set[int]:
    """Live child processes of `pid` (default: this process), zombies included, from /proc."""
    found: set[int] = set()
    task_dir = Path(f"/proc/{pid or os.getpid()}/task")
    for task in task_dir.iterdir():
        try:
            found |= {int(c) for c in (task / "children").read_text().split()}
        except OSError:
            continue
    return found

"""Fixtures of the bridge tests: raw workers over pipes, and a tiny model."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from bridge_raw_worker import RawWorker  # type: ignore[import-not-found]


@pytest.fixture
def start_worker() -> Iterator[Any]:
    """Start raw workers (with extra CLI args); all are ended after the test."""
    started: list[RawWorker] = []

    def start(*args: str) -> RawWorker:
        started.append(RawWorker(*args))
        return started[-1]

    yield start
    for w in started:
        w.close()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pymlxc.testing import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("bridge-model") / "llama", "llama", seed=1)


@pytest.fixture(scope="session")
def loaded_worker(tiny_model: Path) -> Iterator[RawWorker]:
    """One worker with the tiny model loaded, shared by all bridge tests (starting one costs seconds)."""
    worker = RawWorker()
    reply = worker.request(cmd="load", id="load", path=str(tiny_model))
    assert reply["type"] == "result", reply
    yield worker
    worker.close()

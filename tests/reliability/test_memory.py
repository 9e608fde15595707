"""Calls too large for the memory raise DeviceMemoryError before allocating, instead of the process
being killed (MLX's CPU allocator), or waiting forever under `set_memory_limit`.

Each case runs in a child (see subproc.py) whose address space is capped at 2 GiB: were the check
to let a call through, the allocation would fail there (a crash or a hang the runner reports)
rather than take the machine's memory.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from pymlxc.testing import write_tiny_model

from .subproc import run_case

CAP = """
import resource
resource.setrlimit(resource.RLIMIT_AS, (2 << 30, resource.getrlimit(resource.RLIMIT_AS)[1]))
import pymlxc, pymlxc.core as mx
from pymlxc.backends.metal.memory_check import DeviceMemoryError, device_memory
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("memory") / "llama", "llama")


def test_generation_larger_than_memory_raises_and_the_model_goes_on(tiny: Path) -> None:
    """context_len=10**8, max_tokens=10**8 (a KV cache of ~51 GB for this model): the stream raises
    before its first token (and keeps the error for err()), naming the options and sizes; the model
    still works."""
    out = run_case(CAP + f"""
with pymlxc.load_model({str(tiny)!r}, backend="metal", context_len=10**8) as m:
    tokens, err = [], None
    try:
        for t in m.generate("The river town had a baker", max_tokens=10**8):
            tokens.append(t)
    except DeviceMemoryError as exc:
        err = exc
    kept = type(m.err()).__name__
    after = [t.id for t in m.generate("The river town had a baker", max_tokens=3)]
    report(dict(tokens=len(tokens), kind=type(err).__name__, memory=isinstance(err, MemoryError), kept=kept,
                message=str(err), after=len(after), after_err=repr(m.err()), limit=device_memory()))
""", timeout=120)
    assert out["tokens"] == 0 and out["kind"] == out["kept"] == "DeviceMemoryError" and out["memory"]
    assert "max_tokens=100000000" in out["message"] and "context_len=100000000" in out["message"]
    assert "GiB" in out["message"]
    assert out["after"] == 3 and out["after_err"] == "None"
    assert out["limit"] <= 2 << 30  # the address-space cap is one of the device's bounds


def test_calls_under_mlx_memory_limit_raise_instead_of_waiting(tiny: Path) -> None:
    """Under set_memory_limit(64 MiB): a long classify, a long inspect_attention with queries and a
    batch whose caches would reach ~0.5 GB raise DeviceMemoryError (they waited forever, or were
    killed); small calls still run."""
    out = run_case(CAP + f"""
mx.set_memory_limit(64 << 20)
result = dict(limit=device_memory())
with pymlxc.load_model({str(tiny)!r}, backend="metal", context_len=10**6) as m:
    long_text = "the baker of the river town " * 800
    for name, call in (("classify", lambda: m.classify([long_text])),
                       ("inspect", lambda: m.inspect_attention(list(range(16, 500)) * 12, include_queries=True))):
        try:
            call()
            result[name] = "no error"
        except DeviceMemoryError as exc:
            result[name] = str(exc)
    batch = m.batch_generate(["a baker", "the river"], max_tokens=10**6)
    result["batch"] = [r.error for r in batch]
    result["small"] = len(list(m.generate("a baker", max_tokens=4))) + len(m.classify(["a baker", "x"]))
report(result)
""", timeout=120)
    assert out["limit"] == 64 << 20
    assert "attention scores" in out["classify"] and "context_len=1000000" in out["classify"]
    assert "inspect_attention" in out["inspect"] and "returned arrays" in out["inspect"]
    assert all(e is not None and e.startswith("DeviceMemoryError") and "max_tokens=1000000" in e for e in out["batch"])
    assert out["small"] == 6

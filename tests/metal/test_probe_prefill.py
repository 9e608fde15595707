"""benchmarks/profile/probe_prefill.py on the CPU: a row per model and setting, each A/B asked for
with both sides' runs, the decode rate where more than one token is generated, and what the A/Bs
change (Python's switch interval, the caches' step, thread affinity) put back."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from pymlxc.backends.metal.cache import KVCache
from pymlxc.testing import write_tiny_model

PROFILE = Path(__file__).resolve().parents[2] / "benchmarks" / "profile"
sys.path.insert(0, str(PROFILE))
import probe_prefill  # noqa: E402 - a benchmark script, importable from its folder


def test_the_ab_flags_run_both_sides_and_leave_nothing_changed(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "tiny", hidden_size=64, num_layers=2)
    out = tmp_path / "probe.json"
    interval, affinity, step = sys.getswitchinterval(), os.sched_getaffinity(0), KVCache.step
    code = probe_prefill.main([str(model), "--lengths", "9", "--modes", "segmented", "--repeats", "2",
                               "--max-tokens", "3", "--switch-interval", "0", "1e-4", "--thread-ab",
                               "--exact-cache-ab", "--pin-ab", "--dequantize-kernel-ab", "--out", str(out)])
    assert code == 0
    rows = json.loads(out.read_text())
    assert [r["switch_interval_s"] for r in rows] == pytest.approx([interval, 1e-4])
    for row in rows:
        assert row["prompt"] == 9 and row["max_tokens"] == 3 and row["decode_tps"] > 0
        assert len(row["ttft_runs_ms"]) == 2
        for name in ("eval_thread", "exact_cache", "pinned", "prefill_dequantize_kernel"):
            ab = row[name]
            assert len(ab["on_runs_ms"]) == len(ab["off_runs_ms"]) == 2 and ab["on_ms"] > 0 and ab["off_ms"] > 0
        assert len(set(row["pinned"]["cores"])) == 2 or len(affinity) == 1
    assert sys.getswitchinterval() == interval and os.sched_getaffinity(0) == affinity
    assert KVCache.step == step

"""`pymlxc bench` on tiny models: the schema-1 record (benchmarks/BENCH_SCHEMA.md) and its checks."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from pymlxc.cli import main
from pymlxc.commands import bench as bench_command
from pymlxc.testing import write_tiny_model

SUMMARY = {"median", "min", "max"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("bench") / "qwen3", "qwen3", num_layers=2)


def test_json_record(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", str(model_dir), "--json", "--prompt-tokens", "24", "--max-tokens", "8", "--runs", "3"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["schema_version"] == 1 and record["kind"] == "bench"
    assert record["backend"] == "metal"
    assert record["model"]["architecture"] == "qwen3" and record["model"]["num_layers"] == 2
    assert 0 < record["prompt_tokens"] <= 24
    assert record["runs"] == 3 and record["generated_tokens"] == [8, 8, 8]
    for key in ("prefill_tokens_per_sec", "decode_tokens_per_sec", "ttft_seconds"):
        assert set(record[key]) == SUMMARY
        assert 0 < record[key]["min"] <= record[key]["median"] <= record[key]["max"]
    assert record["peak_memory_bytes"] >= record["active_memory_bytes"] > 0
    assert record["load_seconds"] > 0
    cache = record["prompt_cache"]
    assert cache["enabled"] and cache["hit_rate"] == 1.0 and cache["same_tokens"]
    assert cache["hit_tokens"] == record["prompt_tokens"] - 1 and cache["restore_seconds"] >= 0
    assert set(record["checks"]) == {"greedy_reproducible", "compiled_matches_uncompiled", "stop_tokens_respected",
                                     "chat_template_renders"}
    assert all(c["ok"] for c in record["checks"].values()), record["checks"]


def test_text_output(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", str(model_dir), "--prompt", "The baker counted the boats", "--max-tokens", "6",
                 "--runs", "3"]) == 0
    out = capsys.readouterr().out
    for line in ("model: qwen3", "prefill:", "decode:", "time to first token:", "memory: peak",
                 "prompt cache: hit rate", "check greedy_reproducible: ok", "check stop_tokens_respected: ok"):
        assert line in out, out


def test_failed_check_sets_the_status(model_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    """A check that does not hold makes the command fail (exit status 1) and says which."""
    real = bench_command._run
    calls = {"n": 0}

    def flaky(model, prompt, **options):  # a different first token on every other run
        ids, ttft, metrics = real(model, prompt, **options)
        calls["n"] += 1
        return ([ids[0] + calls["n"] % 2, *ids[1:]]), ttft, metrics

    monkeypatch.setattr(bench_command, "_run", flaky)
    assert main(["bench", str(model_dir), "--json", "--max-tokens", "4", "--runs", "3"]) == 1
    record = json.loads(capsys.readouterr().out)
    assert record["checks"]["greedy_reproducible"]["ok"] is False


def test_prompt_tokens_fit(model_dir: Path) -> None:
    from pymlxc.backends.metal import BACKEND

    with BACKEND.load(str(model_dir)) as model:
        for n in (1, 10, 100):
            text = bench_command._prompt_of_tokens(model, n)
            assert 0 < len(model.encode(text)) <= max(n, 2)

"""benchmarks/gpu_memory.py with a stand-in `nvidia-smi` (a script on PATH that lists processes as
the driver's tool does): the query's lines parse, with unknown values skipped and a process on two
GPUs summed; a command's peak is found by its process id; a failing command, a missing tool and a
tool that stops answering are errors that name them; compare_llama_cpp.py --peak-memory reports
each pymlxc side's peak, measured in processes of their own."""
from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))
import gpu_memory  # noqa: E402 - a benchmark script, importable from its folder

# Lists every process whose command line holds $FAKE_MATCH, with $FAKE_MIB MiB on two GPUs (half each),
# and a process the driver cannot measure; exits 3 once $FAKE_DIR/broken exists.
FAKE = """#!{python}
import os, sys
d = os.environ["FAKE_DIR"]
if os.path.exists(os.path.join(d, "broken")):
    sys.exit(3)
match = os.environ["FAKE_MATCH"].encode()
mib = int(os.environ["FAKE_MIB"])
print("123456789, [N/A]")
for pid in os.listdir("/proc"):
    if pid.isdigit() and pid != str(os.getpid()):
        try:
            cmd = open(f"/proc/{{pid}}/cmdline", "rb").read()
        except OSError:
            continue
        if match in cmd:
            print(f"{{pid}}, {{mib // 2}}")
            print(f"{{pid}}, {{mib - mib // 2}}")
"""


@pytest.fixture
def fake_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    tool = tmp_path / "bin" / "nvidia-smi"
    tool.parent.mkdir()
    tool.write_text(FAKE.format(python=sys.executable))
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{tool.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_DIR", str(tmp_path))
    monkeypatch.setenv("FAKE_MATCH", "gpu-memory-test-sleeper")
    monkeypatch.setenv("FAKE_MIB", "1235")
    return tool


def _sleeper(seconds: float = 0.6, code: int = 0) -> list[str]:
    return [sys.executable, "-c", f"import time, sys; time.sleep({seconds}); sys.exit({code})",
            "gpu-memory-test-sleeper"]


def test_the_query_parses(fake_smi: Path) -> None:
    import subprocess

    assert gpu_memory.process_memory() == {}  # nothing matches yet; the unmeasurable process is skipped
    sleeper = subprocess.Popen(_sleeper(30))
    try:
        assert gpu_memory.process_memory() == {sleeper.pid: 1235}  # its two GPUs' lines summed
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_command_s_peak_is_found_by_its_pid(fake_smi: Path) -> None:
    out, peak = gpu_memory.peak_of(_sleeper())
    assert out == "" and peak == 1235


def test_errors_name_what_failed(fake_smi: Path, tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=r"failed \(4\)"):
        gpu_memory.peak_of(_sleeper(0.1, 4))
    with pytest.raises(RuntimeError, match="not on PATH"):
        gpu_memory.peak_of(_sleeper(0.1), nvidia_smi="no-such-nvidia-smi")
    with pytest.raises(RuntimeError, match="ran past 1 s"):
        gpu_memory.peak_of(_sleeper(5), timeout=1)
    (tmp_path / "broken").touch()
    with pytest.raises(RuntimeError, match="stopped answering"):
        gpu_memory.peak_of(_sleeper(0.3))


def test_llama_bench_measures_prompt_and_tokens_in_one_context() -> None:
    cmd = gpu_memory.llama_bench_command(Path("/b"), Path("/m.gguf"), 2048, 256)
    assert cmd[0] == "/b/llama-bench" and cmd[cmd.index("-pg") + 1] == "2048,256"
    assert cmd[cmd.index("-p") + 1] == "0" and cmd[cmd.index("-n") + 1] == "0"


def test_compare_reports_each_side_s_peak(fake_smi: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import compare_llama_cpp

    monkeypatch.setenv("FAKE_MATCH", "gpu_memory.py")
    out = tmp_path / "out"
    rc = compare_llama_cpp.main(["--cpu", "--shapes", "llama-3.2-1b-narrow", "--layers", "1", "--no-llama-cpp",
                                 "--prompt-lengths", "8", "--max-tokens", "4", "--rounds", "1", "--formats", "q4_0",
                                 "--models-dir", str(tmp_path / "models"), "--out", str(out), "--peak-memory"])
    assert rc == 0
    case = json.loads((out / "compare_llama_cpp.json").read_text())["cases"][0]
    assert case["peak_gpu_mib"] == {"pymlxc_gguf": 1235, "pymlxc_native": 1235}
    assert "1235 / 1235 / -" in (out / "compare_llama_cpp.md").read_text()

"""Peak GPU memory of a process as the driver reports it: `nvidia-smi --query-compute-apps`, polled.

Both sides of a comparison are measured the same way, each in a process of its own (a generation's
whole footprint: CUDA context, weights, caches, activations, and what the allocator keeps): llama.cpp's
`llama-bench`, and pymlxc through this script's `generate` command, which loads one model and runs
one greedy generation after a prompt of N tokens.

    python benchmarks/gpu_memory.py generate MODEL --prompt-tokens 2048 --max-tokens 256
    # prints the generated token count; run under `peak_of(...)` for the process's peak MiB

`compare_llama_cpp.py --peak-memory` runs both and reports them side by side.
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

QUERY = ["--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]


def process_memory(nvidia_smi: str = "nvidia-smi", timeout: float = 10.0) -> dict[int, int]:
    """MiB of GPU memory per process id, from one query (processes on several GPUs summed)."""
    done = subprocess.run([nvidia_smi, *QUERY], capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{nvidia_smi} failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    out: dict[int, int] = {}
    for line in done.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 2 or not parts[0].isdigit():
            continue
        try:
            mib = int(parts[1])
        except ValueError:  # "[N/A]" where the driver cannot tell
            continue
        out[int(parts[0])] = out.get(int(parts[0]), 0) + mib
    return out


class PeakPoller:
    """Within: the largest memory nvidia-smi reported for each process, every `interval` seconds on
    a thread of its own. `peak(pid)`: MiB, or None where the process was never seen."""

    def __init__(self, interval: float = 0.05, nvidia_smi: str = "nvidia-smi") -> None:
        self.interval = interval
        self.nvidia_smi = nvidia_smi
        self._peaks: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpu-memory-poller", daemon=True)
        self.error: str | None = None

    def _run(self) -> None:
        while True:
            try:
                for pid, mib in process_memory(self.nvidia_smi).items():
                    self._peaks[pid] = max(mib, self._peaks.get(pid, 0))
            except (OSError, RuntimeError, subprocess.TimeoutExpired) as exc:
                self.error = f"{type(exc).__name__}: {exc}"
                return
            if self._stop.wait(self.interval):
                return

    def __enter__(self) -> PeakPoller:
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join()

    def peak(self, pid: int) -> int | None:
        return self._peaks.get(pid)


def peak_of(cmd: Sequence[str], timeout: float = 1800, nvidia_smi: str = "nvidia-smi") -> tuple[str, int | None]:
    """Run `cmd` to its end under a PeakPoller: (its stdout, its peak MiB or None where nvidia-smi
    never listed it). Raises RuntimeError naming the command where it fails, or where nvidia-smi
    cannot be run."""
    if shutil.which(nvidia_smi) is None:
        raise RuntimeError(f"{nvidia_smi} is not on PATH: peak GPU memory needs NVIDIA's driver tools")
    with PeakPoller(nvidia_smi=nvidia_smi) as poller:
        proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise RuntimeError(f"{' '.join(cmd)} ran past {timeout:.0f} s") from None
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {err[-2000:]}")
    if poller.error is not None:
        raise RuntimeError(f"{nvidia_smi} stopped answering: {poller.error}")
    return out, poller.peak(proc.pid)


def llama_bench_command(tools: Path, gguf: Path, prompt_tokens: int, max_tokens: int) -> list[str]:
    """llama-bench's one test of a prompt and the tokens after it in one context (`-pg`), as pymlxc's
    generation holds them: the context is prompt + generated tokens on both sides."""
    return [str(tools / "llama-bench"), "-m", str(gguf), "-p", "0", "-n", "0",
            "-pg", f"{prompt_tokens},{max_tokens}", "-ngl", "99", "-r", "1", "-o", "json"]


def pymlxc_command(model: Path, prompt_tokens: int, max_tokens: int) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "generate", str(model),
            "--prompt-tokens", str(prompt_tokens), "--max-tokens", str(max_tokens)]


def prompt_ids(config: Mapping[str, Any], n: int) -> list[int]:
    """The benchmark's prompt of `n` token ids for a model of `config` (seeded: the same every run)."""
    import numpy as np  # noqa: PLC0415

    vocab = int(config.get("vocab_size") or 32000)
    return [int(i) for i in np.random.default_rng(0).integers(min(1000, vocab // 2), min(vocab, 100000), n)]


def _generate(model: Path, prompt_tokens: int, max_tokens: int) -> int:
    """One greedy generation as compare_llama_cpp.py's pymlxc side runs it (compare_mlx_lm.Pymlxc)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from compare_mlx_lm import Pymlxc  # noqa: PLC0415 - the checkout as installed, through its _path

    side = Pymlxc()
    side.load(model)
    try:
        n = sum(1 for _ in side.stream(prompt_ids(side.loaded.config, prompt_tokens), max_tokens))
    finally:
        side.free()
    print(n, flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="load MODEL and run one greedy generation (for peak_of)")
    g.add_argument("model", type=Path)
    g.add_argument("--prompt-tokens", type=int, default=2048)
    g.add_argument("--max-tokens", type=int, default=256)
    args: Any = p.parse_args(argv)
    return _generate(args.model, args.prompt_tokens, args.max_tokens)


if __name__ == "__main__":
    raise SystemExit(main())

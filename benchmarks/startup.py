"""Start-up: from process start to the first generated token of `pymlxc generate` against
`mlx_lm generate`, both as a user runs them (a fresh Python process each), on the same tiny model.

Cases, each side in its own process, alternated over the runs:

* `pymlxc cold`: an empty user cache (`PYMLXC_CACHE_DIR` a new folder): the first run on a machine;
* `pymlxc warm`: the cache the cold run left (every later run);
* `pymlxc no cache`: `PYMLXC_CACHE_DIR=off` (what every run cost before the cache);
* `mlx_lm`: `python -m mlx_lm generate` (mlx-lm keeps no cache of its own; MLX's PTX cache, on
  CUDA, serves both sides alike).

The time is taken when the first byte of generated text reaches the pipe (mlx-lm's header line
skipped; both run with PYTHONUNBUFFERED=1 and stream tokens as they come), with one generated token, so
it is the time to the first token plus printing it. Medians over the runs.

    python benchmarks/startup.py                       # a tiny Llama written to a temporary folder
    python benchmarks/startup.py --model PATH --runs 7 --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def first_output(cmd: list[str], env: dict[str, str], skip_line: bytes | None, timeout: float) -> tuple[float, float]:
    """(seconds from spawn to the first byte of generated text, seconds to exit) of `cmd`;
    `skip_line`: a header line to skip before the text (mlx-lm's "=========="). Raises on failure."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    seen = b""
    first: float | None = None
    deadline = start + timeout
    try:
        while True:
            left = deadline - time.perf_counter()
            if left <= 0:
                raise TimeoutError(f"{' '.join(cmd)} gave no token within {timeout:.0f}s")
            ready, _, _ = select.select([proc.stdout], [], [], left)
            if not ready:
                continue
            chunk = os.read(proc.stdout.fileno(), 4096)
            if not chunk:
                break
            seen += chunk
            if first is None:
                text = seen
                if skip_line is not None:
                    _, sep, text = seen.partition(skip_line + b"\n")
                    if not sep:
                        text = b""
                if text:
                    first = time.perf_counter()
        err = proc.stderr.read() if proc.stderr else b""
        rc = proc.wait(timeout=max(deadline - time.perf_counter(), 1))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    end = time.perf_counter()
    if rc != 0 or first is None:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {rc}, output {seen[:200]!r}): {err.decode()[-2000:]}")
    return first - start, end - start


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="a model directory (default: a tiny random Llama)")
    p.add_argument("--prompt", default="Hello, how are you today?")
    p.add_argument("--runs", type=int, default=5, help="runs per case (medians)")
    p.add_argument("--cpu", action="store_true",
                   help="pymlxc generate --cpu (mlx-lm has no such switch: use on a machine whose default is the CPU)")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    args = p.parse_args(argv)
    if args.runs < 1:
        p.error("--runs must be >= 1")
    work = Path(tempfile.mkdtemp(prefix="pymlxc-startup-"))
    try:
        model = args.model
        if model is None:
            from pymlxc.testing import write_tiny_model

            model = write_tiny_model(work / "tiny-llama", "llama")
        pymlxc_cli = shutil.which("pymlxc") or ""
        ours = ([pymlxc_cli] if pymlxc_cli else [sys.executable, "-m", "pymlxc.cli"]) + [
            "generate", str(model), args.prompt, "--max-tokens", "1", "--temperature", "0", "-q"]
        if args.cpu:
            ours.append("--cpu")
        theirs = [sys.executable, "-m", "mlx_lm", "generate", "--model", str(model), "--prompt", args.prompt,
                  "--max-tokens", "1", "--temp", "0"]
        base = dict(os.environ, PYTHONUNBUFFERED="1")
        results: dict[str, dict[str, list[float]]] = {}

        def run(name: str, cmd: list[str], env: dict[str, str], skip: bytes | None) -> None:
            ttft, total = first_output(cmd, env, skip, args.timeout)
            r = results.setdefault(name, {"first_token_s": [], "exit_s": []})
            r["first_token_s"].append(ttft)
            r["exit_s"].append(total)

        for i in range(args.runs):
            cache = work / f"cache-{i}"  # a new empty cache each run: every cold run is a first run
            cases = {
                "pymlxc cold": (ours, dict(base, PYMLXC_CACHE_DIR=str(cache)), None),
                "pymlxc warm": (ours, dict(base, PYMLXC_CACHE_DIR=str(cache)), None),
                "pymlxc no cache": (ours, dict(base, PYMLXC_CACHE_DIR="off"), None),
                "mlx_lm": (theirs, base, b"=========="),
            }
            # The cold run must come before the warm one; the other two swap places run by run.
            order = (["pymlxc cold", "pymlxc warm", "pymlxc no cache", "mlx_lm"] if i % 2 == 0
                     else ["mlx_lm", "pymlxc no cache", "pymlxc cold", "pymlxc warm"])
            for name in order:
                run(name, *cases[name])
            print(f"run {i + 1}/{args.runs}: " + ", ".join(
                f"{n} {results[n]['first_token_s'][-1]:.2f}s" for n in results), flush=True)
        summary = {n: {k: statistics.median(v) for k, v in r.items()} for n, r in results.items()}
        ref = summary["mlx_lm"]["first_token_s"]
        where = platform.processor() or platform.machine()
        print(f"\nprocess start to first token, medians of {args.runs} runs ({where}, "
              f"{'CPU' if args.cpu else 'default device'}):")
        print("| side | first token s | minus mlx-lm s | exit s |\n|---|---:|---:|---:|")
        for n, s in summary.items():
            print(f"| {n} | {s['first_token_s']:.2f} | {s['first_token_s'] - ref:+.2f} | {s['exit_s']:.2f} |")
        if args.json is not None:
            args.json.write_text(json.dumps({"model": str(args.model or "tiny llama"), "runs": results,
                                             "medians": summary, "cpu": args.cpu}, indent=1) + "\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

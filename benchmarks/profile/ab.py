"""An A/B of settings, alternated on one machine: `probe_host_split.py` in a fresh process per case
and round, the cases in turn, so that a host that speeds up or slows down during the run moves every
case alike. What the A/B tables of docs/performance.md ("lever by lever") are made of.

Each case is a name and the environment it sets (`PYMLXC_*` settings, MLX's variables). Every
process gets `--timeout` seconds; one that fails or runs out of time is recorded with the end of
what it printed, and the others go on. The JSON has every run of every case (decode tok/s, host
time per token by part, a short hash of the tokens), each case's median, and whether every run
gave the same tokens.

    python benchmarks/profile/ab.py MODEL --case off PYMLXC_CUDA_ROPE_IN_PRODUCT=0 \\
        --case on PYMLXC_CUDA_ROPE_IN_PRODUCT=auto [--rounds 2] [--runs 2] [--max-tokens 256] \\
        [--timeout 120] --out ab.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

PROBE = Path(__file__).resolve().parent / "probe_host_split.py"


def parse_case(words: list[str]) -> tuple[str, dict[str, str]]:
    """(name, environment) from `NAME VAR=VALUE ...`; a word without `=` past the name is an error."""
    name, *assignments = words
    env: dict[str, str] = {}
    for a in assignments:
        var, sep, value = a.partition("=")
        if not sep or not var:
            raise ValueError(f"case {name!r}: {a!r} is not VAR=VALUE")
        env[var] = value
    return name, env


def run_case(model: Path, env: dict[str, str], runs: int, max_tokens: int, timeout: float) -> dict[str, Any]:
    """One process of probe_host_split.py under `env`: {"runs": [...]} and, where it failed or ran
    out of time, "error" (with what runs it finished)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "runs.json"
        cmd = [sys.executable, str(PROBE), str(model), "--runs", str(runs), "--max-tokens", str(max_tokens),
               "--json", str(out)]
        error = None
        try:
            done = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, timeout=timeout,
                                  check=False)
            if done.returncode != 0:
                error = f"exit status {done.returncode}: {(done.stderr or done.stdout)[-600:].strip()}"
        except subprocess.TimeoutExpired:
            error = f"no result within {timeout:g} s"
        found = json.loads(out.read_text()) if out.is_file() else []
    result: dict[str, Any] = {"runs": found}
    if error is not None:
        result["error"] = error
    return result


def _spread(values: list[float]) -> list[float]:
    """[least, most] of the runs that timed a part."""
    return [min(values), max(values)]


def summary(cases: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per case the median decode rate and the spread of host time per token; whether every run of
    every case gave the same tokens."""
    hashes = {r["tokens"] for c in cases.values() for p in c["processes"] for r in p["runs"]}
    out: dict[str, Any] = {"same_tokens": len(hashes) <= 1, "cases": {}}
    for name, c in cases.items():
        runs = [r for p in c["processes"] for r in p["runs"]]
        rates = [r["decode_tps"] for r in runs]
        parts = sorted({k for r in runs for k in r["us_per_token"]})
        out["cases"][name] = {
            "decode_tps": rates,
            "median": statistics.median(rates) if rates else None,
            "us_per_token": {k: _spread([r["us_per_token"][k] for r in runs if k in r["us_per_token"]])
                             for k in parts},
            "failed_processes": sum(1 for p in c["processes"] if "error" in p),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--case", nargs="+", action="append", required=True, metavar="NAME [VAR=VALUE ...]",
                        help="a case: its name and the environment it sets (give two or more)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--runs", type=int, default=2, help="generations per process")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per process")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    try:
        parsed = [parse_case(words) for words in args.case]
    except ValueError as exc:
        parser.error(str(exc))
    names = [n for n, _ in parsed]
    if len(set(names)) != len(names):
        parser.error(f"case names repeat: {', '.join(names)}")
    cases: dict[str, dict[str, Any]] = {n: {"env": env, "processes": []} for n, env in parsed}
    for round_ in range(1, args.rounds + 1):
        for name, env in parsed:
            process = run_case(args.model, env, args.runs, args.max_tokens, args.timeout)
            cases[name]["processes"].append({"round": round_, **process})
            rates = " ".join(f"{r['decode_tps']:.0f}" for r in process["runs"]) or "-"
            note = f"  ({process['error'].splitlines()[-1][:120]})" if "error" in process else ""
            print(f"round {round_} {name}: {rates} tok/s{note}", flush=True)
    report = {"model": str(args.model), "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
              "rounds": args.rounds, "runs": args.runs, "max_tokens": args.max_tokens, "cases": cases,
              "summary": summary(cases)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    for name, s in report["summary"]["cases"].items():
        median = f"{s['median']:.0f}" if s["median"] is not None else "-"
        print(f"{name}: median {median} tok/s over {len(s['decode_tps'])} runs")
    print("same tokens in every run" if report["summary"]["same_tokens"] else "the runs' tokens differ")
    return 0


if __name__ == "__main__":
    sys.exit(main())

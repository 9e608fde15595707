"""Prefill and decode tokens/s of one model split over N ranks, pymlxc against mlx-lm's sharded
generation on the same machine, in the same run.

    python benchmarks/compare_distributed.py MODEL [MODEL ...] --ranks 1 2 4 8 --backend nccl
    python benchmarks/compare_distributed.py --tiny --ranks 1 2          # CPU, ring over 127.0.0.1

For each model, rank count and mode (pymlxc: tensor and pipeline; mlx-lm: its tensor sharding,
`sharded_load(tensor_group=...)`, and its pipeline where the model supports it) the ranks run the
same greedy generation of --max-tokens after a --prompt-tokens prompt; rank 0 reports. One JSON
object per line on stdout, a table on stderr. Ranks are started by `pymlxc.launch.run_local` (one
machine: the ring over 127.0.0.1, or NCCL with one GPU per rank). The 8B/70B rows of the multi-GPU
issue are this script with the mlx-community 4-bit and bf16 checkpoints as MODEL.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pymlxc.launch import LaunchError, run_local  # noqa: E402

RANK = """
import json, sys, time
sys.path.insert(0, {tests!r}); import conftest  # noqa: F401 - the checkout's module names
side, model, mode, n_prompt, n_gen = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
prompt = " ".join(["hello"] * n_prompt)
if side == "pymlxc":
    import pymlxc
    with pymlxc.load_model(model, distributed=None if mode == "single" else mode) as m:
        list(m.generate(prompt, max_tokens=4))  # warm-up
        ids = [t.id for t in m.generate(prompt, max_tokens=n_gen)]
        r = m.metrics()
        out = dict(prefill=r.prefill_tokens_per_sec, decode=r.decode_tokens_per_sec, tokens=ids)
else:
    import mlx.core as mx
    from mlx_lm import stream_generate
    from mlx_lm.utils import load, sharded_load
    g = mx.distributed.init() if mode != "single" else None
    if mode == "single":
        lm, tok = load(model)
    else:
        lm, tok = sharded_load(model, pipeline_group=g if mode == "pipeline" else None,
                               tensor_group=g if mode == "tensor" else None)
    for _ in stream_generate(lm, tok, prompt, max_tokens=4):
        pass
    last, ids = None, []
    for last in stream_generate(lm, tok, prompt, max_tokens=n_gen):
        ids.append(int(last.token))
    out = dict(prefill=last.prompt_tps, decode=last.generation_tps, tokens=ids)
print("RESULT " + json.dumps(out), flush=True)
"""


def measure(side: str, model: str, mode: str, n: int, backend: str, prompt_tokens: int, max_tokens: int,
            timeout: float) -> dict[str, object]:
    code = RANK.format(tests=str(ROOT / "tests"))
    argv = [sys.executable, "-c", code, side, model, mode, str(prompt_tokens), str(max_tokens)]
    row: dict[str, object] = {"model": model, "side": side, "mode": mode, "ranks": n, "backend": backend}
    try:
        results = run_local(n, argv, backend=backend, timeout=timeout)
    except LaunchError as exc:
        row["error"] = str(exc).splitlines()[-1][:300]
        return row
    line = next(x for x in results[0].stdout.splitlines() if x.startswith("RESULT "))
    row.update(json.loads(line[len("RESULT "):]))
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="*", help="model directories (or repo ids mlx-lm and pymlxc both load)")
    ap.add_argument("--tiny", action="store_true", help="also a tiny random llama (4-bit), for a CPU smoke run")
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--backend", choices=("ring", "nccl"), default="ring")
    ap.add_argument("--modes", nargs="+", default=["tensor", "pipeline"], choices=("tensor", "pipeline"))
    ap.add_argument("--sides", nargs="+", default=["pymlxc", "mlx_lm"], choices=("pymlxc", "mlx_lm"))
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--timeout", type=float, default=1800)
    args = ap.parse_args()
    models = list(args.models)
    with tempfile.TemporaryDirectory() as tmp:
        if args.tiny:
            from pymlxc.testing import write_tiny_model  # noqa: PLC0415

            models.append(str(write_tiny_model(Path(tmp) / "tiny", "llama", quantize_bits=4, hidden_size=256,
                                               num_heads=8, num_kv_heads=8, intermediate_size=512, num_layers=8,
                                               vocab_size=1024)))
        if not models:
            ap.error("name a model, or --tiny")
        for model in models:
            single: dict[str, object] = {}  # side -> the one-rank run's greedy tokens
            for n in args.ranks:
                for side in args.sides:
                    for mode in (["single"] if n == 1 else args.modes):
                        row = measure(side, model, mode, n, args.backend, args.prompt_tokens, args.max_tokens,
                                      args.timeout)
                        if mode == "single" and "tokens" in row:
                            single[side] = row["tokens"]
                        elif "tokens" in row and side in single:
                            # Greedy tokens of the split run against the one-rank run of the same side.
                            row["tokens_equal_single"] = row["tokens"] == single[side]
                        print(json.dumps(row), flush=True)
                        got = (f"prefill {row['prefill']:9.1f} tok/s  decode {row['decode']:8.1f} tok/s"
                               if "error" not in row else f"error: {row['error']}")
                        if "tokens_equal_single" in row:
                            got += f"  tokens {'equal' if row['tokens_equal_single'] else 'DIFFER'} to one rank's"
                        print(f"{Path(model).name:>24} {side:>7} {mode:>8} x{n}  {got}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Load test of OpenAI-compatible servers: N concurrent streaming clients on loopback.

For each server (`pymlxc serve` and `mlx_lm.server` on the same model, started here one after the
other) and each N, every client streams one `/v1/completions` request (greedy, its own prompt,
`--max-tokens` tokens) at once; reported: total generated tok/s over the wall time (tokens as each
server's `usage` counts them), time to first token (p50/p99) and inter-token latency (p50/p99, the
gaps between a request's streamed chunks; `tokens_per_chunk` says how many tokens a chunk held).
Every request bans the model's end-of-sequence ids (logit_bias -100; `--allow-eos` does not), so
every request runs to `--max-tokens` on both servers, whatever the two sides' numerics pick: a
round whose requests end early would be a lighter load.

    python benchmarks/serve_load.py --model DIR [--clients 1,4,16,64] [--max-tokens 64] [--out results.json]
    python benchmarks/serve_load.py --model DIR --tiny   # writes a tiny random llama to DIR first
    python benchmarks/serve_load.py --model DIR --shape qwen3.5-35b-a3b-narrow   # a random model of that shape
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

try:
    import httpx
except ImportError:  # the openai client's HTTP library under its newer name
    import httpx2 as httpx  # type: ignore[no-redef]

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "rivers", "run", "to",
         "the", "sea", "under", "grey", "skies"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# `python -m pymlxc.server` where the checkout is not pip-installed (a GPU machine): the server's
# process imports the checkout as installed first (benchmarks/_path.py).
SERVER = ("import sys; sys.path.insert(0, {here!r}); import _path; "
          "from pymlxc.server.main import main; sys.exit(main(sys.argv[1:]))")


def _command(kind: str, model: str, port: int, clients: int) -> list[str]:
    if kind == "pymlxc":
        return [sys.executable, "-c", SERVER.format(here=str(Path(__file__).resolve().parent)), model,
                "--port", str(port), "--max-concurrency", str(clients), "--max-queue", str(clients),
                "--max-tokens-limit", "100000"]
    return [sys.executable, "-m", "mlx_lm", "server", "--model", model, "--port", str(port),
            "--decode-concurrency", str(clients), "--prompt-concurrency", str(clients)]


def _start(kind: str, model: str, clients: int, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    out = open(log, "wb")  # noqa: SIM115 - lives as long as the process
    started = time.monotonic()
    process = subprocess.Popen(_command(kind, model, port, clients), stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = started + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{kind} server exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                print(f"{kind} server answered after {time.monotonic() - started:.1f} s (load and warm-up)", flush=True)
                return process, url
        except httpx.HTTPError:
            time.sleep(0.3)
    process.kill()
    raise RuntimeError(f"{kind} server did not start")


def end_of_sequence_ids(model: str) -> list[int]:
    """The model folder's end-of-sequence ids (config.json and generation_config.json), [] where
    it names none (a repo id, a GGUF file)."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        path = Path(model) / name
        if not path.is_file():
            continue
        value = json.loads(path.read_text()).get("eos_token_id")
        for i in value if isinstance(value, list) else [value]:
            if isinstance(i, int):
                ids.add(i)
    return sorted(ids)


async def _client(http: Any, url: str, prompt: str, max_tokens: int, bias: dict[str, float]) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "default_model", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                            "stream": True, "stream_options": {"include_usage": True}}
    if bias:
        body["logit_bias"] = bias
    start = time.perf_counter()
    stamps: list[float] = []
    usage = None
    async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk.get("choices") and chunk["choices"][0].get("finish_reason") is None:
                stamps.append(time.perf_counter())
    # Tokens as the server counts them (usage): a server may hold a token's bytes back until they
    # decode to whole characters and send several tokens in one chunk (random weights pick byte
    # tokens that split characters), so chunks undercount its tokens.
    tokens = int(usage["completion_tokens"]) if usage and "completion_tokens" in usage else len(stamps)
    return {"ttft": stamps[0] - start if stamps else float("nan"), "tokens": tokens, "chunks": len(stamps),
            "gaps": [b - a for a, b in itertools.pairwise(stamps)]}


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


async def _round(url: str, clients: int, max_tokens: int, prompt_words: int, tag: str,
                 bias: dict[str, float] | None = None) -> dict[str, Any]:
    """One round of `clients` streams at once; `tag` starts every prompt, so that no round reuses
    another's prompts from a server's prompt cache. `bias`: every request's logit_bias."""
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        prompts = [f"{tag} client {i}: " + " ".join(WORDS[(i + j) % len(WORDS)] for j in range(prompt_words))
                   for i in range(clients)]
        start = time.perf_counter()
        results = await asyncio.gather(*(_client(http, url, p, max_tokens, bias or {}) for p in prompts))
        wall = time.perf_counter() - start
    tokens = sum(r["tokens"] for r in results)
    ttfts = [r["ttft"] for r in results]
    gaps = [g for r in results for g in r["gaps"]]
    # TTFT and ITL are per chunk (what a client sees); tokens_per_chunk above 1 says chunks merged tokens.
    return {"clients": clients, "tokens": tokens, "tokens_per_chunk": tokens / max(1, sum(r["chunks"] for r in results)),
            "wall_s": wall, "tok_per_s": tokens / wall,
            "ttft_p50_ms": 1e3 * _pct(ttfts, 0.5), "ttft_p99_ms": 1e3 * _pct(ttfts, 0.99),
            "itl_p50_ms": 1e3 * _pct(gaps, 0.5), "itl_p99_ms": 1e3 * _pct(gaps, 0.99)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--tiny", action="store_true", help="write a tiny random llama to --model first")
    parser.add_argument("--shape", default=None,
                        help="write a random model of this shape (pymlxc/testing/shapes.py, float32) with a byte-level "
                             "tokenizer to --model first")
    parser.add_argument("--clients", default="1,4,16,64")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-words", type=int, default=32)
    parser.add_argument("--servers", default="pymlxc,mlx_lm")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    parser.add_argument("--warm-rounds", type=int, choices=(0, 1), default=1,
                        help="1: an untimed round at each client count before its timed one (its rate and TTFT "
                             "are kept as first_round)")
    parser.add_argument("--allow-eos", action="store_true",
                        help="let requests end at the end-of-sequence token (by default every request bans it "
                             "with logit_bias -100, so that both servers generate --max-tokens for every client)")
    args = parser.parse_args()
    if args.tiny:
        from pymlxc.testing import write_tiny_model

        write_tiny_model(args.model, "llama", seed=0, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4,
                         intermediate_size=512, vocab_size=1024)
    if args.shape:
        from pymlxc.testing.shapes import shape_config, write_byte_tokenizer, write_random_model

        write_random_model(args.model, args.shape, dtype="float32")
        write_byte_tokenizer(args.model, shape_config(args.shape))
    counts = [int(n) for n in args.clients.split(",")]
    bias = {} if args.allow_eos else {str(i): -100.0 for i in end_of_sequence_ids(args.model)}
    if bias:
        print(f"every request bans the end-of-sequence ids {sorted(map(int, bias))} (logit_bias -100)", flush=True)
    rows = []
    logs = Path(os.environ.get("TMPDIR", "/tmp"))
    for kind in args.servers.split(","):
        process, url = _start(kind, args.model, max(counts), logs / f"serve_load_{kind}.log")
        try:
            asyncio.run(_round(url, 1, 8, 8, "Warm-up", bias))  # warm-up: compiled paths, allocator
            for n in counts:
                try:
                    first = None
                    if args.warm_rounds:
                        # The first round at a client count pays what a server does once per batch
                        # size (compilations, allocations): reported apart, then the timed round.
                        first = asyncio.run(_round(url, n, args.max_tokens, args.prompt_words, f"First round of {n}",
                                                   bias))
                    row = {"server": kind, **asyncio.run(_round(url, n, args.max_tokens, args.prompt_words,
                                                                 f"Timed round of {n}", bias))}
                    if first is not None:
                        row["first_round"] = {k: first[k] for k in ("tok_per_s", "ttft_p50_ms", "ttft_p99_ms")}
                except (httpx.HTTPError, RuntimeError) as exc:  # a server that drops connections under load
                    rows.append({"server": kind, "clients": n, "error": f"{type(exc).__name__}: {exc}"})
                    print(f"{kind:7s} N={n:3d}  failed: {type(exc).__name__}: {exc}", flush=True)
                    continue
                rows.append(row)
                cold = (f"  (first round {first['tok_per_s']:.1f} tok/s, TTFT p99 {first['ttft_p99_ms']:.0f} ms)"
                        if first is not None else "")
                print(f"{kind:7s} N={n:3d}  {row['tok_per_s']:8.1f} tok/s  TTFT p50 {row['ttft_p50_ms']:7.1f} ms "
                      f"p99 {row['ttft_p99_ms']:7.1f} ms  ITL p50 {row['itl_p50_ms']:6.1f} ms "
                      f"p99 {row['itl_p99_ms']:6.1f} ms  {row['tokens_per_chunk']:.2f} tok/chunk{cold}", flush=True)
        finally:
            process.terminate()
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                process.kill()
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where a token's time goes on this device, measured piece by piece (host against device, on any device).

Five probes, each printed and written to `probe_decode.json`:

* `primitives`: MLX's host cost per operation. A chain of N small operations is built, handed to
  `async_eval` (MLX encodes the kernels) and waited for, through mlx.core and through pymlxc. If
  encoding one operation costs more than running it, a decode step is bound by its operation count.
* `attention`: one decode attention over keys that are a prefix of a preallocated buffer, by buffer
  length. MLX's CUDA backend sends such a call to cuDNN when the buffer length is a multiple of 256
  (`use_cudnn_for_decoding`) and to its own `sdpa_vector` kernel otherwise.
* `timeline`: per decode token, the time spent building and queueing the next step (host) and
  waiting for the token (device), for mlx-lm's loop and pymlxc's decode modes, each with and
  without the evaluation thread (`pymlxc.core.eval_thread`).
* `ttft`: time to first token split into prefill, decode setup and the first step.
* `memory`: peak memory above the weights after prefill alone and after prefill and decode, for
  mlx-lm and pymlxc's paths (with and without the thread).

    python benchmarks/profile/probe_decode.py --out DIR [--shape llama-3.2-1b --quant bf16]
"""
from __future__ import annotations

import _path  # noqa: F401 - the checkout as installed

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import mlx.core as mlx

import pymlxc.core as pmx
from pymlxc import settings as pymlxc_settings
from pymlxc.backends.metal import generate as loops
from pymlxc.backends.metal.decode.decoder import CompiledDecoder
from pymlxc.backends.metal.loader import load_weights_and_config
from pymlxc.backends.metal.sample import greedy
from pymlxc.core import eval_thread

from _timing import time_chain
from compare_mlx_lm import model_dir


def _ms(values: list[float]) -> float:
    return round(statistics.median(values) * 1e3, 4)


# ---------------------------------------------------------------------- primitives

def primitives(n: int = 400, repeats: int = 5) -> dict[str, Any]:
    out: dict[str, Any] = {}

    def chain(lib: Any, make: Callable[[], Any], op: Callable[[Any], Any], count: int) -> dict[str, Any]:
        x = make()
        lib.eval(x)
        return time_chain(lib, x, op, count, repeats)

    out["mlx_add"] = chain(mlx, lambda: mlx.zeros((1, 2048), dtype=mlx.bfloat16), lambda y: y + 1.0, n)
    # A compiled silu(y) * y * 1.5: one fused node (a JIT kernel MLX names per call), or three plain
    # ones when traced in MLX's "no_fuse" compile mode.
    for mode in ("enabled", "no_fuse"):
        fn = pmx.compile(lambda xs: [pmx.sigmoid(xs[0]) * xs[0] * 1.5])
        pmx.set_compile_mode(mode)
        try:
            fn([pmx.zeros((1, 2048), dtype=pmx.bfloat16)])  # traced now, in this mode
        finally:
            pmx.set_compile_mode("enabled")
        out[f"pymlxc_compiled_{mode}"] = chain(pmx, lambda: pmx.zeros((1, 2048), dtype=pmx.bfloat16),
                                               lambda y, fn=fn: fn.call_flat([y])[0], n)
    out["pymlxc_add"] = chain(pmx, lambda: pmx.zeros((1, 2048), dtype=pmx.bfloat16), lambda y: y + 1.0, n)
    w = mlx.random.normal((2048, 2048)).astype(mlx.bfloat16) * 0.01
    mlx.eval(w)
    out["mlx_matvec"] = chain(mlx, lambda: mlx.ones((1, 2048), dtype=mlx.bfloat16), lambda y: y @ w, n // 4)
    return out


# ---------------------------------------------------------------------- attention

def attention(keys: list[int], extras: list[int], layers: int = 16, repeats: int = 20,
              heads: tuple[int, int, int] = (32, 8, 64)) -> list[dict[str, Any]]:
    """Decode attention (`heads`: query heads, kv heads, head dim; bf16) over `k` keys held in a
    buffer of length round_up(k, 256) + extra, `layers` calls per eval."""
    hq, hkv, d = heads
    rows = []
    for k in keys:
        for extra in extras:
            length = -(-k // 256) * 256 + extra
            kb = mlx.random.normal((1, hkv, length, d)).astype(mlx.bfloat16)
            vb = mlx.random.normal((1, hkv, length, d)).astype(mlx.bfloat16)
            q = mlx.random.normal((1, hq, 1, d)).astype(mlx.bfloat16)
            mlx.eval(kb, vb, q)
            ks, vs = kb[:, :, :k, :], vb[:, :, :k, :]

            def run() -> None:
                outs = [mlx.fast.scaled_dot_product_attention(q, ks, vs, scale=0.125) for _ in range(layers)]
                mlx.eval(outs)

            run()
            times = []
            for _ in range(repeats):
                t = time.perf_counter()
                run()
                times.append(time.perf_counter() - t)
            rows.append({"heads": hq, "kv_heads": hkv, "head_dim": d, "keys": k, "buffer": length,
                         "us_per_call": _ms(times) * 1e3 / layers})
            print(f"  attention heads {hq}/{hkv} dim {d:3d} keys {k:5d} buffer {length:5d}: "
                  f"{rows[-1]['us_per_call']:8.1f} us/call", flush=True)
    return rows


# ---------------------------------------------------------------------- timelines

class _Clock:
    """Accumulates the time spent in pymlxc's async_eval (MLX's encoding of the queued step), on the
    caller's thread or on the evaluation thread (there it overlaps the caller's building)."""

    def __init__(self) -> None:
        self.encode = 0.0
        self._orig = pmx.async_eval

    def __enter__(self) -> "_Clock":
        orig = self._orig

        def timed(*args: Any) -> Any:
            t = time.perf_counter()
            try:
                return orig(*args)
            finally:
                self.encode += time.perf_counter() - t

        pmx.async_eval = timed
        eval_thread.async_eval = timed  # what the evaluation thread calls
        return self

    def __exit__(self, *exc: Any) -> None:
        pmx.async_eval = self._orig
        eval_thread.async_eval = self._orig


def _consume(stream: Iterator[Any], item: Callable[[Any], int], clock: _Clock | None) -> dict[str, Any]:
    host, wait, encode = [], [], []
    tokens = []
    while True:
        e0 = clock.encode if clock else 0.0
        t0 = time.perf_counter()
        arr = next(stream, None)
        t1 = time.perf_counter()
        if arr is None:
            break
        tokens.append(item(arr))
        t2 = time.perf_counter()
        host.append(t1 - t0)
        wait.append(t2 - t1)
        encode.append((clock.encode - e0) if clock else 0.0)
    # The first entries hold the first step (and setup): the steady state is what follows.
    host, wait, encode = host[2:], wait[2:], encode[2:]
    step = [h + w for h, w in zip(host, wait)]
    return {"tokens": len(tokens), "step_ms": _ms(step), "host_ms": _ms(host), "encode_ms": _ms(encode),
            "wait_ms": _ms(wait), "tok_s": round(1.0 / statistics.median(step), 1), "ids": tokens}


def pymlxc_timeline(loaded: Any, decoder: CompiledDecoder | None, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    model = loaded.model
    cache = model.make_cache(None)
    tokens = pmx.array([prompt], dtype=pmx.int32)
    if decoder is not None:
        decoder.reserve(cache, len(prompt), max_tokens)
    loops.prefill(model, tokens[:, :-1], cache)
    pmx.eval([c.state for c in cache])

    def uncompiled() -> Iterator[Any]:
        return loops.decode(loops.make_step(model, cache, greedy), tokens[:, -1:], max_tokens)

    with _Clock() as clock:
        if decoder is None:
            stream = uncompiled()
        else:
            stream = decoder.decode(cache, tokens[:, -1:], max_tokens, sampler=greedy, fallback=uncompiled)
        return _consume(stream, lambda a: a.item(), clock)


def mlx_lm_timeline(model: Any, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    p = mlx.array(prompt)
    model(p[None, :-1], cache=cache)
    mlx.eval([c.state for c in cache])
    clock = {"encode": 0.0}

    def step(y: Any) -> Any:
        logits = model(y.reshape(1, 1), cache=cache)[:, -1, :]
        logprobs = logits - mlx.logsumexp(logits, keepdims=True)  # as mlx-lm's generate_step
        return mlx.argmax(logprobs, axis=-1)

    def stream() -> Iterator[Any]:
        y = step(p[-1:])
        mlx.async_eval(y)
        for n in range(max_tokens):
            nxt = None
            if n + 1 < max_tokens:
                nxt = step(y)
                t = time.perf_counter()
                mlx.async_eval(nxt)
                clock["encode"] += time.perf_counter() - t
            yield y
            if nxt is None:
                return
            y = nxt

    class _C:
        @property
        def encode(self) -> float:
            return clock["encode"]

    return _consume(stream(), lambda a: a.item(), _C())  # type: ignore[arg-type]


def timelines(path: Path, prompts: list[int], max_tokens: int, runs: int,
              only: list[str] | None = None) -> list[dict[str, Any]]:
    from mlx_lm.utils import load_model

    loaded = load_weights_and_config(path)
    lm_model, _ = load_model(path)
    vocab = loaded.config["vocab_size"]
    rows = []
    variants: list[tuple[str, Callable[[list[int]], dict[str, Any]]]] = []
    decoders = {m: CompiledDecoder(loaded.model, m) for m in ("segmented", "graph")}

    def threaded(flag: str, fn: Callable[[list[int]], dict[str, Any]]) -> Callable[[list[int]], dict[str, Any]]:
        def run(p: list[int]) -> dict[str, Any]:
            with pymlxc_settings.override(eval_thread=flag):
                return fn(p)
        return run

    variants.append(("mlx_lm", lambda p: mlx_lm_timeline(lm_model, p, max_tokens)))
    for name, dec in (*decoders.items(), ("uncompiled", None)):
        for flag, suffix in (("1", ""), ("0", "_nothread")):
            variants.append((f"pymlxc_{name}{suffix}",
                             threaded(flag, lambda p, dec=dec: pymlxc_timeline(loaded, dec, p, max_tokens))))
    if only:
        variants = [v for v in variants if v[0] in only]
    for plen in prompts:
        prompt = [(i * 7919 + 13) % (vocab - 1) + 1 for i in range(plen)]
        for name, fn in variants:
            fn(prompt)  # warm-up: traces and kernels
            results = [fn(prompt) for _ in range(runs)]
            best = min(results, key=lambda r: r["step_ms"])
            row = {"variant": name, "prompt": plen, **{k: v for k, v in best.items() if k != "ids"},
                   "tok_s_runs": [r["tok_s"] for r in results]}
            rows.append(row)
            print(f"  p{plen:<5d} {name:30s} {row['tok_s']:7.1f} tok/s  step {row['step_ms']:.3f} ms = host "
                  f"{row['host_ms']:.3f} + wait {row['wait_ms']:.3f}; MLX encode {row['encode_ms']:.3f} "
                  f"(threaded: on the thread, beside the host time)  runs {row['tok_s_runs']}", flush=True)
    for d in decoders.values():
        d.close()
    loaded.free()
    return rows


# ---------------------------------------------------------------------- time to first token

def ttft(path: Path, plen: int, max_tokens: int, runs: int) -> list[dict[str, Any]]:
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    loaded = load_weights_and_config(path)
    lm_model, _ = load_model(path)
    vocab = loaded.config["vocab_size"]
    prompt = [(i * 7919 + 13) % (vocab - 1) + 1 for i in range(plen)]
    decoders: dict[str, CompiledDecoder | None] = {
        "segmented": CompiledDecoder(loaded.model, "segmented"), "graph": CompiledDecoder(loaded.model, "graph"),
        "uncompiled": None}
    rows = []

    def pymlxc_once(decoder: CompiledDecoder | None) -> dict[str, float]:
        model = loaded.model
        t0 = time.perf_counter()
        cache = model.make_cache(None)
        tokens = pmx.array([prompt], dtype=pmx.int32)
        runner = None
        if decoder is not None:
            decoder.reserve(cache, len(prompt), max_tokens)
            runner = decoder.prefill_runner(True)  # the segmented decode's compiled prefill (None for the graph)
        loops.prefill(model, tokens[:, :-1], cache, runner=runner)
        t1 = time.perf_counter()
        pmx.eval([c.state for c in cache])
        t2 = time.perf_counter()

        def uncompiled() -> Iterator[Any]:
            return loops.decode(loops.make_step(model, cache, greedy), tokens[:, -1:], max_tokens)

        stream = uncompiled() if decoder is None else decoder.decode(
            cache, tokens[:, -1:], max_tokens, sampler=greedy, fallback=uncompiled)
        first = next(stream)
        t3 = time.perf_counter()
        first.item()
        t4 = time.perf_counter()
        stream.close()
        return {"prefill_build": t1 - t0, "prefill_wait": t2 - t1, "first_steps_build": t3 - t2,
                "first_wait": t4 - t3, "total": t4 - t0}

    def mlx_lm_once() -> dict[str, float]:
        t0 = time.perf_counter()
        cache = make_prompt_cache(lm_model)
        p = mlx.array(prompt)
        lm_model(p[None, :-1], cache=cache)
        t1 = time.perf_counter()
        mlx.eval([c.state for c in cache])
        t2 = time.perf_counter()

        def step(y: Any) -> Any:
            logits = lm_model(y.reshape(1, 1), cache=cache)[:, -1, :]
            return mlx.argmax(logits - mlx.logsumexp(logits, keepdims=True), axis=-1)

        y = step(p[-1:])
        mlx.async_eval(y)
        nxt = step(y)
        mlx.async_eval(nxt)
        t3 = time.perf_counter()
        y.item()
        t4 = time.perf_counter()
        mlx.eval(nxt)
        return {"prefill_build": t1 - t0, "prefill_wait": t2 - t1, "first_steps_build": t3 - t2,
                "first_wait": t4 - t3, "total": t4 - t0}

    sides: list[tuple[str, Callable[[], dict[str, float]]]] = [("mlx_lm", mlx_lm_once)]
    sides += [(f"pymlxc_{k}", (lambda d=d: pymlxc_once(d))) for k, d in decoders.items()]
    for name, fn in sides:
        fn()
        fn()
        results = [fn() for _ in range(runs)]
        row = {"side": name, "prompt": plen, **{k: _ms([r[k] for r in results]) for k in results[0]}}
        rows.append(row)
        print(f"  ttft p{plen} {name:22s} " + "  ".join(f"{k} {row[k]:.2f}" for k in results[0]) + " (ms)", flush=True)
    for d in decoders.values():
        if d is not None:
            d.close()
    loaded.free()
    return rows


# ---------------------------------------------------------------------- memory

def memory(path: Path, plen: int, tokens: int) -> list[dict[str, Any]]:
    """Peak memory above the resident weights, after prefill and after `tokens` decode steps, per
    side: where a side's extra memory comes from."""
    import gc

    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    loaded = load_weights_and_config(path)
    lm_model, _ = load_model(path)
    vocab = loaded.config["vocab_size"]
    prompt = [(i * 7919 + 13) % (vocab - 1) + 1 for i in range(plen)]
    rows = []

    def measure(name: str, prefill: Callable[[], Any], decode: Callable[[Any], Any], split: bool = True) -> None:
        for _ in range(2):  # the second run is reported (the first makes kernels and traces)
            gc.collect()
            mlx.clear_cache()
            base = mlx.get_active_memory()
            mlx.reset_peak_memory()
            state = prefill()
            after_prefill = mlx.get_peak_memory() - base
            decode(state)
            total = mlx.get_peak_memory() - base
            del state
        row = {"side": name, "prompt": plen, "total_peak_mb": round(total / 2**20, 1)}
        if split:
            row["prefill_peak_mb"] = round(after_prefill / 2**20, 1)
        rows.append(row)
        first = f"prefill peak {row['prefill_peak_mb']:8.1f} MB, " if split else ""
        print(f"  memory p{plen} {name:36s} {first}peak {row['total_peak_mb']:8.1f} MB", flush=True)

    def lm_prefill() -> Any:
        cache = make_prompt_cache(lm_model)
        p = mlx.array(prompt)
        lm_model(p[None, :-1], cache=cache)
        mlx.eval([c.state for c in cache])
        return cache

    def lm_decode(cache: Any) -> None:
        y = mlx.array(prompt[-1:])
        for _ in range(tokens):
            logits = lm_model(y.reshape(1, 1), cache=cache)[:, -1, :]
            nxt = mlx.argmax(logits - mlx.logsumexp(logits, keepdims=True), axis=-1)
            mlx.async_eval(nxt)
            y.item()  # as generate_step: read token n while step n+1 runs
            y = nxt
        mlx.eval(y)

    measure("mlx_lm", lm_prefill, lm_decode)
    for mode, flag in (("segmented", "1"), ("segmented", "0"), (None, "0")):
        decoder = CompiledDecoder(loaded.model, mode) if mode else None
        name = f"pymlxc_{mode or 'uncompiled'}" + ("" if flag == "1" else "_nothread")
        thread_setting = pymlxc_settings.override(eval_thread=flag)  # until this variant's end
        thread_setting.__enter__()

        def run_all(_: Any = None, decoder: CompiledDecoder | None = decoder) -> Any:
            model = loaded.model
            cache = model.make_cache(None)
            return list(loops.generate_ids(model, prompt, cache=cache, sampler=greedy, max_tokens=tokens,
                                           decoder=decoder))

        def pm_prefill(decoder: CompiledDecoder | None = decoder) -> Any:
            model = loaded.model
            cache = model.make_cache(None)
            if decoder is not None:
                decoder.reserve(cache, len(prompt), tokens)
            loops.prefill(model, pmx.array([prompt[:-1]], dtype=pmx.int32), cache)
            pmx.eval([c.state for c in cache])
            return cache

        measure(name + "_prefill_only", pm_prefill, lambda state: None)
        measure(name, lambda: 0, run_all, split=False)  # a whole generation (its own prefill)
        if decoder is not None:
            decoder.close()
        thread_setting.__exit__(None, None, None)
    loaded.free()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-3.2-1b")
    ap.add_argument("--quant", default="bf16")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--prompts", type=int, nargs="+", default=[128, 2048])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--probes", nargs="+", default=["primitives", "attention", "ttft", "timeline", "memory"])
    ap.add_argument("--variants", nargs="+", default=None,
                    help="timeline variants to run (default all: mlx_lm, pymlxc_<segmented|graph|uncompiled>"
                         "[_nothread])")
    ap.add_argument("--models-dir", type=Path, default=Path("/tmp/pymlxc-bench-models"))
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--switch-interval", type=float, default=None,
                    help="sys.setswitchinterval for the run (seconds): how soon a thread waiting for the GIL gets it")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    if args.cpu:
        mlx.set_default_device(mlx.cpu)
        pmx.set_default_device(pmx.cpu)
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"device": str(mlx.default_device()), "env": {k: v for k, v in os.environ.items()
                                                                           if k.startswith(("MLX_", "PYMLXC_"))}}
    path = model_dir(args.models_dir, args.shape, args.quant, args.layers)
    for probe in args.probes:
        print(f"== {probe}", flush=True)
        if probe == "primitives":
            report[probe] = primitives(n=40 if args.cpu else 400)
            for k, v in report[probe].items():
                print(f"  {k:12s} " + "  ".join(f"{kk} {vv:.2f}" for kk, vv in v.items()), flush=True)
        elif probe == "attention":
            report[probe] = [row for heads in ((32, 8, 64), (32, 8, 128))  # Llama-3.2-1B's and Llama-3.1-8B's
                             for row in attention([300, 2048], [0, 8], repeats=3 if args.cpu else 20, heads=heads)]
        elif probe == "ttft":
            report[probe] = ttft(path, args.prompts[0], args.max_tokens, args.runs)
        elif probe == "memory":
            report[probe] = memory(path, args.prompts[-1], 64)
        elif probe == "timeline":
            report[probe] = timelines(path, args.prompts, args.max_tokens, args.runs, args.variants)
        (args.out / "probe_decode.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

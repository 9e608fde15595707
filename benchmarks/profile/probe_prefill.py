"""Prefill alone, per model file and decode mode: time to the first token of a greedy generation
(`compare_mlx_lm.timed_run`, one token) after prompts of each length, medians of --repeats runs
after a warm-up, for the compiled decoder in each --modes (its prefill runner applies in
"segmented") and without it ("off": the model's forward op by op).

What it answers: where a GGUF file's prefill loses against the native format of the same shape (the
block layers, the group-32 products, or the compiled segments that do not trace for them).

    python benchmarks/profile/probe_prefill.py MODEL [MODEL ...] [--lengths 128 2048] [--modes segmented off]
        [--dense-min-rows 512 128]   # each threshold of the dense prefill products (nn.DENSE_MIN_ROWS)
        [--lead 1 2]                 # each lead of the host over the device (generate.PREFILL_LEAD_LAYERS)
        [--switch-interval 0 1e-4]   # each of Python's thread switch intervals (sys.setswitchinterval;
                                     # 0: the interpreter's own)
        [--max-tokens 256]           # generate this many tokens a run (default 1): decode tok/s too
        [--keep-cache]               # MLX's buffer cache kept between runs (llama-bench keeps its buffers)
        [--split [--profile 25]]     # the compiled prefill's host split (below); cProfile of its build
        [--dtype auto float16]       # each compute dtype asked for at load (LoadConfig.dtype)
        [--fused-ab]                 # segmented: the compiled prefill with its fused products and
                                     # without (PYMLXC_PREFILL_FUSED_PRODUCTS), runs interleaved
        [--dequantized-ab]           # segmented: quantized products dequantized for dense matmuls and
                                     # not (PYMLXC_PREFILL_DEQUANTIZED), runs interleaved
        [--dequantize-kernel-ab]     # segmented, dequantizing: the weights dequantized before each
                                     # segment by pymlxc's kernel and inside the traces by MLX's
                                     # dequantize (PYMLXC_PREFILL_DEQUANTIZE_KERNEL), runs interleaved
        [--dequantize-batch-ab]      # segmented, dequantizing with the kernel: a segment's weights in
                                     # one kernel call and in a call each, runs interleaved
        [--attention-ab]             # pymlxc's prefill attention kernel against MLX's (cuDNN) attention,
                                     # runs interleaved; then each side's first runs at new lengths
        [--compiled-ab]              # segmented, chunks op by op (qmm_rows): compiled prefill against
                                     # op by op, runs interleaved
        [--thread-ab]                # segmented: the evaluation thread on and off, runs interleaved
        [--exact-cache-ab]           # segmented: the caches' first buffers as large as the prompt
                                     # (no zero fill before the writes; decode then grows them) and
                                     # as the decoder reserves them, runs interleaved
        [--pin-ab]                   # segmented: the calling thread and the evaluation thread pinned
                                     # to two cores (not siblings) and free, runs interleaved
        [--qmm-block-bytes N]        # nn.QMM_OP_BY_OP_BLOCK_BYTES (large: an 8B's chunks stay compiled)

`--split` (segmented mode) also times, medians of --repeats: `runner_ms`, the decoder handing out its
prefill runner (once a generation); `build_ms`, the runner building one chunk's graph with nothing
evaluated (Python, the binding and MLX's graph construction: the host's share no device hides);
`eval_ms`, one `eval` of that whole graph (MLX's encoding of every kernel and the device's work,
overlapped by MLX alone). Set against the time to the first token, where each layer goes to the
evaluation thread as it is built: if `build_ms` is most of it, Python is the bound; if `eval_ms`
is, MLX's per-kernel work or the device.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _path  # noqa: F401 - the checkout as installed

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from compare_mlx_lm import Pymlxc, probe_prompt, timed_run  # noqa: E402


def host_split(side: Pymlxc, n: int, repeats: int, profile: int) -> dict[str, Any]:
    """`--split`'s times (see the module doc) for a prompt of `n` tokens; with `profile`, cProfile's
    `profile` costliest functions of one build by own time."""
    import pymlxc.core as mx

    model, decoder = side.loaded.model, side.decoder
    tokens = mx.array([probe_prompt(n, side.vocab)], dtype=mx.int32)
    times: list[tuple[float, float, float]] = []
    prof = cProfile.Profile() if profile else None
    for i in range(repeats + (prof is not None)):
        cache = model.make_cache(side.context_len)
        decoder.reserve(cache, n, 1)
        start = time.perf_counter()
        runner = decoder.prefill_runner(True)
        made = time.perf_counter()
        if runner is None or not runner.takes(tokens):
            raise SystemExit(f"{n} tokens do not go through the compiled prefill of this model")
        profiled = prof is not None and i == repeats
        if profiled:
            prof.enable()
        h = runner(tokens, cache)
        built = time.perf_counter()
        if profiled:
            prof.disable()
        mx.eval(h)
        done = time.perf_counter()
        decoder.unreserve(cache)
        if not profiled:
            times.append((made - start, built - made, done - built))
    out: dict[str, Any] = {k: 1e3 * statistics.median(t[j] for t in times)
                           for j, k in enumerate(("runner_ms", "build_ms", "eval_ms"))}
    if prof is not None:
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(profile)
        out["profile"] = text.getvalue()
    return out


def interleaved_ab(side: Pymlxc, prompt: list[int], repeats: int, clear_cache: bool,
                   choose: Callable[[bool], None]) -> dict[str, Any]:
    """Time to the first token with `choose(True)` and `choose(False)` in force, run after run in
    turn (each warmed up first), so that the host's drift moves both alike."""
    times: dict[bool, list[float]] = {True: [], False: []}
    for on in (True, False):
        choose(on)
        timed_run(side, prompt, 1)  # its traces
    for _ in range(repeats):
        for on in (True, False):
            choose(on)
            times[on].append(timed_run(side, prompt, 1, clear_cache=clear_cache)["ttft_s"])
    return {"on_ms": 1e3 * statistics.median(times[True]), "off_ms": 1e3 * statistics.median(times[False]),
            "on_runs_ms": [1e3 * t for t in times[True]], "off_runs_ms": [1e3 * t for t in times[False]]}


def attribute_ab(side: Pymlxc, prompt: list[int], repeats: int, clear_cache: bool, owner: Any,
                 attr: str) -> dict[str, Any]:
    """`owner.attr` True and False in turn, put back afterwards: `--fused-ab` / `--dequantized-ab`
    (the decoder's switches) and `--thread-ab` (the side's evaluation thread)."""
    kept = getattr(owner, attr)
    try:
        return interleaved_ab(side, prompt, repeats, clear_cache, lambda on: setattr(owner, attr, on))
    finally:
        setattr(owner, attr, kept)


def compiled_ab(side: Pymlxc, prompt: list[int], repeats: int, clear_cache: bool) -> dict[str, Any]:
    """`--compiled-ab`: a model whose chunks go op by op through the tensor-core qmm (its `qmm_rows`,
    nn.mark_qmm_products) against the same chunks on the compiled prefill (on). The decoder makes
    its runner again at each switch (about 1 ms, on the compiled side's time)."""
    model = side.loaded.model
    marked = model.qmm_rows
    if not marked:
        raise SystemExit("--compiled-ab: this model's chunks do not go op by op (nn.mark_qmm_products)")
    try:
        return interleaved_ab(side, prompt, repeats, clear_cache,
                              lambda compiled: setattr(model, "qmm_rows", 0 if compiled else marked))
    finally:
        model.qmm_rows = marked


def attention_ab(side: Pymlxc, prompt: list[int], repeats: int, clear_cache: bool) -> dict[str, Any]:
    """`--attention-ab`: the attention modules marked for pymlxc's prefill attention kernel (on, as the
    load's check left them) against MLX's attention (off). Also each side's first run at lengths
    neither has run (`*_new_length_runs_ms`: MLX builds a cuDNN graph for each new shape)."""
    from pymlxc.backends.metal import nn

    modules = nn.prefill_attention_modules(side.loaded.model)
    marked = [m.prefill_kernel for m in modules]
    if not any(marked):
        raise SystemExit("--attention-ab: no attention module is marked for the kernel (nn.mark_prefill_attention)")

    def choose(on: bool) -> None:
        for m, was in zip(modules, marked, strict=True):
            m.__dict__["prefill_kernel"] = was and on

    try:
        result = interleaved_ab(side, prompt, repeats, clear_cache, choose)
        fresh = iter(range(len(prompt) + 1, len(prompt) + 1 + 2 * repeats))
        for name, on in (("on", True), ("off", False)):
            choose(on)
            result[f"{name}_new_length_runs_ms"] = [
                1e3 * timed_run(side, probe_prompt(next(fresh), side.vocab), 1, clear_cache=clear_cache)["ttft_s"]
                for _ in range(repeats)]
        return result
    finally:
        choose(True)


def dequantize_batch_ab(side: Pymlxc, prompt: list[int], repeats: int, clear_cache: bool) -> dict[str, Any]:
    """`--dequantize-batch-ab`: the weights a segment dequantizes before its trace in one call of
    pymlxc's kernel (on, `PrefillSpec.dense_weights`) against one call a weight (off)."""
    from pymlxc.backends.metal.decode import prefill
    from pymlxc.backends.metal.kernel_choice import dequantized_weight

    batched = prefill.PrefillSpec.dense_weights

    def each(spec: prefill.PrefillSpec) -> list[Any]:
        return [dequantized_weight(*prefill._quantized_weight(m), kernel)  # noqa: SLF001
                for m, kernel in zip(spec.weight_modules, spec.weight_kernels, strict=True)]

    def choose(on: bool) -> None:
        prefill.PrefillSpec.dense_weights = batched if on else each  # type: ignore[method-assign]

    try:
        return interleaved_ab(side, prompt, repeats, clear_cache, choose)
    finally:
        prefill.PrefillSpec.dense_weights = batched  # type: ignore[method-assign]


def exact_cache_ab(side: Pymlxc, prompt: list[int], repeats: int, clear_cache: bool) -> dict[str, Any]:
    """`--exact-cache-ab`: each cache's first buffer exactly the prompt's length (on: the decoder
    reserves nothing and the caches grow one slot at a time, so the prompt fills its buffer and no
    zero fill comes before the writes) against the decoder's reservation (off)."""
    from pymlxc.backends.metal.cache import KVCache

    decoder = side.decoder
    assert decoder is not None
    kept_step = KVCache.step

    def choose(on: bool) -> None:
        KVCache.step = 1 if on else kept_step
        if on:
            decoder.reserve = lambda cache, prompt_len, max_tokens: None  # type: ignore[method-assign]
        else:
            decoder.__dict__.pop("reserve", None)

    try:
        return interleaved_ab(side, prompt, repeats, clear_cache, choose)
    finally:
        KVCache.step = kept_step
        decoder.__dict__.pop("reserve", None)


def two_cores() -> tuple[int, int]:
    """Two cores this process may use that are not hyperthreads of one physical core."""
    import os

    cpus = sorted(os.sched_getaffinity(0))
    first = cpus[0]
    try:
        text = Path(f"/sys/devices/system/cpu/cpu{first}/topology/thread_siblings_list").read_text()
        siblings = {int(c) for part in text.strip().split(",")
                    for c in (range(int(part.split("-")[0]), int(part.split("-")[-1]) + 1))}
    except OSError:
        siblings = {first}
    return first, next(c for c in cpus if c not in siblings)


def pin_ab(side: Pymlxc, prompt: list[int], repeats: int, clear_cache: bool) -> dict[str, Any]:
    """`--pin-ab`: the calling thread and the evaluation thread each pinned to a core of its own
    (on) against free to run on any core (off)."""
    import os

    import pymlxc.core as mx
    from pymlxc.core import eval_thread

    allowed = os.sched_getaffinity(0)
    worker = eval_thread.shared(mx.default_device())._thread.native_id  # noqa: SLF001
    assert worker is not None
    main_core, worker_core = two_cores()

    def choose(on: bool) -> None:
        os.sched_setaffinity(0, {main_core} if on else allowed)  # 0: the calling thread
        os.sched_setaffinity(worker, {worker_core} if on else allowed)

    try:
        result = interleaved_ab(side, prompt, repeats, clear_cache, choose)
        result["cores"] = [main_core, worker_core]
        return result
    finally:
        choose(False)


ABRun = Callable[[Pymlxc, list[int], int, bool], dict[str, Any]]


def ab_runs(args: argparse.Namespace) -> list[tuple[str, ABRun]]:
    """The A/Bs the flags ask for, by the name their results are kept under."""
    def switch(attr: str, of_decoder: bool = True) -> ABRun:
        return lambda side, prompt, repeats, clear: attribute_ab(side, prompt, repeats, clear,
                                                                 side.decoder if of_decoder else side, attr)

    chosen = [(args.fused_ab, "prefill_fused_products", switch("prefill_fused_products")),
              (args.dequantized_ab, "prefill_dequantized", switch("prefill_dequantized")),
              (args.dequantize_kernel_ab, "prefill_dequantize_kernel", switch("prefill_dequantize_kernel")),
              (args.dequantize_batch_ab, "dequantize_batch", dequantize_batch_ab),
              (args.attention_ab, "prefill_attention", attention_ab),
              (args.compiled_ab, "compiled", compiled_ab), (args.thread_ab, "eval_thread", switch("threaded", False)),
              (args.exact_cache_ab, "exact_cache", exact_cache_ab), (args.pin_ab, "pinned", pin_ab)]
    return [(name, run) for flag, name, run in chosen if flag]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("models", nargs="+", type=Path)
    p.add_argument("--lengths", nargs="+", type=int, default=[128, 2048])
    p.add_argument("--modes", nargs="+", default=["segmented", "off"], choices=["segmented", "graph", "off"])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dense-min-rows", nargs="+", type=int, default=[0],
                   help="rows of x from which quantized layers take dense products, each (0: the library's)")
    p.add_argument("--lead", nargs="+", type=int, default=[0],
                   help="layers the host may run ahead of the device in a prefill, each "
                        "(generate.PREFILL_LEAD_LAYERS; 0: the library's)")
    p.add_argument("--max-tokens", type=int, default=1,
                   help="tokens each timed run generates (more than 1: its decode rate is reported too)")
    p.add_argument("--switch-interval", nargs="+", type=float, default=[0.0],
                   help="Python's thread switch interval in seconds, each (sys.setswitchinterval; 0: as found)")
    p.add_argument("--keep-cache", action="store_true",
                   help="keep MLX's buffer cache between the runs (the default gives it back before each)")
    p.add_argument("--split", action="store_true",
                   help="segmented mode: also the runner, graph-build and one-eval times (see above)")
    p.add_argument("--profile", type=int, default=0, help="with --split: cProfile the build, this many functions")
    p.add_argument("--dtype", nargs="+", default=["auto"], help="each compute dtype asked for at load")
    p.add_argument("--fused-ab", action="store_true",
                   help="segmented mode: interleave runs with the prefill's fused products and without")
    p.add_argument("--dequantized-ab", action="store_true",
                   help="segmented mode: interleave runs with the prefill's quantized products dequantized "
                        "for dense matmuls and through MLX's quantized matmul")
    p.add_argument("--dequantize-kernel-ab", action="store_true",
                   help="segmented mode, a prefill that dequantizes: interleave runs whose weights are dequantized "
                        "before each segment by pymlxc's kernel and runs that dequantize inside the traces")
    p.add_argument("--dequantize-batch-ab", action="store_true",
                   help="segmented, dequantizing with the kernel: one call a segment against one a weight")
    p.add_argument("--attention-ab", action="store_true",
                   help="interleave runs with the prefill attention kernel and with MLX's attention; also "
                        "each side's first runs at new lengths")
    p.add_argument("--compiled-ab", action="store_true",
                   help="segmented mode, a model whose chunks go op by op through the tensor-core qmm: "
                        "interleave runs on the compiled prefill (on) and op by op (off); groups 32 and 64 may "
                        "go op by op")
    p.add_argument("--thread-ab", action="store_true",
                   help="segmented mode: interleave runs on the evaluation thread and without it")
    p.add_argument("--exact-cache-ab", action="store_true",
                   help="segmented mode: interleave runs whose caches start as large as the prompt and "
                        "runs with the decoder's reserved buffers")
    p.add_argument("--pin-ab", action="store_true",
                   help="segmented mode: interleave runs with the calling and evaluation threads pinned to "
                        "two cores and runs with them free")
    p.add_argument("--qmm-block-bytes", type=int, default=0,
                   help="nn.QMM_OP_BY_OP_BLOCK_BYTES for the models loaded (0: the library's)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    from pymlxc.backends.metal import generate, nn

    default_rows = nn.DENSE_MIN_ROWS
    default_qmm_bytes = nn.QMM_OP_BY_OP_BLOCK_BYTES
    if args.compiled_ab:  # group-64 layers may go op by op too, for the A/B
        nn.QMM_OP_BY_OP_GROUPS = (32, 64)
    default_lead = generate.PREFILL_LEAD_LAYERS
    default_budget = generate.PREFILL_DENSE_BYTES
    default_interval = sys.getswitchinterval()
    rows: list[dict[str, Any]] = []
    for path, mode, dense, lead, dtype, interval in (
            (p, m, d, ld, dt, si) for p in args.models for m in args.modes for d in args.dense_min_rows
            for ld in args.lead for dt in args.dtype for si in args.switch_interval):
        sys.setswitchinterval(interval or default_interval)
        nn.DENSE_MIN_ROWS = dense or default_rows  # read when a model loads (mark_dense_products)
        nn.QMM_OP_BY_OP_BLOCK_BYTES = args.qmm_block_bytes or default_qmm_bytes  # read at load (mark_qmm_products)
        generate.PREFILL_LEAD_LAYERS = lead or default_lead
        generate.PREFILL_DENSE_BYTES = default_budget if not lead else 1 << 62  # a given lead holds for every chunk
        side = Pymlxc(compiled=mode != "off", mode=None if mode == "off" else mode, dtype=dtype)
        side.load(path)
        try:
            for n in args.lengths:
                prompt = probe_prompt(n, side.vocab)
                timed_run(side, prompt, args.max_tokens)  # warm-up: traces and kernels for this length
                runs = [timed_run(side, prompt, args.max_tokens, clear_cache=not args.keep_cache)
                        for _ in range(args.repeats)]
                ms = 1e3 * statistics.median(r["ttft_s"] for r in runs)
                decode = statistics.median(r["decode_tps"] for r in runs) if args.max_tokens > 1 else None
                rows.append({"model": str(path), "mode": mode, "dense_min_rows": nn.DENSE_MIN_ROWS,
                             "lead_layers": generate.PREFILL_LEAD_LAYERS, "prompt": n,
                             "keep_cache": args.keep_cache, "dtype": str(side.loaded.model.compute_dtype),
                             "switch_interval_s": sys.getswitchinterval(),
                             "ttft_ms": ms, "prefill_tps": n / ms * 1e3, "max_tokens": args.max_tokens,
                             "decode_tps": decode, "ttft_runs_ms": [1e3 * r["ttft_s"] for r in runs]})
                print(f"{path.name:40s} {mode:9s} {str(side.loaded.model.compute_dtype).split('.')[-1]:8s} "
                      f"dense>={nn.DENSE_MIN_ROWS:<5d} lead {generate.PREFILL_LEAD_LAYERS} "
                      f"switch {1e6 * sys.getswitchinterval():.0f}us "
                      f"{n:5d} tokens  {ms:8.2f} ms  {n / ms * 1e3:9.0f} tok/s"
                      + (f"  decode {decode:7.1f} tok/s" if decode is not None else ""), flush=True)
                for attr, run_ab in ab_runs(args):
                    if mode == "segmented":
                        ab = run_ab(side, prompt, args.repeats, not args.keep_cache)
                        rows[-1][attr] = ab
                        print(f"{'':40s} {attr} on {ab['on_ms']:6.2f} ms  off {ab['off_ms']:6.2f} ms  "
                              f"(runs on {' '.join(f'{t:.2f}' for t in ab['on_runs_ms'])}; "
                              f"off {' '.join(f'{t:.2f}' for t in ab['off_runs_ms'])})", flush=True)
                        if "on_new_length_runs_ms" in ab:
                            print(f"{'':40s} {attr} new lengths on "
                                  f"{' '.join(f'{t:.2f}' for t in ab['on_new_length_runs_ms'])}; off "
                                  f"{' '.join(f'{t:.2f}' for t in ab['off_new_length_runs_ms'])} ms", flush=True)
                if args.split and mode == "segmented":
                    split = host_split(side, n, args.repeats, args.profile)
                    rows[-1].update(split)
                    print(f"{'':40s} runner {split['runner_ms']:6.2f} ms  build {split['build_ms']:6.2f} ms  "
                          f"eval {split['eval_ms']:6.2f} ms", flush=True)
                    if "profile" in split:
                        print(split["profile"], flush=True)
        finally:
            side.free()
    sys.setswitchinterval(default_interval)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

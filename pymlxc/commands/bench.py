"""`pymlxc bench`: speed, memory and small quality checks of one model, as text or JSON.

    pymlxc bench MODEL [--json] [--prompt TEXT | --prompt-tokens N] [--max-tokens N] [--runs N]

Reports the model's info and load time; prefill and decode tok/s and time to first token (median,
min and max over the runs, greedy, each run with an empty prompt cache); peak and active memory;
the prompt cache's hit rate and restore latency (the same prompt once more, the cache kept); and
deterministic checks: greedy output reproducible run to run, the same tokens without the compiled
decode step (native backend), a stop token respected, the chat template rendering. The JSON is
described in benchmarks/BENCH_SCHEMA.md (`schema_version` 1).
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

SCHEMA_VERSION = 1

# Prompt text for --prompt-tokens: plain prose, repeated as needed and cut at the token count.
_TEXT = ("The river ran past the old mill and under the stone bridge, where the baker stopped every "
         "morning to watch the boats. She counted them as they went by, wrote the numbers in a small "
         "notebook, and in the evening told the children how many had passed and where they were going. ")


def _configure(p: argparse.ArgumentParser) -> None:
    from pymlxc.cli import add_load_arguments

    add_load_arguments(p)
    source = p.add_mutually_exclusive_group()
    source.add_argument("--prompt", default=None, help="the prompt text")
    source.add_argument("--prompt-tokens", type=int, default=None,
                        help="a prompt of about N tokens (plain prose; the count used is reported)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--runs", type=int, default=3, help="timed runs (medians, min and max)")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs first (compiled steps are traced then)")
    p.add_argument("--json", action="store_true", help="print one JSON object (benchmarks/BENCH_SCHEMA.md)")


def _summary(values: Sequence[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _prompt_of_tokens(model: Any, n: int) -> str:
    """Prose that encodes to about `n` tokens with the model's tokenizer (at most its `context_len`,
    where it has one: the text is built in memory before any of it is cut)."""
    if n < 1:
        raise ValueError(f"--prompt-tokens must be >= 1, not {n}")
    context = getattr(model, "context_len", None)
    if isinstance(context, int) and n > context:
        raise ValueError(f"--prompt-tokens {n} is more than the model's context length {context} (--context-len)")
    reps = 1
    while len(model.encode(_TEXT * reps)) < n + 8:  # doubled: a few encodings, not one per repetition
        if len(_TEXT) * reps > 64 * (n + 8):
            raise ValueError(f"--prompt-tokens: the tokenizer gives too few tokens for prose to reach {n}")
        reps *= 2
    text = _TEXT * reps
    words = text.split(" ")
    # Cut by words until the encoding fits: the text stays text (no broken characters).
    lo, hi = 1, len(words)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(model.encode(" ".join(words[:mid]))) <= n:
            lo = mid
        else:
            hi = mid - 1
    return " ".join(words[:lo])


def _run(model: Any, prompt: str, **options: Any) -> tuple[list[int], float, Any]:
    """One generation: token ids, wall-clock time to the first token, and the model's metrics."""
    start = time.perf_counter()
    first = None
    ids = []
    for token in model.generate(prompt, **options):
        if first is None:
            first = time.perf_counter()
        ids.append(token.id)
    if model.err() is not None:
        raise RuntimeError(f"generation failed: {model.err()}")
    end = time.perf_counter()
    return ids, (first if first is not None else end) - start, model.metrics()


def _clear_prompt_cache(model: Any) -> None:
    cache = getattr(model, "prompt_cache", None)
    if cache is not None:
        cache.clear()


def _check(fn: Callable[[], bool]) -> dict[str, Any]:
    try:
        return {"ok": bool(fn())}
    except Exception as exc:  # noqa: BLE001 - a failed check is reported, not raised
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}


def bench(model: Any, *, prompt: str, max_tokens: int, runs: int, warmup: int = 1,
          load_seconds: float | None = None) -> dict[str, Any]:
    """Measure `model` (a loaded TextModel); returns the schema-1 record."""
    import pymlxc.core as mx

    options = {"max_tokens": max_tokens, "temperature": 0.0}
    for _ in range(max(warmup, 0)):
        _clear_prompt_cache(model)
        _run(model, prompt, **options)
    timed = []
    for _ in range(max(runs, 1)):
        _clear_prompt_cache(model)
        timed.append(_run(model, prompt, **options))
    token_runs = [ids for ids, _, _ in timed]
    metrics = [m for _, _, m in timed]
    reference = token_runs[0]

    # The prompt cache: the same prompt again with the last run's entry kept.
    cache_info: dict[str, Any] = {"enabled": bool(getattr(getattr(model, "prompt_cache", None), "enabled", False))}
    if cache_info["enabled"]:
        ids, ttft, m = _run(model, prompt, **options)
        hits, misses = getattr(m, "prompt_cache_hits", 0), getattr(m, "prompt_cache_misses", 0)
        cache_info.update({
            "hits": hits, "misses": misses, "hit_rate": hits / (hits + misses) if hits + misses else 0.0,
            "hit_tokens": getattr(m, "prompt_cache_hit_tokens", 0),
            "restore_seconds": getattr(m, "prompt_cache_restore_duration", 0.0),
            "ttft_seconds": ttft, "ttft_cold_seconds": statistics.median(t for _, t, _ in timed),
            "same_tokens": ids == reference,
        })

    checks: dict[str, Any] = {"greedy_reproducible": {"ok": all(t == reference for t in token_runs)}}
    if hasattr(model, "compiled_decode"):
        def uncompiled_same() -> bool:
            model.compiled_decode = False
            try:
                _clear_prompt_cache(model)
                return _run(model, prompt, **options)[0] == reference
            finally:
                model.compiled_decode = True
        checks["compiled_matches_uncompiled"] = _check(uncompiled_same)

    def stop_respected() -> bool:
        if len(reference) < 2:
            return True
        stop = reference[min(2, len(reference) - 1)]
        _clear_prompt_cache(model)
        got = _run(model, prompt, **options, stop_tokens=(stop,))[0]
        return got == reference[:reference.index(stop)]
    checks["stop_tokens_respected"] = _check(stop_respected)

    def chat_renders() -> bool:
        # The template renders and the result generates (no exception, no error kept in err()).
        list(model.chat([{"role": "user", "content": "Say hello."}], max_tokens=4, temperature=0.0))
        if model.err() is not None:
            raise RuntimeError(str(model.err()))
        return True
    checks["chat_template_renders"] = _check(chat_renders)

    info = model.info().to_dict() if hasattr(model, "info") else {}
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": "bench",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "model": info,
        "backend": type(model).__module__.split(".")[-2] if "." in type(model).__module__ else type(model).__module__,
        "device": str(mx.default_device()),
        "platform": platform.platform(),
        "load_seconds": load_seconds,
        "prompt_tokens": metrics[0].prompt_tokens,
        "max_tokens": max_tokens,
        "generated_tokens": [m.generated_tokens for m in metrics],
        "runs": len(metrics),
        "warmup_runs": max(warmup, 0),
        "prefill_tokens_per_sec": _summary([m.prefill_tokens_per_sec for m in metrics]),
        "decode_tokens_per_sec": _summary([m.decode_tokens_per_sec for m in metrics if m.generated_tokens > 1]),
        "ttft_seconds": _summary([t for _, t, _ in timed]),
        "peak_memory_bytes": max(m.peak_memory_bytes for m in metrics),
        "active_memory_bytes": metrics[-1].active_memory_bytes,
        "prompt_cache": cache_info,
        "checks": checks,
    }


def _print_text(record: dict[str, Any]) -> None:
    def rate(s: dict[str, float] | None, unit: str = "tok/s", scale: float = 1.0) -> str:
        if s is None:
            return "n/a"
        return f"{scale * s['median']:.1f} {unit} (min {scale * s['min']:.1f}, max {scale * s['max']:.1f})"

    model = record["model"]
    print(f"model: {model.get('architecture', '?')}, {model.get('num_layers', '?')} layers, hidden "
          f"{model.get('hidden_size', '?')}, vocab {model.get('vocab_size', '?')}"
          + (f", {model['quant_bits']}-bit/{model['quant_group']}" if model.get("quant_bits") else ""))
    print(f"backend: {record['backend']} on {record['device']}; loaded in {record['load_seconds']:.2f} s"
          if record["load_seconds"] is not None else f"backend: {record['backend']} on {record['device']}")
    print(
        f"prompt: {record['prompt_tokens']} tokens; generated {record['generated_tokens']} "
        f"(max {record['max_tokens']}) over {record['runs']} runs"
    )
    print(f"prefill: {rate(record['prefill_tokens_per_sec'])}")
    print(f"decode:  {rate(record['decode_tokens_per_sec'])}")
    print(f"time to first token: {rate(record['ttft_seconds'], 'ms', 1e3)}")
    print(
        f"memory: peak {record['peak_memory_bytes'] / 2**20:.1f} MB, "
        f"active {record['active_memory_bytes'] / 2**20:.1f} MB"
    )
    pc = record["prompt_cache"]
    if pc.get("enabled"):
        print(f"prompt cache: hit rate {pc['hit_rate']:.2f} ({pc['hit_tokens']} tokens restored in "
              f"{1e3 * pc['restore_seconds']:.2f} ms); time to first token {1e3 * pc['ttft_seconds']:.1f} ms "
              f"vs {1e3 * pc['ttft_cold_seconds']:.1f} ms cold")
    else:
        print("prompt cache: off")
    for name, result in record["checks"].items():
        print(
            f"check {name}: {'ok' if result['ok'] else 'FAILED'}"
            + (f" ({result['error']})" if "error" in result else "")
        )


def check_arguments(args: argparse.Namespace) -> None:
    """The counts must make sense before anything is loaded (not silently replaced by others)."""
    if args.runs < 1:
        raise ValueError(f"--runs must be >= 1, not {args.runs}")
    if args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, not {args.warmup}")
    if args.prompt_tokens is not None and args.prompt_tokens < 1:
        raise ValueError(f"--prompt-tokens must be >= 1, not {args.prompt_tokens}")
    if args.max_tokens < 1:
        # No token: no first token to time, no decode, and a prefill "rate" of millions of tok/s.
        raise ValueError(f"--max-tokens must be >= 1, not {args.max_tokens}")


def _run_bench(args: argparse.Namespace) -> int:
    from pymlxc.cli import load
    from pymlxc.hub import resolve

    check_arguments(args)
    quiet = args.quiet
    args.model = str(resolve(args.model, progress=not quiet))  # a download is not part of the timed load
    args.quiet = True  # no progress bar: the load is timed
    start = time.perf_counter()
    with load(args) as model:
        load_seconds = time.perf_counter() - start
        tokens = args.prompt_tokens if args.prompt_tokens is not None else 128
        prompt = args.prompt if args.prompt is not None else _prompt_of_tokens(model, tokens)
        record = bench(model, prompt=prompt, max_tokens=args.max_tokens, runs=args.runs, warmup=args.warmup,
                       load_seconds=load_seconds)
    args.quiet = quiet
    if args.json:
        print(json.dumps(record))
    else:
        _print_text(record)
    return 0 if all(c["ok"] for c in record["checks"].values()) else 1


def register_commands(register: Callable[[Any], None]) -> None:
    from pymlxc.cli import Command

    register(Command("bench", "measure speed, memory and deterministic behaviour of a model", _configure, _run_bench))


__all__ = ["bench", "register_commands", "SCHEMA_VERSION"]


if __name__ == "__main__":  # pragma: no cover
    sys.exit("run it as: pymlxc bench MODEL")

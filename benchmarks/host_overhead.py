"""Host time per decode token: building one step's graph in Python (mlx-lm, pymlxc uncompiled)
against replaying the compiled step (pymlxc: whole-step graph, segments), for the real model shapes, without running them.

On a fast GPU a small model's decode is bound by this host work (plus MLX's per-node dispatch,
which is not measured here), not by the device; this script measures it on any machine, in
seconds, for any shape (8B included): weights are lazy placeholders that are never evaluated, so no
weight memory is used, and no kernel runs. Each step builds on the previous one's lazy outputs at a
context of `--context` tokens, as a real decode does.

    python benchmarks/host_overhead.py [--shapes llama-3.2-1b ...] [--quant bf16 4bit] [--steps 40]
"""
from __future__ import annotations

import _path  # noqa: F401 - the checkout as installed (backends as pymlxc.backends)

import argparse
import gc
import json
import statistics
import time
from pathlib import Path
from typing import Any

import mlx.core as mlx
import mlx.nn as mlx_nn

import pymlxc.core as pmx
from pymlxc.backends.metal import generate as loops
from pymlxc.backends.metal import nn as pnn
from pymlxc.backends.metal.decode.decoder import CompiledDecoder, decode_capacity
from pymlxc.backends.metal.models import get_model_module
from pymlxc.backends.metal.sample import greedy
from pymlxc.options import LoadConfig
from pymlxc.testing.shapes import SHAPES, shape_config


def _pymlxc_model(config: dict[str, Any], bits: int | None) -> Any:
    module = get_model_module(config["model_type"])
    model = module.Model(module.ModelArgs.from_dict(config))
    if model.lm_head is not None and config.get("tie_word_embeddings"):
        model.tie_embeddings()
    if bits:
        pnn.quantize(model, lambda p, m: True, group_size=64, bits=bits)
    # bfloat16 placeholders, as a bfloat16 checkpoint gives (still lazy: nothing is allocated).
    for path, module_ in model.named_modules():
        for name, value in list(vars(module_).items()):
            if isinstance(value, pmx.Array) and value.dtype == pmx.float32 and not name.startswith("_"):
                setattr(module_, name, value.astype(pmx.bfloat16))
    return model


def _mlx_lm_model(config: dict[str, Any], bits: int | None) -> Any:
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    model.set_dtype(mlx.bfloat16)
    if bits:
        mlx_nn.quantize(model, group_size=64, bits=bits)
    return model


def time_mlx_lm(config: dict[str, Any], bits: int | None, context: int, steps: int) -> list[float]:
    from mlx_lm.models.cache import make_prompt_cache

    model = _mlx_lm_model(config, bits)
    cache = make_prompt_cache(model)
    model(mlx.array([[5] * (context - 1)]), cache=cache)  # lazy prefill: shapes only
    y = mlx.array([7])
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        logits = model(y[:, None], cache=cache)[:, -1, :]
        logprobs = logits - mlx.logsumexp(logits, keepdims=True)  # as mlx-lm's generate_step does
        y = mlx.argmax(logprobs, axis=-1)
        times.append(time.perf_counter() - t)
    return times


def time_pymlxc(config: dict[str, Any], bits: int | None, context: int, steps: int, compiled: bool,
                mode: str = "graph") -> list[float]:
    model = _pymlxc_model(config, bits)
    cache = model.make_cache(LoadConfig().context_len)
    decoder = CompiledDecoder(model, mode) if compiled else None
    if decoder is not None:
        decoder.reserve(cache, context, steps + 2)
    model(pmx.array([[5] * (context - 1)], dtype=pmx.int32), cache=cache)  # lazy prefill
    first = pmx.array([[7]], dtype=pmx.int32)
    times = []
    if decoder is None:
        step = loops.make_step(model, cache, greedy)
        y = first
        for _ in range(steps):
            t = time.perf_counter()
            y = pmx.expand_dims(step(y), 1)
            times.append(time.perf_counter() - t)
        return times
    session = decoder.start(cache, context - 1, steps + 2, sampler=greedy)
    assert session is not None, "the compiled path does not apply"
    from pymlxc.backends.metal.decode import rings, segments

    # Each session kind's one-step function (the first call traces); build only, nothing evaluated.
    if isinstance(session, segments.SegmentedSession):
        layers, step_fn = session._layers, session._step  # noqa: SLF001
    else:
        layers, step_fn = session._spec.layers, session._call  # noqa: SLF001
    session._buffers = [a for layer in layers for a in rings.ring_buffers(layer)]  # noqa: SLF001
    tokens = pmx.reshape(first, (1,))
    pos = pmx.array(context - 1, dtype=pmx.int32)
    t = time.perf_counter()
    tokens, pos = step_fn(tokens, pos)
    trace = time.perf_counter() - t
    for _ in range(steps):
        t = time.perf_counter()
        tokens, pos = step_fn(tokens, pos)
        times.append(time.perf_counter() - t)
    decoder.close()
    return [trace, *times]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["llama-3.2-1b", "qwen3-0.6b", "gemma-3-1b", "llama-3.1-8b"],
                   choices=sorted(SHAPES))
    p.add_argument("--quant", nargs="+", default=["bf16", "4bit"], choices=["bf16", "4bit"])
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    rows = []
    print(f"host ms per decode token (median of {args.steps} steps at context {args.context}; no kernels run)")
    print(f"{'shape':<16} {'quant':<5} {'mlx-lm':>8} {'pymlxc':>8} {'compiled':>9} {'segmented':>10} {'trace ms':>9} "
          f"{'mlx-lm/compiled':>16}")
    for shape in args.shapes:
        config = shape_config(shape)
        for quant in args.quant:
            bits = 4 if quant == "4bit" else None
            theirs = time_mlx_lm(config, bits, args.context, args.steps)
            gc.collect()
            plain = time_pymlxc(config, bits, args.context, args.steps, compiled=False)
            gc.collect()
            comp = time_pymlxc(config, bits, args.context, args.steps, compiled=True)
            gc.collect()
            seg = None
            if config["model_type"] in ("llama", "mistral", "qwen2", "qwen3"):
                seg = time_pymlxc(config, bits, args.context, args.steps, compiled=True, mode="segmented")
                gc.collect()
            row = {"shape": shape, "quant": quant, "layers": config["num_hidden_layers"],
                   "mlx_lm_ms": 1e3 * statistics.median(theirs), "pymlxc_uncompiled_ms": 1e3 * statistics.median(plain),
                   "pymlxc_compiled_ms": 1e3 * statistics.median(comp[1:]), "trace_ms": 1e3 * comp[0],
                   "pymlxc_segmented_ms": 1e3 * statistics.median(seg[1:]) if seg else None}
            rows.append(row)
            segmented = f"{row['pymlxc_segmented_ms']:>10.2f}" if seg else f"{'-':>10}"
            print(f"{shape:<16} {quant:<5} {row['mlx_lm_ms']:>8.2f} {row['pymlxc_uncompiled_ms']:>8.2f} "
                  f"{row['pymlxc_compiled_ms']:>9.2f} {segmented} {row['trace_ms']:>9.0f} "
                  f"{row['mlx_lm_ms'] / row['pymlxc_compiled_ms']:>15.2f}x", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"schema_version": 1, "kind": "host_overhead", "context": args.context,
                                         "steps": args.steps, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""pymlxc's native backend against mlx-lm on the same device, the same weights and the same tokens.

For every case (a real model shape, bfloat16 or 4-bit, with random weights written on the fly by
`pymlxc/testing/shapes.py`) and every prompt length, both sides generate greedily from the same prompt
token ids with EOS ignored, alternately (ABBA ordering over the runs, so that drift on a busy
machine hits both alike), after one warm-up each. Reported per side: prefill tok/s (prompt tokens
over the time to the first token, as mlx-lm counts it), decode tok/s (tokens after the first over
the time after it), time to first token, peak memory (the side's weights plus the run's transient
peak: both models are resident, so the other side's weights are taken out), load time (alternate
loads) and the fraction of the memory-bandwidth limit that decode reaches (weight bytes read per
token times tok/s over the bandwidth measured here with a large reduction in MLX). Medians, min
and max over the runs; ratios are pymlxc / mlx-lm (memory: pymlxc / mlx-lm as well).

    python benchmarks/compare_mlx_lm.py                       # the full set (a GPU)
    python benchmarks/compare_mlx_lm.py --cpu --quick         # 1B shapes, short runs, on the CPU
    python benchmarks/compare_mlx_lm.py --shapes llama-3.2-1b --quant 4bit --prompt-lengths 128 \\
        --max-tokens 64 --runs 3 --out results/

Writes `compare_mlx_lm.json` (schema in BENCH_SCHEMA.md) and `compare_mlx_lm.png` (matplotlib)
into --out. `--uncompiled` adds pymlxc without the compiled decode step as a third side.
"""
from __future__ import annotations

import _path  # noqa: F401 - the checkout as installed (backends as pymlxc.backends)

import argparse
import dataclasses
import datetime
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

import mlx.core as mlx

import pymlxc.core as pmx
from pymlxc import settings as pymlxc_settings
from pymlxc.backends.metal import generate as loops
from pymlxc.backends.metal.decode.decoder import CompiledDecoder
from pymlxc.backends.metal.loader import load_weights_and_config
from pymlxc.backends.metal.sample import greedy
from pymlxc.options import LoadConfig
from pymlxc.testing.shapes import SHAPES, shape_config, weight_bytes, write_random_model

SCHEMA_VERSION = 1
QUANTS = {"bf16": None, "4bit": 4, "f32": None, "4bit-f32": 4}  # name -> bits; "-f32"/"f32": float32 weights/scales
DTYPE_OF = {"bf16": "bfloat16", "4bit": "bfloat16", "f32": "float32", "4bit-f32": "float32"}
DEFAULT_SHAPES = ("llama-3.2-1b", "qwen3-0.6b", "gemma-3-1b", "llama-3.1-8b")
# Cases that only run where their memory fits; the 1B-class shapes run everywhere.
BIG = {("llama-3.1-8b", "bf16")}


# ---------------------------------------------------------------------- device facts

def cpu_model() -> str | None:
    """The processor's model name from /proc/cpuinfo (Linux), else None."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def device_facts(cpu: bool) -> dict[str, Any]:
    facts: dict[str, Any] = {"device": str(mlx.default_device()), "platform": platform.platform(),
                             "processor": platform.processor() or platform.machine(), "cpu_count": os.cpu_count()}
    model = cpu_model()
    if model:
        # The host's processor: a short prefill or a 1B decode on a GPU is bound by host work, and
        # lent machines of one GPU kind have moved it by half with their processors.
        facts["cpu_model"] = model
    try:
        facts["mlx_device_info"] = {k: v for k, v in mlx.device_info().items()}
    except Exception:  # noqa: BLE001 - older or partial builds
        pass
    if not cpu:
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20)
            if out.returncode == 0:
                facts["gpu"] = out.stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            pass
    return facts


def versions(git_rev: str | None = None) -> dict[str, str]:
    """Package versions and the commit measured: `git_rev` (--git-rev) where the copy's git metadata
    is not the checkout's (a lent machine's copy), else git's own answer."""
    from importlib import metadata

    out = {"python": platform.python_version()}
    for dist in ("mlx", "mlx-lm", "mlx-cuda-13", "mlx-cuda", "numpy"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    if git_rev:
        out["pymlxc_git"] = git_rev
        return out
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=_path.ROOT, capture_output=True, text=True,
                             timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=_path.ROOT,
                               capture_output=True, text=True, timeout=10)
        out["pymlxc_git"] = rev.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.TimeoutExpired):
        pass
    return out


def memory_capacity(cpu: bool) -> int | None:
    """Bytes the device can hold: the GPU's memory from MLX, else the machine's RAM (None: unknown)."""
    if not cpu:
        try:
            info = mlx.device_info()
            for key in ("memory_size", "total_memory", "memory"):
                if key in info and int(info[key]) > 0:
                    return int(info[key])
        except Exception:  # noqa: BLE001 - older or partial builds
            pass
    try:
        return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError):
        return None


def measure_bandwidth(nbytes: int, repeats: int = 8) -> dict[str, float]:
    """Device memory bandwidth in bytes/s from MLX itself: a sum over `nbytes` of float32 (reads
    only, like decode's weight reads) and a copy (reads and writes). Best of `repeats`."""
    n = nbytes // 4
    a = mlx.random.uniform(shape=(n,))
    mlx.eval(a)
    batch = 4

    def best(fn: Callable[[], Any]) -> float:
        mlx.eval(fn())
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            mlx.eval(fn())
            times.append(time.perf_counter() - t)
        return min(times)

    t_sum = best(lambda: [mlx.sum(a) for _ in range(batch)])
    t_copy = best(lambda: [a * 1.5 for _ in range(batch)])
    del a
    mlx.clear_cache()
    return {"read_bytes_per_s": batch * nbytes / t_sum, "copy_bytes_per_s": batch * 2 * nbytes / t_copy,
            "buffer_bytes": nbytes}


# ---------------------------------------------------------------------- the two sides

class Side:
    """One implementation: load, generate (timed) and free."""

    name = ""

    def load(self, path: Path) -> None: ...

    def free(self) -> None: ...

    def stream(self, prompt: list[int], max_tokens: int) -> Iterator[int]: ...

    weights = 0
    vocab = 0  # the loaded model's vocabulary size


class Pymlxc(Side):
    def __init__(self, compiled: bool = True, mode: str | None = None, threaded: bool | None = None,
                 cuda_matvec: str | None = None, fused_norm: str | None = None, cuda_argmax: str | None = None,
                 rope_kv: str | None = None, dtype: str = "auto") -> None:
        self.name = (("pymlxc" if compiled else "pymlxc_uncompiled") + (f"_{mode}" if mode else "")
                     + ("" if dtype == "auto" else f"_{dtype}")
                     + ("" if threaded is None else "_thread" if threaded else "_nothread")
                     + ("" if cuda_matvec is None else f"_matvec{cuda_matvec}")
                     + ("" if fused_norm is None else f"_fusednorm{fused_norm}")
                     + ("" if cuda_argmax is None else f"_argmax{cuda_argmax}")
                     + ("" if rope_kv is None else f"_ropekv{rope_kv}"))
        self.compiled = compiled
        self.mode = mode
        self.dtype = dtype  # LoadConfig.dtype: the compute dtype asked for
        self.threaded = threaded  # None: the default for the device (PYMLXC_EVAL_THREAD)
        # Settings (pymlxc/settings.py) read at load (cuda_matvec) or by the decoder (fused_norm,
        # cuda_argmax, cuda_rope_kv); None: the process's.
        self.settings = {k: v for k, v in (("cuda_matvec", cuda_matvec), ("fused_norm", fused_norm),
                                           ("cuda_argmax", cuda_argmax), ("cuda_rope_kv", rope_kv))
                         if v is not None}
        self.cuda_matvec = False  # whether the loaded model uses pymlxc's CUDA matvec kernel
        self.loaded: Any = None
        self.decoder: CompiledDecoder | None = None
        self.context_len = LoadConfig().context_len  # what MetalTextModel uses by default

    def load(self, path: Path) -> None:
        chosen = dataclasses.replace(pymlxc_settings.current(), **self.settings)
        self.loaded = load_weights_and_config(path, settings=chosen, dtype=self.dtype)
        self.decoder = CompiledDecoder(self.loaded.model, self.mode, settings=chosen) if self.compiled else None
        self.cuda_matvec = self.loaded.cuda_matvec
        self.weights = self.loaded.nbytes
        self.vocab = int(self.loaded.config["vocab_size"])

    def used(self, flag: str) -> bool:
        """Whether a segmented decode plan ran with `flag` set: `fused_norm` (the add and norm in one
        kernel, kernels/add_rms_norm.py), `cuda_argmax` (greedy's argmax as kernels/argmax.py's kernels) or
        `rope_kv` (RoPE and the key/value writes as kernels/rope_kv.py's kernel)."""
        plans = self.decoder._plans.values() if self.decoder is not None else ()  # noqa: SLF001
        return any(getattr(plan, flag) for plan in plans)

    def free(self) -> None:
        if self.decoder is not None:
            self.decoder.close()
            self.decoder = None
        if self.loaded is not None:
            self.loaded.free()
            self.loaded = None

    def stream(self, prompt: list[int], max_tokens: int) -> Iterator[int]:
        model = self.loaded.model
        loops.check_prompt_ids(prompt, self.vocab)  # the bench calls the loop below the model's check
        tokens = loops.generate_ids(model, prompt, cache=model.make_cache(self.context_len), sampler=greedy,
                                    max_tokens=max_tokens, decoder=self.decoder)
        return tokens if self.threaded is None else self._with_thread_setting(tokens)

    def _with_thread_setting(self, tokens: Iterator[int]) -> Iterator[int]:
        """Run the generation with the eval-thread setting of this side's choice (read as it starts)."""
        with pymlxc_settings.override(eval_thread="1" if self.threaded else "0"):
            yield from tokens


class MlxLm(Side):
    name = "mlx_lm"

    def __init__(self) -> None:
        self.model: Any = None

    def load(self, path: Path) -> None:
        from mlx.utils import tree_flatten
        from mlx_lm.utils import load_model

        self.model, _ = load_model(Path(path))
        self.weights = sum(v.nbytes for _, v in tree_flatten(self.model.parameters()))
        config = json.loads((Path(path) / "config.json").read_text())
        self.vocab = int(config.get("vocab_size") or config["text_config"]["vocab_size"])

    def free(self) -> None:
        self.model = None
        gc.collect()
        mlx.clear_cache()

    def stream(self, prompt: list[int], max_tokens: int) -> Iterator[int]:
        from mlx_lm.generate import generate_step

        loops.check_prompt_ids(prompt, self.vocab)
        for token, _ in generate_step(mlx.array(prompt), self.model, max_tokens=max_tokens):
            yield int(token)


def probe_prompt(n: int, vocab: int) -> list[int]:
    """The probes' fixed prompt of `n` ids: 7i mod 1000, plus 10 (clear of the special ids at the
    front), folded into smaller vocabularies (a test's tiny model) so that every id has a row."""
    span = min(1000, vocab - 10)
    if span < 1:
        raise ValueError(f"a vocabulary of {vocab} ids is too small for a probe prompt")
    return [(7 * i) % span + 10 for i in range(n)]


def timed_run(side: Side, prompt: list[int], max_tokens: int, clear_cache: bool = True) -> dict[str, Any]:
    """One generation: times, tokens, memory. `clear_cache`: MLX's buffer cache is given back first
    (the run allocates its buffers anew, and the peak is its own)."""
    gc.collect()
    if clear_cache:
        mlx.clear_cache()
    active = mlx.get_active_memory()
    mlx.reset_peak_memory()
    tokens: list[int] = []
    start = time.perf_counter()
    first = None
    cpu_first = 0.0
    stream = side.stream(prompt, max_tokens)
    for token in stream:
        if first is None:
            first = time.perf_counter()
            cpu_first = time.process_time()
        tokens.append(token)
    end = time.perf_counter()
    cpu_end = time.process_time()
    peak = mlx.get_peak_memory()
    first = first if first is not None else end
    decode_s = end - first
    return {
        "ttft_s": first - start,
        "prefill_tps": len(prompt) / (first - start),
        "decode_tps": (len(tokens) - 1) / decode_s if decode_s > 0 and len(tokens) > 1 else 0.0,
        "generated": len(tokens),
        # The process's CPU time per decoded token, all threads: on a shared machine it moves less
        # than the wall clock (time other processes hold the cores is not counted).
        "decode_cpu_ms": 1e3 * (cpu_end - cpu_first) / (len(tokens) - 1) if len(tokens) > 1 else 0.0,
        # The run's transient peak above what was resident (both models), plus this side's weights.
        "peak_memory_bytes": max(peak - active, 0) + side.weights,
        "tokens": tokens,
    }


def warm_up(side: Side, prompt: list[int], max_tokens: int, steps: int = 4) -> None:
    """Run the first tokens of a generation of this size: traces, kernels and caches get made."""
    stream = side.stream(prompt, max_tokens)
    for i, _ in enumerate(stream):
        if i + 1 >= steps:
            break
    close = getattr(stream, "close", None)
    if close is not None:
        close()


def summary(values: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def agreement(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of two token lists."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# ---------------------------------------------------------------------- one case

def model_dir(root: Path, shape: str, quant: str, layers: int | None) -> Path:
    path = root / (f"{shape}-{quant}" + ("" if layers is None else f"-{layers}l"))
    if not (path / "model.safetensors.index.json").is_file():
        t = time.perf_counter()
        write_random_model(path, shape, bits=QUANTS[quant], layers=layers, dtype=DTYPE_OF[quant])
        print(f"  wrote {path.name} ({weight_bytes(path) / 2**30:.2f} GiB) in {time.perf_counter() - t:.1f}s",
              flush=True)
    return path


def bytes_per_token(path: Path, config: dict[str, Any]) -> int:
    """Weight bytes decode reads per token: everything but an untied embedding table (one row of it)
    and, in a mixture of experts, the experts a token does not pick (num_experts_per_tok of
    num_experts of each stacked `switch_mlp` tensor)."""
    total = weight_bytes(path)
    experts = config.get("num_experts", 0)
    untied = not config.get("tie_word_embeddings")
    if not untied and not experts:
        return total
    index = json.loads((path / "model.safetensors.index.json").read_text())
    from safetensors import safe_open

    def nbytes(name: str) -> int:
        with safe_open(str(path / index["weight_map"][name]), framework="numpy") as f:
            info = f.get_slice(name)
            itemsize = {"BF16": 2, "F16": 2, "F32": 4, "U32": 4}.get(info.get_dtype(), 2)
            return int(np.prod(info.get_shape())) * itemsize

    skipped = 0.0
    for name in index["weight_map"]:
        if untied and (name.startswith("model.embed_tokens.") or ".model.embed_tokens." in name):
            skipped += nbytes(name)
        elif experts and ".switch_mlp." in name:
            skipped += nbytes(name) * (1 - config["num_experts_per_tok"] / experts)
    return total - int(skipped)


def run_case(shape: str, quant: str, args: argparse.Namespace, sides: list[Side], bandwidth: float,
             models_root: Path) -> list[dict[str, Any]]:
    config = shape_config(shape, args.layers)
    path = model_dir(models_root, shape, quant, args.layers)
    per_token = bytes_per_token(path, config)
    # Alternate loads; each side is freed right before it loads again, so all stay loaded at the end.
    load_times: dict[str, list[float]] = {s.name: [] for s in sides}
    for r in range(max(args.load_runs, 1)):
        for side in sides if r % 2 == 0 else sides[::-1]:
            side.free()
            gc.collect()
            mlx.clear_cache()
            t = time.perf_counter()
            side.load(path)
            load_times[side.name].append(time.perf_counter() - t)
            print(f"    loaded {side.name} in {load_times[side.name][-1]:.1f}s", flush=True)
    results = []
    rng = np.random.default_rng(args.seed)
    vocab = config["vocab_size"]
    for prompt_len in args.prompt_lengths:
        margin = min(1000, vocab // 8)  # clear of the special ids at either end, small vocabularies too
        prompt = [int(i) for i in rng.integers(margin, vocab - margin, size=prompt_len)]
        print(f"  {shape} {quant} prompt {prompt_len}, {args.max_tokens} tokens", flush=True)
        for side in sides:
            t = time.perf_counter()
            warm_up(side, prompt, args.max_tokens)
            # Printed as it ends: a warm-up that outlasts a call's limit shows which side it was.
            print(f"    warm-up {side.name}: {time.perf_counter() - t:.1f}s", flush=True)
        runs: dict[str, list[dict[str, Any]]] = {s.name: [] for s in sides}
        for r in range(args.runs):
            order = sides if r % 2 == 0 else sides[::-1]
            for side in order:
                run = timed_run(side, prompt, args.max_tokens)
                runs[side.name].append(run)
                # Each run as it ends: a case cut short by a time limit still shows what it measured.
                print(f"    run {r + 1} {side.name}: prefill {run['prefill_tps']:.1f} tok/s, "
                      f"decode {run['decode_tps']:.1f} tok/s", flush=True)
        case: dict[str, Any] = {
            "shape": shape, "quant": quant, "layers": config["num_hidden_layers"], "model_type": config["model_type"],
            "weight_bytes": weight_bytes(path), "bytes_per_token": per_token, "prompt_tokens": prompt_len,
            "max_tokens": args.max_tokens, "sides": {},
        }
        for side in sides:
            rs = runs[side.name]
            decode = summary([x["decode_tps"] for x in rs])
            case["sides"][side.name] = {
                "load_s": summary(load_times[side.name]),
                "prefill_tps": summary([x["prefill_tps"] for x in rs]),
                "decode_tps": decode,
                "ttft_s": summary([x["ttft_s"] for x in rs]),
                "decode_cpu_ms": summary([x["decode_cpu_ms"] for x in rs]),
                "peak_memory_bytes": summary([float(x["peak_memory_bytes"]) for x in rs]),
                "generated": rs[0]["generated"],
                "bandwidth_fraction": decode["median"] * per_token / bandwidth if bandwidth else None,
                "reproducible": all(x["tokens"] == rs[0]["tokens"] for x in rs),
            }
            if isinstance(side, Pymlxc):
                case["sides"][side.name]["cuda_matvec"] = side.cuda_matvec
                case["sides"][side.name]["fused_norm"] = side.used("fused_norm")
                case["sides"][side.name]["cuda_argmax"] = side.used("cuda_argmax")
                case["sides"][side.name]["rope_kv"] = side.used("rope_kv")
            decoder = getattr(side, "decoder", None)
            if decoder is not None:  # did pymlxc decode on the compiled step (or fall back)?
                case["sides"][side.name]["decoder_stats"] = dict(decoder.stats)
        ours, theirs = case["sides"]["pymlxc"], case["sides"]["mlx_lm"]
        case["ratio"] = {
            "decode": ours["decode_tps"]["median"] / theirs["decode_tps"]["median"],
            "prefill": ours["prefill_tps"]["median"] / theirs["prefill_tps"]["median"],
            "peak_memory": ours["peak_memory_bytes"]["median"] / theirs["peak_memory_bytes"]["median"],
            "load": ours["load_s"]["median"] / theirs["load_s"]["median"],
            # CPU time per token, theirs over ours (above 1: pymlxc spends less).
            "decode_cpu": theirs["decode_cpu_ms"]["median"] / max(ours["decode_cpu_ms"]["median"], 1e-9),
            # The median of each round's own ratio: the two sides of a round ran back to back, so a
            # machine that speeds up or slows down between rounds moves both (a shared machine).
            "decode_paired": statistics.median(
                a / b for a, b in zip(ours["decode_tps"]["runs"], theirs["decode_tps"]["runs"]) if b > 0),
        }
        for name in case["sides"]:
            if name.startswith("pymlxc_") and name != "pymlxc_uncompiled":  # a variant: its own ratios
                var = case["sides"][name]
                case[f"ratio_{name[len('pymlxc_'):]}"] = {
                    "decode": var["decode_tps"]["median"] / theirs["decode_tps"]["median"],
                    "prefill": var["prefill_tps"]["median"] / theirs["prefill_tps"]["median"],
                    "peak_memory": var["peak_memory_bytes"]["median"] / theirs["peak_memory_bytes"]["median"],
                }
        case["tokens_agree"] = agreement(runs["pymlxc"][0]["tokens"], runs["mlx_lm"][0]["tokens"])
        if "pymlxc_uncompiled" in runs:
            case["compiled_matches_uncompiled"] = runs["pymlxc"][0]["tokens"] == runs["pymlxc_uncompiled"][0]["tokens"]
        results.append(case)
        print_case(case, [s.name for s in sides])
    for side in sides:
        side.free()
    return results


# ---------------------------------------------------------------------- output

def _gb(n: float) -> str:
    return f"{n / 2**30:.2f}G"


def print_case(case: dict[str, Any], names: list[str]) -> None:
    print(f"    {'side':<18} {'prefill tok/s':>13} {'decode tok/s':>12} {'cpu ms/tok':>10} {'ttft ms':>8} {'peak':>7} "
          f"{'load s':>7} {'bw frac':>7}")
    for name in names:
        s = case["sides"][name]
        bw = s["bandwidth_fraction"]
        cpu = s.get("decode_cpu_ms", {}).get("median", float("nan"))
        print(f"    {name:<18} {s['prefill_tps']['median']:>13.1f} {s['decode_tps']['median']:>12.1f} {cpu:>10.2f} "
              f"{1e3 * s['ttft_s']['median']:>8.1f} {_gb(s['peak_memory_bytes']['median']):>7} "
              f"{s['load_s']['median']:>7.2f} {bw if bw is None else f'{bw:.3f}':>7}")
    r = case["ratio"]
    print(f"    ratio pymlxc/mlx-lm: decode {r['decode']:.2f}x, prefill {r['prefill']:.2f}x, "
          f"peak memory {r['peak_memory']:.3f}, load {r['load']:.2f}, decode CPU time {r.get('decode_cpu', 0):.2f}x, "
          f"decode per round {r.get('decode_paired', 0):.2f}x; "
          f"tokens agree for {case['tokens_agree']}"
          f"/{case['sides']['pymlxc']['generated']}", flush=True)
    for key, r in case.items():
        if key.startswith("ratio_"):
            print(f"    ratio {key[len('ratio_'):]}/mlx-lm: decode {r['decode']:.2f}x, prefill {r['prefill']:.2f}x, "
                  f"peak memory {r['peak_memory']:.3f}", flush=True)


def markdown_table(report: dict[str, Any]) -> str:
    lines = ["| shape | quant | prompt | side | prefill tok/s | decode tok/s | TTFT ms | peak mem | load s | BW frac |",
             "|---|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for case in report["cases"]:
        for name, s in case["sides"].items():
            bw = s["bandwidth_fraction"]
            lines.append(f"| {case['shape']} | {case['quant']} | {case['prompt_tokens']} | {name} | "
                         f"{s['prefill_tps']['median']:.1f} | {s['decode_tps']['median']:.1f} | "
                         f"{1e3 * s['ttft_s']['median']:.0f} | {_gb(s['peak_memory_bytes']['median'])} | "
                         f"{s['load_s']['median']:.2f} | {'' if bw is None else f'{bw:.3f}'} |")
    lines += ["", "| shape | quant | prompt | decode ratio | prefill ratio | peak memory ratio | load ratio | tokens agree |",
              "|---|---|---:|---:|---:|---:|---:|---:|"]
    for case in report["cases"]:
        r = case["ratio"]
        lines.append(f"| {case['shape']} | {case['quant']} | {case['prompt_tokens']} | {r['decode']:.2f}x | "
                     f"{r['prefill']:.2f}x | {r['peak_memory']:.3f} | {r['load']:.2f} | "
                     f"{case['tokens_agree']}/{case['sides']['pymlxc']['generated']} |")
    return "\n".join(lines)


def chart(report: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no chart (pip install matplotlib)", file=sys.stderr)
        return False
    cases = report["cases"]
    if not cases:
        return False
    # Sides measured in every case (a merged report may mix runs with and without --uncompiled).
    names = [n for n in cases[0]["sides"] if all(n in c["sides"] for c in cases)]
    labels = [f"{c['shape']}\n{c['quant']} p{c['prompt_tokens']}" for c in cases]
    fig, axes = plt.subplots(2, 1, figsize=(max(8, 1.6 * len(cases)), 8))
    width = 0.8 / len(names)
    for ax, metric, title in ((axes[0], "decode_tps", "decode tok/s"), (axes[1], "prefill_tps", "prefill tok/s")):
        for k, name in enumerate(names):
            values = [c["sides"][name][metric]["median"] for c in cases]
            # Error bars from the median to the runs' extremes (never negative: a hand-edited or
            # partial record may hold a median outside them).
            lows = [max(0.0, c["sides"][name][metric]["median"] - c["sides"][name][metric]["min"]) for c in cases]
            highs = [max(0.0, c["sides"][name][metric]["max"] - c["sides"][name][metric]["median"]) for c in cases]
            xs = [i + (k - (len(names) - 1) / 2) * width for i in range(len(cases))]
            ax.bar(xs, values, width, label=name, yerr=[lows, highs], capsize=2)
        for i, c in enumerate(cases):
            key = "decode" if metric == "decode_tps" else "prefill"
            top = max(c["sides"][n][metric]["max"] for n in names)
            ax.annotate(f"{c['ratio'][key]:.2f}x", (i, top), ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(cases)))
        ax.set_xticklabels(labels, fontsize=7)
        ax.set_ylabel(title)
        ax.legend(fontsize=8)
    device = report["device"].get("gpu") or report["device"].get("processor") or report["device"]["device"]
    fig.suptitle(f"pymlxc vs mlx-lm ({device}; medians of {report['settings']['runs']} runs, bars min-max)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# ---------------------------------------------------------------------- main

def add_shapes_from_json(paths: list[Path]) -> list[str]:
    """Register the shapes in JSON files (each an object `{"name": {HF config fields}}`, the fields
    of a published config.json, merged over a base shape named by `"base"` if given) and return
    their names, so that `--shapes` can name them."""
    names = []
    for path in paths:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise SystemExit(f"--shape-json {path}: {exc}") from None
        if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
            raise SystemExit(f"--shape-json {path}: expected an object of shape name -> config fields")
        for name, fields in data.items():
            fields = dict(fields)
            base = fields.pop("base", None)
            if base is not None and base not in SHAPES:
                raise SystemExit(f"--shape-json {path}: shape {name!r} names an unknown base {base!r}")
            config = {**(SHAPES[base] if base else {}), **fields}
            missing = [k for k in ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                   "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size",
                                   "tie_word_embeddings") if k not in config]
            if missing:
                raise SystemExit(f"--shape-json {path}: shape {name!r} lacks {', '.join(missing)}")
            SHAPES[name] = config
            names.append(name)
    return names


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    # Shapes from --shape-json files exist before --shapes checks its choices.
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--shape-json", nargs="+", type=Path, default=[])
    add_shapes_from_json(pre.parse_known_args(argv)[0].shape_json)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES), choices=sorted(SHAPES))
    p.add_argument("--shape-json", nargs="+", type=Path, default=[], metavar="JSON",
                   help='more shapes: a JSON object {"name": {config.json fields, or "base": SHAPE and the '
                        'fields that differ}} (e.g. benchmarks/shapes_cpu.json)')
    p.add_argument("--quant", nargs="+", default=["bf16", "4bit"], choices=sorted(QUANTS))
    p.add_argument("--prompt-lengths", nargs="+", type=int, default=[128, 2048])
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--runs", type=int, default=3, help="timed runs per side and case (medians; at least 3)")
    # Three: the median then drops one load that pays a once-per-process cost on either side (a cold
    # page cache for mlx-lm's first read of a model, NVRTC compiling pymlxc's CUDA kernel at its first
    # 4-bit load: about 1.4 s on an H100); with two, the median is their mean.
    p.add_argument("--load-runs", type=int, default=3, help="alternate loads per side (load time median)")
    p.add_argument("--layers", type=int, default=None, help="fewer layers than the real shapes (quick CPU runs)")
    p.add_argument("--cpu", action="store_true", help="run on the CPU")
    p.add_argument("--quick", action="store_true",
                   help="CPU-sized: the 1B-class shapes, prompt 32, 16 tokens, 3 runs, 1 load run")
    p.add_argument("--uncompiled", action="store_true", help="add pymlxc without the compiled decode step")
    p.add_argument("--nothread", action="store_true",
                   help="add pymlxc without the evaluation thread (PYMLXC_EVAL_THREAD=0)")
    p.add_argument("--segmented", action="store_true",
                   help="add pymlxc with the segmented decode step (PYMLXC_DECODE=segmented; Llama family)")
    p.add_argument("--graph", action="store_true",
                   help="add pymlxc with the whole-step graph (PYMLXC_DECODE=graph; the CPU's default before "
                        "the segments)")
    p.add_argument("--cuda-matvec", choices=["0", "1"], default=None,
                   help="add pymlxc with PYMLXC_CUDA_MATVEC set (0: MLX's 4-bit matvec only; 1: pymlxc's at "
                        "any size)")
    p.add_argument("--fused-norm", choices=["0", "1"], default=None,
                   help="add pymlxc with PYMLXC_FUSED_NORM set (0: MLX's add and rms_norm; 1: the fused kernel "
                        "wherever it passes its check)")
    p.add_argument("--cuda-argmax", choices=["0", "1"], default=None,
                   help="add pymlxc with PYMLXC_CUDA_ARGMAX set (0: MLX's argmax; 1: the two kernels wherever "
                        "they pass their check)")
    p.add_argument("--rope-kv", choices=["0", "1"], default=None,
                   help="add pymlxc with PYMLXC_CUDA_ROPE_KV set (0: MLX's RoPE and slice updates; 1: the fused "
                        "kernel wherever it passes its check)")
    p.add_argument("--models-dir", type=Path, default=None,
                   help="where the random models are written and reused (default: a temporary folder)")
    p.add_argument("--out", type=Path, default=Path("."), help="folder for compare_mlx_lm.json and .png")
    p.add_argument("--git-rev", help="the commit to record when this copy's git metadata is stale (a lent machine)")
    p.add_argument("--bandwidth-mb", type=int, default=None, help="buffer for the bandwidth measurement")
    p.add_argument("--memory-headroom", type=float, default=2.6,
                   help="run a case only if the device holds this many times its weights (both sides + work)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--merge", nargs="*", type=Path, default=None, metavar="JSON",
                   help="merge earlier result files into --out (a folder, or a .json path such as "
                        "benchmarks/results/h100.json), the latest run of each case kept; runs nothing")
    args = p.parse_args(argv)
    if args.quick:
        args.shapes = [s for s in args.shapes if s != "llama-3.1-8b"] if "--shapes" not in (argv or sys.argv) else args.shapes
        if "--prompt-lengths" not in (argv or sys.argv):
            args.prompt_lengths = [32]
        if "--max-tokens" not in (argv or sys.argv):
            args.max_tokens = 16
        if "--load-runs" not in (argv or sys.argv):
            args.load_runs = 1
    if args.runs < 1:
        p.error("--runs must be >= 1")
    return args


def estimated_bytes(shape: str, quant: str, layers: int | None) -> int:
    config = shape_config(shape, layers)
    from pymlxc.testing.shapes import tensor_shapes

    total = 0
    for _, shp, kind in tensor_shapes(config):
        n = int(np.prod(shp))
        size = 4 if DTYPE_OF[quant] == "float32" else 2
        if QUANTS[quant] and kind != "norm":
            total += n // 2 + 2 * size * (n // 64)  # 4-bit codes + scales and biases per 64
        else:
            total += size * n
    return total


def header(report: dict[str, Any]) -> str:
    device = report["device"]
    name = device.get("gpu") or device.get("mlx_device_info", {}).get("device_name") or device.get("processor")
    v = report["versions"]
    s = report["settings"]
    bw = report["bandwidth"]["read_bytes_per_s"] / 1e9
    return (f"Device: {name} ({device['device']}); measured read bandwidth {bw:.0f} GB/s. "
            f"Versions: MLX {v.get('mlx', '?')}, mlx-lm {v.get('mlx-lm', '?')}, pymlxc {v.get('pymlxc_git', '?')}, "
            f"Python {v.get('python', '?')}. Date: {report['date']}. Greedy, EOS ignored, {s['max_tokens']} tokens, "
            f"medians of {s['runs']} runs" + (f", {s['layers']} layers" if s.get("layers") else "") + ".")


def reproduce_command(settings: dict[str, Any], case: dict[str, Any]) -> str:
    """The command line that measures `case` again with the settings of the run that measured it."""
    parts = ["python benchmarks/compare_mlx_lm.py", f"--shapes {case['shape']}", f"--quant {case['quant']}",
             "--prompt-lengths " + " ".join(map(str, settings["prompt_lengths"])), f"--max-tokens {settings['max_tokens']}",
             f"--runs {settings['runs']}", f"--load-runs {settings.get('load_runs', 3)}"]
    if settings.get("layers"):
        parts.append(f"--layers {settings['layers']}")
    if settings.get("cpu"):
        parts.append("--cpu")
    if settings.get("shape_json"):  # last: the page's commands start with the shape
        parts.append("--shape-json " + " ".join(settings["shape_json"]))
    return " ".join(parts)


def merge(files: list[Path], out: Path) -> int:
    """One report from several: each case keeps the run that measured it (date, commit, versions and
    the command that reproduces it), and a case measured in several files keeps the latest run."""
    reports = [json.loads(f.read_text()) for f in files]
    if not reports:
        print("--merge: no files given", file=sys.stderr)
        return 2
    latest: dict[tuple[Any, ...], dict[str, Any]] = {}
    for path, report in sorted(zip(files, reports), key=lambda fr: fr[1]["date"]):
        for case in report["cases"]:
            run = case.get("run") or {
                "date": report["date"], "versions": report["versions"], "source": path.name,
                "command": reproduce_command(report["settings"], case)}
            key = (case["shape"], case["quant"], case["prompt_tokens"], case.get("layers"))
            latest[key] = dict(case, run=run)
    order = {(s, q): i for i, (s, q) in enumerate((s, q) for s in SHAPES for q in QUANTS)}
    cases = sorted(latest.values(), key=lambda c: (order.get((c["shape"], c["quant"]), len(order)), c["prompt_tokens"]))
    merged = dict(max(reports, key=lambda r: r["date"]))
    merged["cases"] = cases
    merged["skipped"] = [c for r in reports for c in r.get("skipped", [])]
    merged.pop("merged_from", None)
    json_path, chart_path = ((out, out.with_suffix(".png")) if out.suffix == ".json"
                             else (out / "compare_mlx_lm.json", out / "compare_mlx_lm.png"))
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(merged, indent=1) + "\n")
    print(results_page_table(merged))
    for skip in merged["skipped"]:
        print(f"\nskipped {skip['shape']} {skip['quant']}: {skip['reason']}")
    chart(merged, chart_path)
    return 0


def results_page_table(report: dict[str, Any]) -> str:
    """The BENCHMARKS.md table of a merged report: one row per case with its commit and date, and a
    numbered list of the commands that reproduce the rows."""
    commands: list[str] = []
    lines = ["| shape | quant | prompt | decode tok/s pymlxc | mlx-lm | decode | prefill | peak memory | load "
             "| commit | date | command |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|---|"]
    for case in report["cases"]:
        run = case["run"]
        if run["command"] not in commands:
            commands.append(run["command"])
        r = case["ratio"]
        lines.append(
            f"| {case['shape']} | {case['quant']} | {case['prompt_tokens']} | "
            f"{case['sides']['pymlxc']['decode_tps']['median']:.0f} | {case['sides']['mlx_lm']['decode_tps']['median']:.0f} | "
            f"{r['decode']:.2f}x | {r['prefill']:.2f}x | {r['peak_memory']:.2f}x | {r['load']:.2f}x | "
            f"`{run['versions'].get('pymlxc_git', '?')}` | {run['date'][:10]} | [{commands.index(run['command']) + 1}] |")
    versions = sorted({", ".join(f"{k} {v}" for k, v in c["run"]["versions"].items() if k != "pymlxc_git")
                       for c in report["cases"]})
    lines += ["", "Versions: " + "; ".join(versions) + "."]
    lines += [""] + [f"[{i}] `{c}`" for i, c in enumerate(commands, 1)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.merge is not None:
        return merge(args.merge, args.out)
    if args.cpu:
        mlx.set_default_device(mlx.cpu)
        pmx.set_default_device(pmx.cpu)
    args.out.mkdir(parents=True, exist_ok=True)
    tmp = None
    if args.models_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="pymlxc-bench-")
        models_root = Path(tmp.name)
    else:
        models_root = args.models_dir
        models_root.mkdir(parents=True, exist_ok=True)
    capacity = memory_capacity(args.cpu)
    bw_bytes = (args.bandwidth_mb << 20) if args.bandwidth_mb else ((256 << 20) if args.cpu else (1 << 30))
    bandwidth = measure_bandwidth(bw_bytes)
    print(f"device {mlx.default_device()}; memory {capacity and _gb(capacity)}; bandwidth "
          f"{bandwidth['read_bytes_per_s'] / 1e9:.1f} GB/s read, {bandwidth['copy_bytes_per_s'] / 1e9:.1f} GB/s copy",
          flush=True)
    sides: list[Side] = [Pymlxc(True), MlxLm()]
    if args.uncompiled:
        sides.append(Pymlxc(False))
    if args.segmented:
        sides.append(Pymlxc(True, "segmented"))
    if args.graph:
        sides.append(Pymlxc(True, "graph"))
    if args.cuda_matvec is not None:
        sides.append(Pymlxc(True, cuda_matvec=args.cuda_matvec))
    if args.fused_norm is not None:
        sides.append(Pymlxc(True, fused_norm=args.fused_norm))
    if args.cuda_argmax is not None:
        sides.append(Pymlxc(True, cuda_argmax=args.cuda_argmax))
    if args.rope_kv is not None:
        sides.append(Pymlxc(True, rope_kv=args.rope_kv))
    if args.nothread:
        sides.append(Pymlxc(True, threaded=False))
    report: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION, "kind": "compare_mlx_lm",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": device_facts(args.cpu), "versions": versions(args.git_rev), "bandwidth": bandwidth,
        "settings": {"shapes": args.shapes, "quant": args.quant, "prompt_lengths": args.prompt_lengths,
                     "max_tokens": args.max_tokens, "runs": args.runs, "load_runs": args.load_runs,
                     "layers": args.layers, "cpu": args.cpu, "greedy": True, "eos_ignored": True,
                     "shape_json": [str(p) for p in args.shape_json],
                     "sides": [s.name for s in sides]},
        "cases": [], "skipped": [],
    }
    out_json = args.out / "compare_mlx_lm.json"
    try:
        for shape in args.shapes:
            for quant in args.quant:
                need = estimated_bytes(shape, quant, args.layers) * args.memory_headroom
                if (shape, quant) in BIG and capacity is not None and need > capacity:
                    reason = f"needs about {_gb(need)}, the device has {_gb(capacity)}"
                    print(f"skip {shape} {quant}: {reason}", flush=True)
                    report["skipped"].append({"shape": shape, "quant": quant, "reason": reason})
                    continue
                if capacity is not None and need > capacity:
                    reason = f"needs about {_gb(need)}, the device has {_gb(capacity)}"
                    print(f"skip {shape} {quant}: {reason}", flush=True)
                    report["skipped"].append({"shape": shape, "quant": quant, "reason": reason})
                    continue
                print(f"case {shape} {quant}", flush=True)
                report["cases"] += run_case(shape, quant, args, sides, bandwidth["read_bytes_per_s"], models_root)
                out_json.write_text(json.dumps(report, indent=1) + "\n")  # partial results survive a timeout
    finally:
        for side in sides:
            side.free()
        out_json.write_text(json.dumps(report, indent=1) + "\n")
        if tmp is not None:
            tmp.cleanup()
    print()
    print(header(report))
    print()
    print(markdown_table(report))
    if chart(report, args.out / "compare_mlx_lm.png"):
        print(f"\nwrote {out_json} and {args.out / 'compare_mlx_lm.png'}")
    else:
        print(f"\nwrote {out_json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

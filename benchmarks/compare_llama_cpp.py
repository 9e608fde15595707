"""pymlxc against llama.cpp on the same GGUF files, and pymlxc on its own formats of the same shape.

For each shape (random weights of a real model's shapes, `pymlxc/testing/shapes.py`) this writes the model
in float16 with a byte-level BPE vocabulary, converts it to an F16 GGUF with pymlxc's own writer
(`pymlxc.testing_gguf`, as llama.cpp's converter lays it out), quantizes that with llama.cpp's
`llama-quantize` (Q4_0, Q4_K_M, Q6_K, Q8_0: llama.cpp's recipes, mixed types included), and writes
pymlxc's native checkpoint of the same bit width (bfloat16 for F16; MLX affine group 64 with 4, 6
or 8 bits; for Q4_K_M 4 bits with 6 where the recipe has Q6_K, `q4_k_m_native_bits`). Then, per format, in rounds that alternate the three sides (so that drift on a busy
machine hits them alike):

- llama.cpp: `llama-bench -p <prompts> -n <tokens> -ngl 99 -r 1 -o json` on the GGUF file (prefill
  `pp<N>` and decode `tg<tokens>`: llama-bench times decode from an empty context);
- pymlxc on the GGUF file and pymlxc on its native checkpoint: greedy generation of <tokens>
  tokens after a prompt of each length, prefill tok/s = prompt / time to first token, decode tok/s =
  tokens after the first / the time after it (`compare_mlx_lm.timed_run`), each timed run just after
  an untimed prefill of the same prompt and a first token, as llama-bench warms up before each of
  its tests (`--no-warm-each`: without).

Medians over the rounds. The bandwidth fraction of a decode is weight bytes read per token (the
file's tensors, less an untied embedding table, of which a token reads one row) x tok/s over the
copy bandwidth measured here with MLX.

llama.cpp: `--llama-cpp DIR` names a build folder holding `llama-bench` and `llama-quantize`
(directly or under bin/ or build/bin/); `--llama-cpp-src TARBALL` builds them there first (CMake;
CUDA for sm_90 unless --cpu), reusing a finished build. The tarball is llama.cpp's source (for
example cut from llama-cpp-python's sdist); nothing is downloaded.

    python benchmarks/compare_llama_cpp.py --llama-cpp-src .lcp/llama.cpp-src.tar.gz --llama-cpp /tmp/lcp \\
        --shapes llama-3.2-1b llama-3.1-8b --out results/
    python benchmarks/compare_llama_cpp.py --cpu --shapes llama-3.2-1b-narrow --layers 2 --no-llama-cpp \\
        --prompt-lengths 16 --max-tokens 8 --rounds 1      # the plumbing on a CPU, pymlxc only

Without llama-quantize (--no-llama-cpp), the quantized files are written by pymlxc's writer with
each recipe's main type and its Q6_K output / embedding, and for Q4_K_M the recipe's Q6_K value and
down projections (`q4_k_m_layer_types`; `--no-llama-cpp` is for checking the plumbing; the real
recipes' other choices, and their quantization's rounding, come from llama-quantize). Writes `compare_llama_cpp.json`,
`compare_llama_cpp.md` (the table) and `compare_llama_cpp.png` (matplotlib, when installed) into --out.
"""
from __future__ import annotations

import _path  # noqa: F401 - the checkout as installed (backends as pymlxc.backends)

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

import numpy as np

# MLX, pymlxc (with its random models) and compare_mlx_lm are imported where a stage needs them: --build-only
# runs on a machine where MLX is not installed yet.

SCHEMA_VERSION = 1
# GGUF format -> (llama-quantize type, native checkpoint: bits or None for bfloat16)
FORMATS: dict[str, tuple[str | None, int | None]] = {
    "f16": (None, None), "q4_0": ("Q4_0", 4), "q4_k_m": ("Q4_K_M", 4), "q6_k": ("Q6_K", 6), "q8_0": ("Q8_0", 8)}
DEFAULT_FORMATS = ("q4_0", "q4_k_m", "f16", "q6_k", "q8_0")  # the issues' cases first
TOOLS = ("llama-bench", "llama-quantize")


# ---------------------------------------------------------------------- llama.cpp

def find_tools(folder: Path) -> Path | None:
    """The folder under `folder` that holds both tools, if any."""
    for sub in (folder, folder / "bin", folder / "build" / "bin"):
        if all((sub / t).is_file() and os.access(sub / t, os.X_OK) for t in TOOLS):
            return sub
    return None


def build_llama_cpp(tarball: Path, folder: Path, cuda: bool, jobs: int) -> Path:
    """Build llama-bench and llama-quantize from llama.cpp's source `tarball` in `folder` (static,
    Release, no network features; CUDA for sm_90 when `cuda`). Returns the folder of the binaries."""
    found = find_tools(folder)
    if found is not None:
        return found
    src = folder / "src"
    if not (src / "CMakeLists.txt").is_file():
        src.mkdir(parents=True, exist_ok=True)
        with tarfile.open(tarball) as tar:
            top = tar.getmembers()[0].name.split("/")[0]
            tar.extractall(folder, filter="data")
        shutil.rmtree(src)
        (folder / top).rename(src)
    options = ["-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF",
               "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DGGML_NATIVE=OFF",
               "-DGGML_CCACHE=OFF"]
    if cuda:
        options += ["-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=90"]
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    build = folder / "build"
    t = time.perf_counter()
    subprocess.run(["cmake", "-S", str(src), "-B", str(build), *generator, *options], check=True)
    subprocess.run(["cmake", "--build", str(build), "-j", str(jobs), "--target", *TOOLS], check=True)
    print(f"  built llama.cpp ({'cuda' if cuda else 'cpu'}) in {time.perf_counter() - t:.0f}s", flush=True)
    found = find_tools(folder)
    if found is None:
        raise RuntimeError(f"the build in {build} did not leave {' and '.join(TOOLS)}")
    return found


def llama_bench(tools: Path, gguf: Path, prompts: list[int], tokens: int, cpu: bool, threads: int) -> dict[str, float]:
    """One llama-bench run: {"pp<N>": tok/s, "tg<tokens>": tok/s}."""
    cmd = [str(tools / "llama-bench"), "-m", str(gguf), "-p", ",".join(map(str, prompts)), "-n", str(tokens),
           "-ngl", "0" if cpu else "99", "-r", "1", "-o", "json", "-t", str(threads)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr[-2000:]}")
    out: dict[str, float] = {}
    for entry in json.loads(done.stdout):
        key = f"tg{entry['n_gen']}" if entry["n_gen"] else f"pp{entry['n_prompt']}"
        out[key] = float(entry["avg_ts"])
    return out


# ---------------------------------------------------------------------- the files

def gguf_tensor_bytes(path: Path) -> tuple[int, int]:
    """(bytes of every tensor, bytes a decode step reads: less an untied token embedding)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path), "r")
    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    total = sum(sizes.values())
    per_token = total - (sizes.get("token_embd.weight", 0) if "output.weight" in sizes else 0)
    return total, per_token


def prepare(shape: str, formats: list[str], root: Path, layers: int | None, tools: Path | None,
            threads: int, drop_source: bool = False) -> dict[str, dict[str, Path]]:
    """Write (or reuse) the source model, its F16 GGUF, each format's GGUF and native checkpoint.
    Returns {format: {"gguf": path, "native": path}}."""
    from gguf import GGMLQuantizationType as QType

    from pymlxc.testing.shapes import shape_config, weight_bytes, write_byte_tokenizer, write_random_model
    from pymlxc.testing_gguf import export_gguf

    tag = shape + ("" if layers is None else f"-{layers}l")
    src = root / f"{tag}-f16-src"
    config = shape_config(shape, layers)
    f16 = root / f"{tag}-f16.gguf"
    ggufs = {fmt: f16 if FORMATS[fmt][0] is None else root / f"{tag}-{fmt}.gguf" for fmt in formats}
    missing = [fmt for fmt, path in ggufs.items() if not path.is_file()]
    if missing and not (src / "tokenizer.json").is_file() and not (f16.is_file() and tools is not None):
        t = time.perf_counter()
        write_random_model(src, shape, layers=layers, dtype="float16")
        write_byte_tokenizer(src, config)
        print(f"  wrote {src.name} ({weight_bytes(src) / 2**30:.2f} GiB) in {time.perf_counter() - t:.0f}s", flush=True)
    if missing and not f16.is_file():
        t = time.perf_counter()
        export_gguf(src, f16.with_suffix(".part"), QType.F16, pre="gpt-2")
        f16.with_suffix(".part").rename(f16)
        print(f"  wrote {f16.name} in {time.perf_counter() - t:.0f}s", flush=True)
    for fmt in missing:
        qname = FORMATS[fmt][0]
        gguf = ggufs[fmt]
        if qname is None:
            continue
        t = time.perf_counter()
        part = gguf.with_suffix(".part")
        if tools is not None:
            done = subprocess.run([str(tools / "llama-quantize"), str(f16), str(part), qname, str(threads)],
                                  capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"llama-quantize {qname} failed: {done.stderr[-2000:]}")
        else:  # the recipe's main type, with llama.cpp's Q6_K output / embedding (plumbing checks)
            main = {"q4_0": QType.Q4_0, "q4_k_m": QType.Q4_K, "q6_k": QType.Q6_K, "q8_0": QType.Q8_0}[fmt]
            head = QType.Q8_0 if fmt == "q8_0" else QType.Q6_K
            extra = {"token_embd.weight": head, "output.weight": head}
            if fmt == "q4_k_m":
                extra |= q4_k_m_layer_types(config["num_hidden_layers"])
            export_gguf(src, part, main, pre="gpt-2", extra_types=extra)
        part.rename(gguf)
        print(f"  wrote {gguf.name} in {time.perf_counter() - t:.0f}s", flush=True)
    if drop_source:  # disk space: the float16 source (and an F16 file not benchmarked) are done with
        shutil.rmtree(src, ignore_errors=True)
        if "f16" not in formats:
            f16.unlink(missing_ok=True)
    out: dict[str, dict[str, Path]] = {}
    for fmt in formats:
        bits = FORMATS[fmt][1]
        gguf = ggufs[fmt]
        # Q4_K_M against the native checkpoint with its bit widths (4 bits, 6 where it has Q6_K)
        mixed = q4_k_m_native_bits(config) if fmt == "q4_k_m" else None
        native = root / f"{tag}-{'bf16' if bits is None else f'{bits}bit'}{'-q4_k_m-mix' if mixed else ''}"
        if not (native / "model.safetensors.index.json").is_file():
            write_random_model(native, shape, bits=bits, layers=layers, dtype="bfloat16", module_bits=mixed)
        out[fmt] = {"gguf": gguf, "native": native}
    return out


def q4_k_m_more_bits(layers: int) -> list[int]:
    """The layers whose value and down projections llama.cpp's Q4_K_M recipe stores as Q6_K
    (`llama_tensor_get_type`'s `use_more_bits`): the first and last eighth, and every third between."""
    return [i for i in range(layers)
            if i < layers // 8 or i >= 7 * layers // 8 or (i - layers // 8) % 3 == 2]


def q4_k_m_layer_types(layers: int) -> dict[str, Any]:
    """The Q6_K layers of llama.cpp's Q4_K_M recipe, by GGUF tensor name."""
    from gguf import GGMLQuantizationType as QType

    return {f"blk.{i}.{name}.weight": QType.Q6_K for i in q4_k_m_more_bits(layers) for name in ("attn_v", "ffn_down")}


def q4_k_m_native_bits(config: dict[str, Any]) -> dict[str, int]:
    """The native checkpoint of a Q4_K_M file's bit widths (MLX affine group 64, `write_random_model`'s
    `module_bits` over 4 bits): 6 bits where the recipe has Q6_K, the recipe's value and down
    projections and the output head (the tied embedding where there is no head)."""
    head = "model.embed_tokens" if config.get("tie_word_embeddings") else "lm_head"
    six = {head: 6}
    for i in q4_k_m_more_bits(config["num_hidden_layers"]):
        six |= {f"model.layers.{i}.self_attn.v_proj": 6, f"model.layers.{i}.mlp.down_proj": 6}
    return six


# ---------------------------------------------------------------------- one case

def pymlxc_runs(side: Any, prompts: dict[int, list[int]], tokens: int, warm_each: bool = True
                ) -> dict[int, dict[str, Any]]:
    """One timed generation per prompt. `warm_each`: an untimed prefill of the same prompt and a
    first token just before each timed run, as llama-bench runs an untimed `pp<N>` and one token of
    `tg` before each test it times (its default warm-up); without it, a run follows the other
    prompt's or the other side's work, with the device's clocks and caches as that left them."""
    from compare_mlx_lm import timed_run, warm_up

    out = {}
    for n, ids in prompts.items():
        if warm_each:
            warm_up(side, ids, tokens, steps=2)
        out[n] = timed_run(side, ids, tokens)
    return out


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def run_case(shape: str, fmt: str, files: dict[str, Path], args: argparse.Namespace, tools: Path | None,
             bandwidth: float) -> dict[str, Any]:
    from compare_mlx_lm import Pymlxc, bytes_per_token, warm_up
    from pymlxc.testing.shapes import shape_config

    config = shape_config(shape, args.layers)
    rng = np.random.default_rng(0)
    v = config["vocab_size"]
    # Ordinary ids (clear of the special ids at either end of the shapes' vocabularies)
    prompts = {n: rng.integers(3 if v < 2000 else 1000, min(v, 100000), n).tolist() for n in args.prompt_lengths}
    total, per_token = gguf_tensor_bytes(files["gguf"])
    native_per_token = bytes_per_token(files["native"], config)
    sides = {"pymlxc_gguf": Pymlxc(), "pymlxc_native": Pymlxc()}
    if args.matvec_off:  # the GGUF file with MLX's quantized_matmul for its affine layers
        sides["pymlxc_gguf_matvec0"] = Pymlxc(cuda_matvec="0")
    load_s: dict[str, float] = {}
    for name, side in sides.items():
        side.name = name
        t = time.perf_counter()
        side.load(files["native" if name == "pymlxc_native" else "gguf"])
        load_s[name] = time.perf_counter() - t
        for ids in prompts.values():
            warm_up(side, ids, args.max_tokens)
    runs: dict[str, list[Any]] = {name: [] for name in [*(["llama_cpp"] if tools else []), *sides]}
    for r in range(args.rounds):
        if tools is not None:
            runs["llama_cpp"].append(llama_bench(tools, files["gguf"], args.prompt_lengths, args.max_tokens,
                                                 args.cpu, args.threads))
        for name, side in sides.items():
            runs[name].append(pymlxc_runs(side, prompts, args.max_tokens, not args.no_warm_each))
        print(f"    round {r + 1}/{args.rounds} done", flush=True)
    generated = {name: len(rs[0][args.prompt_lengths[0]]["tokens"]) for name, rs in runs.items() if name != "llama_cpp"}
    result: dict[str, Any] = {"shape": shape, "format": fmt, "layers": args.layers, "gguf": files["gguf"].name,
                              "native": files["native"].name, "gguf_tensor_bytes": total,
                              "bytes_per_token": {"gguf": per_token, "native": native_per_token},
                              "memory_after_load": {}, "load_s": load_s, "generated": generated, "sides": {}}
    for name, side in sides.items():
        result["memory_after_load"][name] = side.weights
        side.free()
    if args.peak_memory:
        result["peak_gpu_mib"] = peak_memory(files, tools, max(args.prompt_lengths), args.max_tokens)
    for name, rs in runs.items():
        entry: dict[str, Any] = {}
        for n in args.prompt_lengths:
            if name == "llama_cpp":
                pre = [r[f"pp{n}"] for r in rs]
                dec = [r[f"tg{args.max_tokens}"] for r in rs]
            else:
                pre = [r[n]["prefill_tps"] for r in rs]
                dec = [r[n]["decode_tps"] for r in rs]
            entry[str(n)] = {"prefill_tps": median(pre), "decode_tps": median(dec), "prefill_runs": pre,
                             "decode_runs": dec}
        bpt = native_per_token if name == "pymlxc_native" else per_token
        dec_med = entry[str(args.prompt_lengths[0])]["decode_tps"]
        entry["bandwidth_fraction"] = (bpt * dec_med / bandwidth) if dec_med else None
        result["sides"][name] = entry
    return result


def peak_memory(files: dict[str, Path], tools: Path | None, prompt_tokens: int, max_tokens: int
                ) -> dict[str, int | None]:
    """Each side's peak GPU memory (MiB, nvidia-smi) over one generation of `max_tokens` after
    `prompt_tokens`, each in a process of its own (gpu_memory.py): llama.cpp's `llama-bench -pg`
    on the GGUF file, pymlxc on the GGUF file and on the native checkpoint."""
    from gpu_memory import llama_bench_command, peak_of, pymlxc_command

    out: dict[str, int | None] = {}
    if tools is not None:
        out["llama_cpp"] = peak_of(llama_bench_command(tools, files["gguf"], prompt_tokens, max_tokens))[1]
    for name, key in (("pymlxc_gguf", "gguf"), ("pymlxc_native", "native")):
        out[name] = peak_of(pymlxc_command(files[key], prompt_tokens, max_tokens))[1]
    print(f"    peak GPU memory (MiB) at {prompt_tokens} + {max_tokens} tokens: {out}", flush=True)
    return out


# ---------------------------------------------------------------------- report

def table(report: dict[str, Any]) -> str:
    """Markdown: per shape and format, decode and prefill tok/s of the three sides."""
    lengths = report["settings"]["prompt_lengths"]
    head = ["shape", "format"]
    for n in lengths:
        head += [f"decode @{n}: GGUF / native / llama.cpp", f"prefill {n}: GGUF / native / llama.cpp"]
    head += ["GGUF / llama.cpp decode", "bandwidth (GGUF, native, llama.cpp)", "memory / file"]
    matvec0 = any("pymlxc_gguf_matvec0" in c["sides"] for c in report["cases"])
    if matvec0:
        head.append(f"GGUF decode @{lengths[0]}, MLX's quantized_matmul")
    peaks = any("peak_gpu_mib" in c for c in report["cases"])
    if peaks:
        head.append("peak GPU MiB: GGUF / native / llama.cpp (pymlxc GGUF / llama.cpp)")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def num(x: float | None) -> str:
        return "-" if x is None else f"{x:.0f}"

    for c in report["cases"]:
        s = c["sides"]
        row = [c["shape"] + ("" if c["layers"] is None else f" ({c['layers']} layers)"), c["format"].upper()]
        for n in map(str, lengths):
            get = lambda side, key: s.get(side, {}).get(n, {}).get(key)  # noqa: E731
            row.append(" / ".join(num(get(side, "decode_tps")) for side in ("pymlxc_gguf", "pymlxc_native", "llama_cpp")))
            row.append(" / ".join(num(get(side, "prefill_tps")) for side in ("pymlxc_gguf", "pymlxc_native", "llama_cpp")))
        first = str(lengths[0])
        g, lc = s["pymlxc_gguf"][first]["decode_tps"], s.get("llama_cpp", {}).get(first, {}).get("decode_tps")
        row.append(f"{g / lc:.2f}x" if g and lc else "-")
        row.append(", ".join("-" if s.get(k, {}).get("bandwidth_fraction") is None else f"{s[k]['bandwidth_fraction']:.0%}"
                             for k in ("pymlxc_gguf", "pymlxc_native", "llama_cpp")))
        row.append(f"{c['memory_after_load']['pymlxc_gguf'] / c['gguf_tensor_bytes']:.3f}")
        if matvec0:
            row.append(num(s.get("pymlxc_gguf_matvec0", {}).get(first, {}).get("decode_tps")))
        if peaks:
            pk = c.get("peak_gpu_mib", {})
            mine, theirs = pk.get("pymlxc_gguf"), pk.get("llama_cpp")
            row.append(" / ".join(num(pk.get(k)) for k in ("pymlxc_gguf", "pymlxc_native", "llama_cpp"))
                       + (f" ({mine / theirs:.2f}x)" if mine and theirs else ""))
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def chart(report: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    cases = report["cases"]
    first = str(report["settings"]["prompt_lengths"][0])
    names = ("pymlxc_gguf", "pymlxc_native", "llama_cpp")
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(cases)), 4))
    width = 0.27
    for i, name in enumerate(names):
        values = [c["sides"].get(name, {}).get(first, {}).get("decode_tps") or 0 for c in cases]
        ax.bar([j + (i - 1) * width for j in range(len(cases))], values, width, label=name)
    ax.set_xticks(range(len(cases)), [f"{c['shape']}\n{c['format']}" for c in cases], fontsize=8)
    ax.set_ylabel(f"decode tok/s (prompt {first})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["llama-3.2-1b", "llama-3.1-8b"])
    p.add_argument("--formats", nargs="+", choices=sorted(FORMATS), default=list(DEFAULT_FORMATS))
    p.add_argument("--prompt-lengths", nargs="+", type=int, default=[128, 2048])
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-warm-each", action="store_true",
                   help="time each pymlxc run without the untimed run of the same prompt just before it "
                        "(llama-bench warms up before each test; the harness's runs before this option)")
    p.add_argument("--layers", type=int, default=None, help="fewer layers than the real shape (quick runs)")
    p.add_argument("--models-dir", type=Path, default=Path("/tmp/pymlxc-llama-cpp-models"))
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/compare_llama_cpp"))
    p.add_argument("--git-rev", help="the commit to record when this copy's git metadata is stale (a lent machine)")
    p.add_argument("--llama-cpp", type=Path, default=None, help="llama.cpp build folder (llama-bench, llama-quantize)")
    p.add_argument("--llama-cpp-src", type=Path, default=None, help="llama.cpp source tarball to build from")
    p.add_argument("--no-llama-cpp", action="store_true", help="pymlxc only (files from pymlxc's writer)")
    p.add_argument("--cpu", action="store_true", help="run on the CPU (MLX and llama.cpp)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 4)
    p.add_argument("--matvec-off", action="store_true",
                   help="a fourth side: the GGUF file with PYMLXC_CUDA_MATVEC=0 (MLX's kernels for affine layers)")
    p.add_argument("--drop-source", action="store_true",
                   help="delete the float16 source model (and an unused F16 GGUF) once the files are written")
    p.add_argument("--build-only", action="store_true", help="build llama.cpp's tools, then stop")
    p.add_argument("--prepare-only", action="store_true", help="write the models and files, then stop")
    p.add_argument("--peak-memory", action="store_true",
                   help="also each side's peak GPU memory (nvidia-smi) over a generation at the longest prompt, "
                        "each side in a process of its own (gpu_memory.py)")
    args = p.parse_args(argv)
    if not args.no_llama_cpp and args.llama_cpp is None:
        p.error("name --llama-cpp (a build folder, or where to build with --llama-cpp-src) or pass --no-llama-cpp")
    if args.rounds < 1 or args.max_tokens < 2 or min(args.prompt_lengths) < 1:
        p.error("--rounds >= 1, --max-tokens >= 2 and prompt lengths >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tools = None
    if not args.no_llama_cpp:
        tools = (build_llama_cpp(args.llama_cpp_src, args.llama_cpp, not args.cpu, args.threads)
                 if args.llama_cpp_src is not None else find_tools(args.llama_cpp))
        if tools is None:
            raise SystemExit(f"no {' and '.join(TOOLS)} under {args.llama_cpp}; give --llama-cpp-src to build them")
    if args.build_only:
        print(f"llama.cpp tools in {tools}")
        return 0
    import mlx.core as mlx

    import pymlxc.core as pmx
    from compare_mlx_lm import device_facts, measure_bandwidth, versions

    if args.cpu:
        mlx.set_default_device(mlx.cpu)
        pmx.set_default_device(pmx.cpu)
    args.models_dir.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    bandwidth = measure_bandwidth(1 << 28 if not args.cpu else 1 << 26)
    report: dict[str, Any] = {
        "schema": SCHEMA_VERSION, "kind": "compare_llama_cpp",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "device": device_facts(args.cpu), "versions": versions(args.git_rev), "bandwidth": bandwidth,
        "settings": {"prompt_lengths": args.prompt_lengths, "max_tokens": args.max_tokens, "rounds": args.rounds,
                     "warm_each": not args.no_warm_each,
                     "formats": args.formats, "llama_cpp": str(tools) if tools else None},
        "cases": []}
    for shape in args.shapes:
        print(f"== {shape}", flush=True)
        files = prepare(shape, args.formats, args.models_dir, args.layers, tools, args.threads, args.drop_source)
        if args.prepare_only:
            continue
        for fmt in args.formats:
            print(f"  -- {fmt}", flush=True)
            try:
                case = run_case(shape, fmt, files[fmt], args, tools, bandwidth["copy_bytes_per_s"])
            except Exception as exc:  # noqa: BLE001 - one failed case must not lose the others' numbers
                print(f"  !!! {shape} {fmt} failed: {type(exc).__name__}: {exc}", flush=True)
                report["cases"].append({"shape": shape, "format": fmt, "error": f"{type(exc).__name__}: {exc}"})
                continue
            report["cases"].append(case)
            (args.out / "compare_llama_cpp.json").write_text(json.dumps(report, indent=1) + "\n")
    if args.prepare_only:
        return 0
    done = {**report, "cases": [c for c in report["cases"] if "error" not in c]}
    md = table(done) if done["cases"] else "no case finished\n"
    (args.out / "compare_llama_cpp.json").write_text(json.dumps(report, indent=1) + "\n")
    (args.out / "compare_llama_cpp.md").write_text(md)
    if done["cases"]:
        chart(done, args.out / "compare_llama_cpp.png")
    print(md)
    return 0 if len(done["cases"]) == len(report["cases"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())

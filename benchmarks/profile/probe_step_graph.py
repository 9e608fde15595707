"""The MLX primitives of one compiled decode step, by name: what the host builds and encodes per token.

On a GPU whose decode is bound by the host, MLX's per-primitive work (replaying the compiled tape,
then encoding every node) sets the step time, and a node that launches no kernel (a reshape, a
slice, a broadcast) still costs both. This prints the graph of one step of the compiled decoder
(MLX's `print_graph`, after the step's inputs are evaluated, so only that step's nodes appear) and
tallies its nodes by primitive.

    python benchmarks/profile/probe_step_graph.py --shape llama-3.2-1b --quant 4bit --out DIR
    python benchmarks/profile/probe_step_graph.py --model PATH --out DIR

Writes DIR/step-graph-<name>.txt (the graph) and .json (nodes by primitive, per layer).
"""
from __future__ import annotations

import argparse
import collections
import ctypes
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import _path  # noqa: F401 - the checkout as installed

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import compare_mlx_lm as bench  # noqa: E402


def print_graph(outputs: list[Any]) -> str:
    """MLX's text form of the graph behind `outputs` (mlx_print_graph into a temporary file)."""
    from pymlxc.core._gen import vector_of  # noqa: PLC0415
    from pymlxc.core._loader import ffi, lib  # noqa: PLC0415

    libc = ctypes.CDLL(None)
    libc.fopen.restype = ctypes.c_void_p
    libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    libc.fclose.argtypes = [ctypes.c_void_p]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "graph.txt")
        handle = libc.fopen(path.encode(), b"w")
        f = ffi.cast("FILE *", handle)
        namer = lib.mlx_node_namer_new()
        _, vec = vector_of(outputs)
        try:
            lib.mlx_print_graph(f, namer, vec[0])
        finally:
            libc.fclose(handle)
            lib.mlx_node_namer_free(namer)
        return Path(path).read_text()


def tally(text: str) -> collections.Counter[str]:
    """Nodes by primitive: MLX prints a node as `Primitive ... -> outputs` after the inputs."""
    counts: collections.Counter[str] = collections.Counter()
    for line in text.splitlines():
        if "->" not in line:
            continue
        head = line.split("->")[0].split()
        if head:
            counts[head[0]] += 1
    return counts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama-3.2-1b")
    p.add_argument("--quant", default="4bit", choices=["bf16", "4bit", "f32"])
    p.add_argument("--model", type=Path, default=None, help="a model folder or GGUF file instead of --shape")
    p.add_argument("--models-dir", type=Path, default=Path("/tmp/pymlxc-bench-models"))
    p.add_argument("--step", type=int, default=6, help="which decode step to print")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    import pymlxc.core as mx  # noqa: PLC0415
    from pymlxc.backends.metal.decode import decoder as dec  # noqa: PLC0415
    from pymlxc.backends.metal.decode import segments  # noqa: PLC0415

    path = args.model or bench.model_dir(args.models_dir, args.shape, args.quant, None)
    side = bench.Pymlxc(threaded=False)  # the graph is read on this thread, where its streams are
    side.load(path)
    captured: dict[str, Any] = {}
    calls = [0]

    def hooked(original: Any) -> Any:
        def call(self: Any, tokens: Any, pos: Any) -> Any:
            calls[0] += 1
            if calls[0] != args.step or "text" in captured:
                return original(self, tokens, pos)
            mx.eval([tokens, pos, self._buffers])  # noqa: SLF001 - the earlier steps out of the graph
            out = original(self, tokens, pos)
            captured["text"] = print_graph(list(out))
            return out
        return call

    # The segmented step (the Llama family) and the whole-step graph (the rest).
    patched = [(segments.SegmentedSession, "_step"), (dec.DecodeSession, "_call")]
    originals = [getattr(cls, name) for cls, name in patched]
    for (cls, name), original in zip(patched, originals, strict=True):
        setattr(cls, name, hooked(original))
    try:
        prompt = bench.probe_prompt(32, side.vocab)
        sum(1 for _ in side.stream(prompt, args.step + 4))
    finally:
        for (cls, name), original in zip(patched, originals, strict=True):
            setattr(cls, name, original)
    if "text" not in captured:
        print("the compiled decode did not run (no step was captured)", file=sys.stderr)
        return 1
    text = captured["text"]
    counts = tally(text)
    layers = int(getattr(side.loaded.model, "num_layers", 0) or len(getattr(side.loaded.model, "layers", [])))
    name = args.model.name if args.model else f"{args.shape}-{args.quant}"
    result = {"model": name, "nodes": sum(counts.values()), "layers": layers,
              "nodes_per_layer": sum(counts.values()) / max(layers, 1), "by_primitive": dict(counts.most_common()),
              "device": str(mx.default_device())}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"step-graph-{name}.txt").write_text(text)
    (args.out / f"step-graph-{name}.json").write_text(json.dumps(result, indent=1))
    print(f"{name}: {result['nodes']} nodes in one step ({result['nodes_per_layer']:.1f} a layer over {layers})")
    for prim, n in counts.most_common(30):
        print(f"  {n:6d}  {prim}")
    side.free()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Every `PYMLXC_*` environment switch: typed, defaulted and documented in one place, read once.

`Settings.from_env()` parses the environment with one strict parser: a value a switch does not take
is a `SettingsError` naming the variable and the values it takes (nothing is silently ignored).
`current()` is the process's settings, read at its first call and kept; `LoadConfig.settings`
defaults to it and carries it down to a model (its decoder and kernel choices), so a model loaded
with explicit `Settings` ignores the environment. `override(**changes)` swaps the process's
settings for a block (tests, benchmarks and tools that compare switches in one process).

This module imports nothing from pymlxc: the binding's loader reads `lib_dir` from it before
anything else loads. `docs/settings.md` is generated from the fields here (`python -c
'import pymlxc.settings as s; print(s.markdown(), end="")' > docs/settings.md`; a test checks that the page is current).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PREFIX = "PYMLXC_"
SWITCH = ("auto", "0", "1")  # a lever that `auto` turns on where it pays
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class SettingsError(ValueError):
    """An environment variable holds a value its switch does not take; the message names both."""


def _doc(kind: str, text: str) -> dict[str, str]:
    return {"kind": kind, "doc": text}


def _switch(text: str) -> Any:
    """A field of an `auto|0|1` lever (`SWITCH`), `auto` by default."""
    return field(default="auto", metadata=_doc("|".join(SWITCH), text))


@dataclass(frozen=True)
class Settings:
    """The process's switches. Each field is `PYMLXC_<FIELD NAME IN CAPITALS>` in the environment."""

    compile: bool = field(default=True, metadata=_doc("bool", (
        "Decode on the compiled step (`backends/metal/decode/decoder.py`) where it applies; `0` keeps every "
        "generation on the uncompiled loop (the same tokens, more host time per token).")))
    decode: str = field(default="auto", metadata=_doc("auto|graph|segmented", (
        "How the compiled step is built: `graph` (the whole step as one traced graph over masked "
        "rings) or `segmented` (compiled segments around MLX's fused attention; models that declare "
        "the block halves, the Llama family). `auto`: segmented where the model has them, else graph.")))
    fuse_projections: bool = field(default=True, metadata=_doc("bool", (
        "Segmented decode, and the whole-step graph of models that declare it (Gemma 3): run each "
        "block's q/k/v and gate/up projections as one matmul each (their weights concatenated once, "
        "the linears keep views).")))
    prefill_fused_products: str = _switch(
        "The compiled prefill (`backends/metal/decode/prefill.py`) on the decode's fused projections of dense "
        "models: each block's q/k/v and gate/up products as one matmul each and one RoPE over the q and k heads "
        "(`0`: three matmuls and a RoPE more a layer, on views of the fused weights). `auto`: on CUDA (on an "
        "H200 Llama-3.2-1B bfloat16's 128-token prefill was faster with them in 6 of 7 rounds; on a CPU "
        "no faster).")
    prefill_dequantized: str = _switch(
        "The compiled prefill of quantized models: each quantized product as one dequantization of the "
        "weight and a dense matmul (the fused q/k/v and gate/up products too) instead of MLX's quantized "
        "matmul. `auto`: on CUDA, for blocks of 64 MiB or more of quantized layers (on an H200 "
        "Llama-3.1-8B 4-bit's 128-token prefill took 28.0 against 30.9 ms; Llama-3.2-1B's lost, its "
        "host's work growing); `1`: at any size.")
    prefill_dequantize_kernel: str = _switch(
        "Where the compiled prefill dequantizes (`prefill_dequantized`): each 4-bit weight dequantized before "
        "its segment by pymlxc's CUDA kernel (`kernels/dequantize.py`, one 16-byte store per packed word) and "
        "handed to the trace as an input, instead of MLX's `dequantize` inside the trace (on an H200 "
        "Llama-3.1-8B gate/up's 103 against 326 us, its 128-token prefill 1-3 ms faster). `auto`: on CUDA.")
    fused_norm: str = _switch(
        "Segmented decode and Gemma 3's whole-step graph: each residual add and the RMSNorm after it "
        "as one CUDA kernel "
        "(`kernels/add_rms_norm.py`). `auto`: on CUDA; `1`: also elsewhere (the kernel then fails its check "
        "and MLX's kernels run).")
    cuda_argmax: str = _switch(
        "Segmented greedy decode: the argmax over the vocabulary as two CUDA kernels "
        "(`kernels/argmax.py`). `auto`: on CUDA.")
    cuda_rope_kv: str = _switch(
        "Segmented decode: each layer's RoPE and key/value writes as one CUDA kernel "
        "(`kernels/rope_kv.py`). `auto`: on CUDA.")
    cuda_decode_attention: str = _switch(
        "Segmented decode: the whole step as one compiled graph, each layer's attention as CUDA kernels that "
        "read the position on the device (`kernels/decode_attention.py`, MLX's one-token kernels reproduced "
        "bit for bit), instead of a compiled call and a sliced attention per layer. `auto`: on CUDA where "
        "the RoPE kernel runs; `1`: also elsewhere, with MLX's attention over the masked buffer.")
    cuda_gate_up: str = _switch(
        "Segmented decode with pymlxc's 4-bit matvec kernel: each block's fused gate/up product and the "
        "SiLU product after it as one kernel (`kernels/matvec.py`, its paired form; MLX's SiLU and "
        "multiply reproduced bit for bit). `auto`: on CUDA.")
    cuda_matvec_fusion: str = field(default="auto", metadata=_doc("auto|0|1|ends", (
        "Segmented decode with pymlxc's 4-bit matvec kernel and the paired gate/up kernel: each residual add "
        "inside the o_proj and down_proj products and each block's RMSNorm inside the q/k/v and gate/up products "
        "(`kernels/matvec.py`'s residual and normalized forms; MLX's add and rms_norm reproduced bit for bit): "
        "two kernels fewer per layer. `ends`: the norm inside the q/k/v product and the add inside down_proj's "
        "only (the MLP's norm stays in the add + norm kernel, whose one pass over h the wide gate/up product's "
        "blocks would each repeat): one kernel fewer. Per layer: a layer whose q/k/v products are not all "
        "4-bit on the kernel (a GGUF file's Q6_K value projections) keeps MLX's norm before them, one whose "
        "down product is not keeps MLX's add after it (its o_proj and gate/up still take the forms). "
        "`auto`: on CUDA, `1` for models of "
        "at most 80 MB of 4-bit "
        "layers a block (`kernel_choice.FUSION_MAX_BYTES_PER_LAYER`: on an H200 Llama-3.2-1B 4-bit decoded "
        "849 -> 1029 tok/s, Llama-3.1-8B 314 -> 304), `ends` above; `1`: any size.")))
    cuda_rope_in_product: str = _switch(
        "Segmented decode with the normalized q/k/v product (`PYMLXC_CUDA_MATVEC_FUSION`) and the RoPE + "
        "cache-write kernel: each layer's RoPE and key/value writes inside that product (`kernels/matvec.py`'s "
        "RoPE form; `kernels/rope_kv.py`'s arithmetic reproduced bit for bit): one kernel fewer per layer. "
        "`auto`: wherever the normalized products run.")
    cuda_matvec: str = _switch(
        "4-bit quantized products of few rows through pymlxc's CUDA kernel (`kernels/matvec.py`), "
        "chosen at load. It rounds each 32 values of x to int16 against their largest (an error of at most "
        "1.5e-5 of it, below a 2-byte float output's rounding) and multiplies in integers; `0` keeps MLX's "
        "product. `auto`: on CUDA for models whose layers are large enough for it to pay; "
        "`1`: for every 4-bit model on CUDA.")
    cuda_dense_matvec: str = _switch(
        "16-bit models: the block linears' products of few rows through pymlxc's CUDA matvec kernel in its dense "
        "form (`kernels/matvec.py`), chosen at load once it agrees with float64 products, so that segmented "
        "decode can take the kernel's residual, normalized, RoPE and gate/up forms (adds, norms, RoPE and SiLU "
        "products inside the products: fewer kernels a step) as for 4-bit models (on an H100 Llama-3.2-1B "
        "bfloat16 decoded at 806 against 523 tok/s, Llama-3.1-8B at 174 against 164). `auto`: on CUDA.")
    dense_prefill: str = _switch(
        "Quantized products of 512 or more rows of x (prefill chunks) as the weights dequantized in chunks "
        "of rows and dense matmuls (`nn._dense_product`), chosen at load; such chunks skip the compiled "
        "prefill. `auto`: on CUDA (an H200's 2048-token prefill of Llama-3.2-1B 4-bit: 16.5 ms against 34.1).")
    cuda_qmm: str = _switch(
        "4-bit quantized products of 16 to 511 rows of x that run op by op (prefill chunks outside the compiled "
        "prefill: GGUF files whose layers hold Q6_K blocks, masked batches) through pymlxc's tensor-core CUDA "
        "kernel (`kernels/qmm.py`), chosen at load once the kernel agrees with MLX's product. `auto`: on CUDA.")
    cuda_prefill_attention: str = _switch(
        "The causal attention of a prompt chunk of up to 2**20 query-key pairs (1024 tokens over 1024 keys, 128 "
        "over 8192) through pymlxc's tensor-core CUDA kernel (`kernels/prefill_attention.py`), compiled once, "
        "instead of MLX's cuDNN attention, which builds a graph for each new shape (42-44 ms each on an H200: a "
        "129-133-token prompt of a length not run before took Llama-3.2-1B 4-bit 48-50 ms to its first token, "
        "10-11 ms with the kernel); chosen at load once the kernel agrees with float64. Left-padded groups (the "
        "server's grouped prefill) take its padded form once that form agrees too. `auto`: on CUDA.")
    cuda_q6k_planes: str = _switch(
        "GGUF Q6_K weights (an output head, Q4_K_M's value and down projections, a Q6_K token embedding) "
        "rearranged at load into four planes of the same bytes (`kernels/gguf_blocks.py`'s `to_planes`), which "
        "pymlxc's CUDA matrix-vector kernel reads with aligned loads instead of copying the 2-byte-aligned "
        "blocks through shared memory: the same values bit for bit, chosen once the kernels agree with the "
        "file-layout ones (an embedding once its lookup kernel does too). `auto`: on CUDA.")
    batch_compile: str = _switch(
        "The continuous batch's decode step (the server, `batch_generate`) as one compiled graph per batch "
        "size and buffer size (`backends/metal/decode/batch_step.py`) instead of op by op. `auto`: on CUDA "
        "(an H200 serving Llama-3.2-1B 4-bit: 236 / 683 / 1505 tok/s at 1 / 4 / 16 clients against 131 / "
        "328 / 1127 op by op, its server answering 0.8 s later); not on a CPU, where it measured no faster. "
        "Off whenever `compile` is `0`.")
    eval_thread: str = _switch(
        "Generation loops encode each step on an evaluation thread while Python builds the next "
        "(`pymlxc/core/eval_thread.py`). `auto`: on a GPU, not on a CPU (where the cores are "
        "the compute).")
    lib_dir: Path | None = field(default=None, metadata=_doc("path", (
        "The folder of libmlxc and its cdef (default: `pymlxc/_lib` of the installed package). "
        "Read when `pymlxc.core` is first imported.")))
    cache_dir: str | None = field(default=None, metadata=_doc("path", (
        "Where pymlxc keeps what a process would otherwise redo at every start: the binding's parsed "
        "C declarations and the verdicts of the kernels' checks (`pymlxc/user_cache.py`). Default: "
        "`$XDG_CACHE_HOME/pymlxc`, else `~/.cache/pymlxc`; `off` keeps nothing. Read when "
        "`pymlxc.core` is first imported.")))
    mlx_lm_python: str | None = field(default=None, metadata=_doc("path", (
        "The Python that runs the mlx_lm backend's worker (default: this interpreter), for an "
        "mlx-lm installed in another environment.")))
    api_key: str | None = field(default=None, repr=False, metadata=_doc("text", (
        "The key `pymlxc serve` requires as `Authorization: Bearer KEY` (default: none; its "
        "`--api-key` option takes precedence).")))
    traceback: bool = field(default=False, metadata=_doc("bool", (
        "The `pymlxc` command ends an unexpected error with one line; `1` lets it end with Python's "
        "traceback instead (for a bug report).")))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """The settings the environment (`os.environ` by default) asks for; an unset or empty
        variable keeps its default."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            raw = env.get(variable(f.name), "").strip()
            if raw:
                values[f.name] = _parse(f.name, f.metadata["kind"], raw)
        return cls(**values)

    def __post_init__(self) -> None:
        # Explicit Settings(...) are checked as strictly as the environment.
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            kind = f.metadata["kind"]
            if kind == "bool" and not isinstance(value, bool):
                raise SettingsError(f"Settings.{f.name} must be a bool, not {value!r}")
            if "|" in kind and value not in kind.split("|"):
                raise SettingsError(f"Settings.{f.name} must be one of {', '.join(kind.split('|'))}, not {value!r}")
        if self.lib_dir is not None and not isinstance(self.lib_dir, Path):
            object.__setattr__(self, "lib_dir", Path(self.lib_dir))

    def switch_on(self, name: str, on_cuda: bool) -> bool:
        """Whether an `auto|0|1` CUDA lever `name` may be used: `1`, or `auto` on CUDA."""
        value = getattr(self, name)
        return value == "1" or (value == "auto" and on_cuda)


def variable(name: str) -> str:
    """The environment variable of the field `name`."""
    return PREFIX + name.upper()


def _parse(name: str, kind: str, raw: str) -> Any:
    value = raw.lower()
    if kind in ("path", "text"):
        return Path(raw) if name == "lib_dir" else raw
    if kind == "bool":
        if value in _TRUE:
            return True
        if value in _FALSE:
            return False
        raise SettingsError(f"{variable(name)} must be one of {', '.join(_TRUE + _FALSE)}, not {raw!r}")
    choices = kind.split("|")
    if choices[:3] == list(SWITCH):  # the tri-state levers also take the boolean words
        value = "1" if value in _TRUE else "0" if value in _FALSE else value
    if value not in choices:
        aliases = " (or true/false, yes/no, on/off)" if choices[:3] == list(SWITCH) else ""
        raise SettingsError(f"{variable(name)} must be one of {', '.join(choices)}{aliases}, not {raw!r}")
    return value


_lock = threading.Lock()
_current: Settings | None = None


def current() -> Settings:
    """The process's settings: the environment as read at the first call (or an `override`)."""
    global _current
    with _lock:
        if _current is None:
            _current = Settings.from_env()
        return _current


@contextlib.contextmanager
def override(**changes: Any) -> Iterator[Settings]:
    """The process's settings with `changes` for the block (what `current()` and a new
    `LoadConfig` see); the previous ones come back after it."""
    global _current
    before = current()
    replaced = dataclasses.replace(before, **changes)
    with _lock:
        _current = replaced
    try:
        yield replaced
    finally:
        with _lock:
            _current = before


def markdown() -> str:
    """docs/settings.md: one row per switch, from the fields' metadata."""
    lines = [
        "# Settings",
        "",
        "Every `PYMLXC_*` environment variable, as `pymlxc/settings.py` defines it (this page is "
        "generated from it: `python -c 'import pymlxc.settings as s; print(s.markdown(), end=\"\")' > "
        "docs/settings.md`). The environment is read "
        "once, at the first use; a value a variable does not take is an error that names it. "
        "A model can also be given explicit settings: "
        "`pymlxc.load_model(path, settings=Settings(decode=\"graph\"))` with "
        "`from pymlxc.settings import Settings`.",
        "",
        "| variable | values | default | what it does |",
        "|---|---|---|---|",
    ]
    for f in dataclasses.fields(Settings):
        kind = f.metadata["kind"]
        values = {"bool": "1/0 (true/false, yes/no, on/off)", "path": "a path", "text": "a string"}.get(
            kind, kind.replace("|", ", "))
        default = f.default
        shown = "unset" if default is None else ("1" if default is True else "0" if default is False else default)
        lines.append(f"| `{variable(f.name)}` | {values} | {shown} | {f.metadata['doc']} |")
    return "\n".join(lines) + "\n"


__all__ = ["Settings", "SettingsError", "current", "override", "variable", "markdown", "SWITCH"]

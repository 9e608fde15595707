"""Memory a call will need, checked against the device before anything is allocated.

MLX does not raise when an allocation fails on every path: on the CPU a buffer too large for the
machine ends the process (the kernel's OOM killer, or an error thrown on MLX's worker thread), and
under a memory limit set with `set_memory_limit` evaluation can wait for memory that never comes.
So the loops estimate, before they prefill, the largest buffers a call will hold, and raise
`DeviceMemoryError` (a `MemoryError`) naming the options and sizes when they cannot fit:

* the KV caches at their largest: every layer's cache holds min(its bound, prompt + new tokens)
  positions, its bound being a sliding window or `context_len` (a `RotatingKVCache`'s `max_size`,
  plus the chunk that overflows it);
* a linear-attention layer's `RecurrentCache` (Qwen3-Next, Qwen 3.5): its conv window and delta-rule
  state, of a fixed size whatever the tokens, held once plus the snapshots kept at chunk boundaries
  for the prompt cache (at most `MAX_SNAPSHOTS`, one per prefill chunk);
* where MLX's attention runs as separate operations (its CPU backend), one chunk's attention scores
  [batch, query heads, chunk, keys];
* `extra`: what the caller returns on top (inspect_attention's keys and queries).

The estimate is of the dominant buffers, not every activation: it rejects calls that cannot fit,
it does not promise that one that passes fits on a machine that is nearly full.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pymlxc.core as mx
from pymlxc.core.memory import device_info

from .cache import KVCache, RotatingKVCache
from .recurrent_cache import MAX_SNAPSHOTS, RecurrentCache


class DeviceMemoryError(MemoryError):
    """A call would need more memory than the device has free; nothing was allocated for it."""


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def _cpu_memory() -> list[int]:
    """What bounds this process on the host: physical memory, a cgroup limit, an address-space or
    data-segment rlimit (each where the platform reports it)."""
    out: list[int] = []
    with contextlib.suppress(ValueError, OSError, AttributeError):
        out.append(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path, encoding="ascii") as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:  # "max" or a huge number: no limit
            out.append(int(text))
    try:
        import resource  # noqa: PLC0415 - POSIX only

        for which in (resource.RLIMIT_AS, getattr(resource, "RLIMIT_DATA", None)):
            if which is not None:
                soft = resource.getrlimit(which)[0]
                if soft != resource.RLIM_INFINITY and soft > 0:
                    out.append(soft)
    except (ImportError, ValueError, OSError):
        pass
    return out


def device_memory() -> int:
    """Bytes this process may hold on the default device: the least of MLX's memory limit, the
    device's own size (GPU) and, on the CPU, the host's bounds. 0 when nothing is known."""
    sizes: list[int] = []
    limit = mx.get_memory_limit()
    if limit > 0:
        sizes.append(limit)
    if mx.default_device().type == "gpu":
        info = device_info()
        sizes += [int(v) for k, v in info.items()
                  if k in ("max_recommended_working_set_size", "memory_size", "total_memory") and isinstance(v, int)
                  and v > 0]
    else:
        sizes += _cpu_memory()
    return min(sizes) if sizes else 0


# ---------------------------------------------------------------------- what a model's caches hold

def _out_dtype(linear: Any, compute: Any = None) -> Any:
    """The dtype of a projection's output: a quantized layer's scales, else its weight (through
    a LoRA wrapper's `linear`); for a layer of raw GGUF blocks (uint8), the model's compute dtype."""
    while hasattr(linear, "linear"):
        linear = linear.linear
    dtype = getattr(linear, "scales", linear.weight).dtype
    if dtype == mx.uint8:
        return compute if compute is not None else mx.float32
    return dtype


@dataclass(frozen=True)
class LayerShape:
    """One cached layer: key/value bytes per position per row, heads, dtype size; for a linear
    attention layer (no keys or values, no heads) `state_bytes`, its conv window and recurrent state
    per row, whatever the number of positions."""

    kv_bytes: int
    query_heads: int
    kv_heads: int
    head_dim: int
    itemsize: int
    state_bytes: int = 0


def _linear_shape(attn: Any, compute: Any = None) -> LayerShape:
    """A Gated DeltaNet layer's cache per row: (K - 1) inputs of the convolution in the projection's
    dtype, and the float32 state [Hv, Dv, Dk]."""
    qkv = attn.in_proj_qkv if "in_proj_qkv" in vars(attn) else attn.in_proj_qkvz
    conv = (attn.conv_kernel_size - 1) * attn.conv_dim * _out_dtype(qkv, compute).size
    return LayerShape(0, 0, 0, 0, 4, conv + attn.num_v_heads * attn.head_v_dim * attn.head_k_dim * 4)


def layer_shapes(model: Any, cache: Sequence[Any]) -> list[LayerShape] | None:
    """The shape of each layer with a cache, from the model's attention modules (None where the
    model does not expose them: then nothing is checked)."""
    layers = getattr(model, "layers", None)
    if not isinstance(layers, (list, tuple)) or len(layers) < len(cache):
        return None
    compute = getattr(model, "compute_dtype", None)
    out = []
    for layer, _ in zip(layers, cache, strict=False):
        attn = getattr(layer, "self_attn", None)
        try:
            if attn is None and getattr(layer, "linear_attn", None) is not None:
                out.append(_linear_shape(layer.linear_attn, compute))
                continue
            if attn is None:  # neither attention nor linear attention: not a layer this estimate knows
                return None
            itemsize = _out_dtype(attn.k_proj, compute).size
            out.append(LayerShape(2 * attn.n_kv_heads * attn.head_dim * itemsize, attn.n_heads, attn.n_kv_heads,
                                  attn.head_dim, itemsize))
        except AttributeError:
            return None
    return out


def _bound(c: Any) -> int | None:
    """The most positions `c` ever holds (None: unbounded)."""
    return c.max_size if isinstance(c, RotatingKVCache) else None


def context_bound(cache: Sequence[Any]) -> int | None:
    """The `context_len` the caches were made with (the bound of a cache that keeps sinks), if any."""
    bounds = [c.max_size for c in cache if isinstance(c, RotatingKVCache) and c.keep]
    return max(bounds) if bounds else None


@dataclass(frozen=True)
class Estimate:
    kv: int  # bytes the caches will hold at their final size, beyond what they hold now
    scores: int  # one chunk's attention scores (0 where attention is fused)
    extra: int
    tokens: int  # positions per row at the end

    @property
    def total(self) -> int:
        return self.kv + self.scores + self.extra


def estimate(model: Any, cache: Sequence[Any], *, batch: int, prompt_len: int, new_tokens: int = 0,
             step: int = 2048, extra: int = 0) -> Estimate | None:
    """The bytes a prefill of `prompt_len` tokens per row (`batch` rows) into `cache`, followed by
    `new_tokens` generated ones, will allocate. None where the model's shapes are unknown."""
    shapes = layer_shapes(model, cache)
    if shapes is None:
        return None
    tokens = prompt_len + max(new_tokens, 0)
    kv = scores = 0
    unfused = mx.default_device().type == "cpu"  # MLX's CPU attention materializes its scores
    chunk = min(step, prompt_len)
    chunks = -(-prompt_len // step) if step > 0 else 1
    for c, shape in zip(cache, shapes, strict=False):
        if shape.state_bytes:  # the state now, and a snapshot per multi-token chunk (the latest few)
            copies = 1 + min(MAX_SNAPSHOTS, chunks)
            now = c.nbytes if isinstance(c, RecurrentCache) else 0
            kv += max(batch * copies * shape.state_bytes - now, 0)
            continue
        bound = _bound(c)
        # A bounded cache fed a chunk that overflows it holds its last bound - 1 positions and the
        # chunk until the next one-token step cuts it back.
        held = tokens if bound is None else min(tokens, max(bound, bound - 1 + chunk))
        now = getattr(c, "nbytes", 0) if isinstance(c, (KVCache, RotatingKVCache)) else 0
        kv += max(batch * held * shape.kv_bytes - now, 0)
        if unfused:
            keys = prompt_len if bound is None else min(prompt_len, bound + chunk - 1)
            scores = max(scores, batch * shape.query_heads * chunk * keys * shape.itemsize)
    return Estimate(kv, scores, extra, tokens)


def check(model: Any, cache: Sequence[Any], *, batch: int, prompt_len: int, new_tokens: int = 0,
          step: int = 2048, extra: int = 0, what: str = "this call") -> None:
    """Raise DeviceMemoryError when `estimate(...)` exceeds the device's free memory."""
    est = estimate(model, cache, batch=batch, prompt_len=prompt_len, new_tokens=new_tokens, step=step, extra=extra)
    limit = device_memory()
    if est is None or limit <= 0:
        return
    free = max(limit - mx.get_active_memory(), 0)
    if est.total <= free:
        return
    context = context_bound(cache)
    parts = [f"KV cache of {est.tokens} positions x {len(cache)} layers x {batch} row(s): {_gib(est.kv)}"]
    if est.scores:
        parts.append(f"attention scores of one {min(step, prompt_len)}-token chunk: {_gib(est.scores)}")
    if est.extra:
        parts.append(f"the returned arrays: {_gib(est.extra)}")
    raise DeviceMemoryError(
        f"{what} needs about {_gib(est.total)} ({'; '.join(parts)}) but {_gib(free)} of the device's "
        f"{_gib(limit)} are free (prompt {prompt_len} tokens, max_tokens={new_tokens}, "
        f"context_len={context if context is not None else 'unbounded'}); lower max_tokens or context_len, "
        "or shorten the prompt")


__all__ = ["DeviceMemoryError", "check", "estimate", "device_memory", "context_bound", "layer_shapes"]

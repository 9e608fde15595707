"""Numerics shared by the architectures: config parsing, RoPE (with its scalings), attention with
grouped-query heads through the fused kernel, logit soft-capping, per-layer masks, output heads."""
from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np

import pymlxc.core as mx
from pymlxc.core import Array

from .. import nn
from ..cache import (
    CONTEXT_KEEP,
    Cache,
    KVCache,
    LeftPaddedMask,
    Mask,
    RotatingKVCache,
    create_causal_mask,
    make_prompt_mask,
)
from ..config_check import ConfigError, check_args, check_params
from ..kernel_choice import (
    kernels_allowed,
    padded_prefill_attention_passed,
    prefill_attention,
    prefill_attention_takes,
)
from ..thread_setting import ThreadSetting

_sdpa = mx.fast.scaled_dot_product_attention
_rope = mx.fast.rope
_matmul = mx.matmul
_tanh = mx.tanh

A = TypeVar("A", bound="BaseModelArgs")
V = TypeVar("V")


def resolved(value: V | None, field: str) -> V:
    """A ModelArgs field that may be absent from config.json and that `__post_init__` then fills in
    (num_key_value_heads, head_dim, ...): set in every constructed ModelArgs."""
    if value is None:
        raise ConfigError(f"{field} is unset: its ModelArgs was made without __post_init__")
    return value


# ---------------------------------------------------------------------- per-layer listener

_layer_listener: ThreadSetting[Any] = ThreadSetting(None)


def after_layer(h: Array, cache: Any) -> None:
    """Every architecture calls this after each block of its forward pass: a listener (see
    `layer_listener`) may schedule the block's work at once, so the device (or the evaluation
    thread) starts on it while Python builds the next block."""
    fn = _layer_listener.get()
    if fn is not None:
        fn(h, cache)


@contextlib.contextmanager
def layer_listener(fn: Any) -> Iterator[None]:
    """Call `fn(h, cache)` after each block of the forward passes run on this thread in the block."""
    with _layer_listener.set(fn):
        yield


@dataclasses.dataclass
class BaseModelArgs:
    @classmethod
    def from_dict(cls: type[A], params: Mapping[str, Any], prefix: str = "") -> A:
        """Build from a HF config dict: unknown keys are ignored, the others checked against their
        annotations and ranges before use, then the resolved arguments as a whole (`config_check`).
        `prefix` names where the fields sit in the file (`text_config.`) in errors."""
        kwargs = check_params(cls, params, prefix)
        try:
            args = cls(**kwargs)
        except ConfigError:
            raise
        except (TypeError, ValueError, KeyError, AttributeError, ZeroDivisionError) as exc:
            raise ConfigError(f"{prefix}config: unusable values: {type(exc).__name__}: {exc}") from exc
        check_args(args, prefix)
        return args


# ---------------------------------------------------------------------- RoPE

class RoPE(nn.Module):
    """Rotary embedding of the first `dims` features. With `freqs` (Llama 3 scaling) the kernel takes
    the per-pair frequencies instead of a base. No parameters: the frequencies are a constant."""

    def __init__(self, dims: int, *, base: float, traditional: bool = False, scale: float = 1.0,
                 freqs: Array | None = None) -> None:
        super().__init__()
        self.dims = dims
        self.traditional = traditional
        self.base = None if freqs is not None else float(base)
        self.scale = float(scale)
        self._freqs = freqs

    def __call__(self, x: Array, offset: int | Array = 0) -> Array:
        return _rope(x, self.dims, traditional=self.traditional, base=self.base, scale=self.scale,
                     offset=offset, freqs=self._freqs)


def llama3_freqs(dims: int, base: float, scaling: Mapping[str, Any]) -> Array:
    """Llama 3.x frequency scaling: long wavelengths slowed by `factor`, short ones kept, a smooth
    blend in between (computed with the same float32 ops as mlx-lm, so results agree)."""
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    freqs = base ** (mx.arange(0, dims, 2) / dims)
    wavelens = (2 * math.pi) * freqs
    freqs = mx.where(wavelens > low_wavelen, freqs * factor, freqs)
    is_medium = (wavelens > high_wavelen) & (wavelens < low_wavelen)
    smooth = (old_ctx / wavelens - low) / (high - low)
    smooth_freqs = freqs / ((1 - smooth) / factor + smooth)
    out = mx.where(is_medium, smooth_freqs, freqs)
    mx.eval(out)
    return out


def rope_scaling_type(scaling: Mapping[str, Any] | None) -> str:
    if not scaling:
        return "default"
    return str(scaling.get("type") or scaling.get("rope_type") or "default")


def initialize_rope(dims: int, base: float, traditional: bool = False,
                    scaling: Mapping[str, Any] | None = None) -> RoPE:
    """RoPE for a HF `rope_scaling` entry: none/default, `linear` (positions divided by `factor`) or
    `llama3` (per-frequency scaling)."""
    kind = rope_scaling_type(scaling)
    if kind == "default":
        return RoPE(dims, base=base, traditional=traditional)
    if kind == "linear":
        return RoPE(dims, base=base, traditional=traditional, scale=1.0 / float(scaling["factor"]))  # type: ignore[index]
    if kind == "llama3":
        return RoPE(dims, base=base, traditional=traditional, freqs=llama3_freqs(dims, base, scaling))  # type: ignore[arg-type]
    raise ConfigError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3)")


# ---------------------------------------------------------------------- attention

# Thread ident -> the list that `attention` appends its queries to (see `recording_queries`).
_QUERY_SINKS: dict[int, list[Array]] = {}


@contextlib.contextmanager
def recording_queries() -> Iterator[list[Array]]:
    """Within the block, each attention call on this thread appends its queries [B, heads, L,
    head_dim] (after RoPE and norms, before the scale) to the list yielded, layer after layer. For
    `inspect_attention`; outside such a block the cost is one check of an empty dict per call."""
    sink: list[Array] = []
    ident = threading.get_ident()
    _QUERY_SINKS[ident] = sink
    try:
        yield sink
    finally:
        del _QUERY_SINKS[ident]


def _record_queries(q: Array) -> None:
    sink = _QUERY_SINKS.get(threading.get_ident())
    if sink is not None:
        sink.append(q)


def last_query(q: Array, mask: Mask) -> tuple[Array, Mask]:
    """A chunk's last query [B, heads, 1, D] and its mask: every key a causal chunk mask gives it
    (None), or its own row of an explicit mask."""
    return q[:, :, -1:], None if mask is None or isinstance(mask, str) else mask[..., -1:, :]


def rope_and_cache(rope: Any, q: Array, k: Array, v: Array, cache: Cache | None) -> tuple[Array, Array, Array]:
    """q, k, v [B, heads, L, D] ready for attention: RoPE on q and k from the cache's offset (0
    without a cache), then k and v through the cache (every position's keys and values so far)."""
    if cache is None:
        return rope(q), rope(k), v
    offset = cache.offset
    q, k = rope(q, offset), rope(k, offset)
    k, v = cache.update_and_fetch(k, v)
    return q, k, v


def attention(q: Array, k: Array, v: Array, *, scale: float, mask: Mask, kernel: bool = False) -> Array:
    """softmax(q k^T * scale + mask) v over [B, heads, L, head_dim]; kv heads may be fewer (GQA).
    With `kernel` (an attention module marked at load, `nn.mark_prefill_attention`) a causal chunk
    the CUDA kernel takes runs there (`kernel_choice.prefill_attention`), and so does a group of
    left-padded rows (a mask of `generate.left_padded_mask`, its padded form): MLX builds a cuDNN
    graph for each new shape, 40 ms and more on a GPU."""
    if _QUERY_SINKS:
        _record_queries(q)
    if kernel and kernels_allowed():
        if isinstance(mask, str):
            if prefill_attention_takes(q, k, v):
                return prefill_attention(q, k, v, scale)
        elif (isinstance(mask, LeftPaddedMask) and prefill_attention_takes(q, k, v, mask.starts)
              and padded_prefill_attention_passed(q.dtype, q.shape[3], q.shape[1], k.shape[1], scale)):
            return prefill_attention(q, k, v, scale, mask.starts)  # a left-padded group (the server's)
    return _sdpa(q, k, v, scale=scale, mask=mask)


_MIN = {mx.float32: -3.4028234663852886e38, mx.float16: -65504.0, mx.bfloat16: -3.3895313892515355e38}


def softcapped_attention(q: Array, k: Array, v: Array, *, scale: float, cap: float, mask: Mask,
                         n_kv_heads: int) -> Array:
    """Attention with tanh soft-capping of the scores (Gemma 2): the fused kernel cannot cap, so the
    scores are formed explicitly, in the dtype of q, with a float32-precise softmax."""
    if _QUERY_SINKS:
        _record_queries(q)
    b, n_heads, L, d = q.shape
    repeats = n_heads // n_kv_heads
    q = q * scale
    if repeats > 1:
        q = mx.reshape(q, (b, n_kv_heads, repeats, L, d))
        k = mx.expand_dims(k, 2)
        v = mx.expand_dims(v, 2)
    scores = _matmul(q, mx.swapaxes(k, -1, -2))
    scores = _tanh(scores / cap) * cap
    if isinstance(mask, str):
        kl = k.shape[-2]
        mask = create_causal_mask(L, kl - L)
    if mask is not None:
        if repeats > 1 and mask.ndim == 4:
            mask = mx.expand_dims(mask, 2)  # [B, 1, L, S] -> [B, 1, 1, L, S] for the grouped heads
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.array(_MIN[scores.dtype], scores.dtype))
        else:
            scores = scores + mask
    scores = mx.softmax(scores, axis=-1, precise=True)
    out = _matmul(scores, v)
    if repeats > 1:
        out = mx.reshape(out, (b, n_heads, L, d))
    return out


def softcap(x: Array, cap: float) -> Array:
    return _tanh(x / cap) * cap


# ---------------------------------------------------------------------- masks per layer

def _explicit_for(mask: Array, n: int, cache: Cache | None, window: int | None) -> Array:
    """Fit a caller's mask [.., n, offset + n] (over all positions so far) to the keys that `cache`
    will return, and add the sliding window (or the rotating cache's bound; its `keep` first tokens
    stay visible). Columns are picked by position once a rotating cache has evicted or reordered."""
    offset = 0 if cache is None else cache.offset
    keep = 0
    positions: np.ndarray | None = None
    if isinstance(cache, RotatingKVCache):
        window = min(window, cache.max_size) if window else cache.max_size
        keep = cache.keep
        if not cache.in_order():
            positions = cache.key_positions(n)
            mask = mx.take(mask, mx.array(positions.astype(np.int32)), axis=-1)
    if window is None or (positions is None and offset + n <= window):
        return mask
    kpos = positions if positions is not None else np.arange(offset + n)
    qpos = np.arange(offset, offset + n)[:, None]
    visible = mx.array(((qpos - kpos[None, :]) < window) | (kpos[None, :] < keep))
    if mask.dtype == mx.bool_:
        return mask & visible
    return mx.where(visible, mask, mx.array(-math.inf, mask.dtype))


class LayerMasks:
    """The masks of a forward pass: one per distinct sliding window (None = full attention), built
    from the first cache of a layer with that window."""

    def __init__(self, windows: Sequence[int | None]) -> None:
        self.windows = list(windows)
        self.first: dict[int | None, int] = {}
        for i, w in enumerate(self.windows):
            self.first.setdefault(w, i)
        self.single = len(self.first) == 1

    def __call__(self, n: int, cache: Sequence[Cache] | None, mask: Array | None) -> list[Mask]:
        by_window: dict[int | None, Mask] = {}
        for w, i in self.first.items():
            c = cache[i] if cache is not None else None
            if mask is None:
                by_window[w] = make_prompt_mask(n, c, w)
            else:
                by_window[w] = _explicit_for(mask, n, c, w)
        if self.single:
            return [by_window[self.windows[0]]] * len(self.windows)
        return [by_window[w] for w in self.windows]


def make_layer_caches(windows: Sequence[int | None], context_len: int | None,
                      keep: int = CONTEXT_KEEP) -> list[Cache]:
    """Caches for layers with the given sliding windows (None: full attention). A window layer gets a
    rotating cache of its window; a layer bounded by `context_len` instead (full attention, or a
    window longer than the context) gets one of `context_len` that keeps the first `keep` tokens."""
    out: list[Cache] = []
    for w in windows:
        if w is not None and (context_len is None or w <= context_len):
            out.append(RotatingKVCache(w))
        elif context_len is None:
            out.append(KVCache())
        else:
            out.append(RotatingKVCache(context_len, keep=min(keep, context_len - 1)))
    return out


# ---------------------------------------------------------------------- heads and weights

class TiedHead:
    """Mixin for models whose output head may be the embedding matrix (`lm_head` absent)."""

    lm_head: nn.Linear | nn.QuantizedLinear | None

    def tie_embeddings(self) -> None:
        """Use the input embedding as the output head (drops `lm_head`)."""
        self.lm_head = None


def drop_keys(weights: dict[str, Array], *substrings: str) -> dict[str, Array]:
    return {k: v for k, v in weights.items() if not any(s in k for s in substrings)}


def head_dim_of(config: Any) -> int:
    dims: int = config.head_dim if config.head_dim else config.hidden_size // config.num_attention_heads
    return dims

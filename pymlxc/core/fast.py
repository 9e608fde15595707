"""`mlx.core.fast`: fused kernels (norms, RoPE, attention)."""
from __future__ import annotations

from typing import Any

from . import _generated as _g
from .array import Array
from .cuda_kernel import CudaKernel, SharedKernel, cuda_kernel  # noqa: F401 - mx.fast.cuda_kernel


def rms_norm(x: Any, weight: Any, eps: float, *, stream: Any = None) -> Array:
    return _g.fast_rms_norm(x, eps, weight=weight, stream=stream)


def layer_norm(x: Any, weight: Any, bias: Any, eps: float, *, stream: Any = None) -> Array:
    return _g.fast_layer_norm(x, eps, weight=weight, bias=bias, stream=stream)


def rope(a: Any, dims: int, *, traditional: bool, base: float | None, scale: float, offset: int | Any,
         freqs: Any = None, stream: Any = None) -> Array:
    """Rotary embedding of the first `dims` features; `offset` is an int or a scalar/vector Array."""
    if isinstance(offset, Array):
        return _g.fast_rope_dynamic(a, dims, traditional, scale, offset, base=base, freqs=freqs, stream=stream)
    return _g.fast_rope(a, dims, traditional, scale, int(offset), base=base, freqs=freqs, stream=stream)


def scaled_dot_product_attention(q: Any, k: Any, v: Any, *, scale: float, mask: Any = None, sinks: Any = None,
                                 stream: Any = None) -> Array:
    """Attention with an optional mask: None, "causal", or an additive/boolean Array."""
    if mask is None:
        return _g.fast_scaled_dot_product_attention(q, k, v, scale, "", sinks=sinks, stream=stream)
    if isinstance(mask, str):
        return _g.fast_scaled_dot_product_attention(q, k, v, scale, mask, sinks=sinks, stream=stream)
    return _g.fast_scaled_dot_product_attention(q, k, v, scale, "array", mask_arr=mask, sinks=sinks, stream=stream)


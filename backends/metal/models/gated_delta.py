"""Gated DeltaNet's recurrence (the linear attention of Qwen3-Next and Qwen 3.5) as MLX operations.

Per value head, the state S [Dv, Dk] maps keys to values. Each token decays it by g, writes the
delta between its value and what S recalls for its key, and reads it with its query:

    S <- g S;   S <- S + beta (v - S k) k^T;   y = S q

`step` is that update for one token, written as mlx-lm's `_gated_delta_step_ops` (the same
operations in the same order, compiled the same way), so decoding on the CPU gives its bits.

`chunked` runs a whole prompt chunk per layer in the parallel form (the WY representation of
the Gated DeltaNet paper): within a chunk of C tokens the writes e_i = beta_i (v_i - g_i S_{i-1}
k_i) solve one unit lower-triangular system,

    (I + diag(beta) A) E = diag(beta) (V - diag(G) K S0^T),   A_ij = (G_i / G_j) k_i.k_j  (j < i)

with G the running product of the decays, after which every output and the chunk's final state
are matrix products: Y = diag(G) Q S0^T + (Q K^T . Gamma)_causal E and S_C = G_C S0 + E^T diag(G_C /
G) K. Only the state passes from chunk to chunk. The triangular inverse is built by recursive
doubling of diagonal blocks (stable, unlike a Neumann series, whose terms grow binomially when
keys are alike). Decays are handled as running sums of log g, so no ratio of underflowed products
is formed.

Padding (left-padded batches): a token whose `mask` entry is False leaves the state unchanged
(g = 1, beta = 0); its own output is meaningless and unused.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pymlxc.core as mx
from pymlxc.core import Array

CHUNK = 64  # tokens per chunk of the parallel form (the triangular solve is C x C)


# ---------------------------------------------------------------------- gates and normalisation

def _softplus(x: Array) -> Array:
    return mx.logaddexp(x, mx.array(0.0, x.dtype))


def _log_decay(A_log: Array, a: Array, dt_bias: Array) -> Array:
    return -mx.exp(A_log.astype(mx.float32)) * _softplus(a + dt_bias)


@functools.cache
def _compiled_decay() -> Callable[..., Any]:
    # Compiled, shapeless, as mlx-lm's compute_g: the fused CPU kernel then rounds as its does.
    return mx.compile(lambda A_log, a, dt_bias: mx.exp(_log_decay(A_log, a, dt_bias)), shapeless=True)


def decay(A_log: Array, a: Array, dt_bias: Array) -> Array:
    """g = exp(-exp(A_log) * softplus(a + dt_bias)) in float32, [B, T, Hv]."""
    g: Array = _compiled_decay()(A_log, a, dt_bias)
    return g


def log_decay(A_log: Array, a: Array, dt_bias: Array) -> Array:
    """log g (float32), for the chunked form."""
    return _log_decay(A_log, a, dt_bias)


def normalize_qk(q: Array, k: Array, head_k_dim: int, eps: float = 1e-6) -> tuple[Array, Array]:
    """L2-normalise q and k over the head (the reference adds `eps` to the sum of squares) and fold
    the Dk^-1/2 readout scale into q. rms_norm adds its eps to the mean of squares: eps / Dk."""
    inv = head_k_dim**-0.5
    rms_eps = eps * inv * inv
    return (inv * inv) * mx.fast.rms_norm(q, None, rms_eps), inv * mx.fast.rms_norm(k, None, rms_eps)


def repeat_heads(x: Array, value_heads: int) -> Array:
    """[B, T, Hk, D] -> [B, T, Hv, D]: each key head serves Hv / Hk value heads (consecutive)."""
    r = value_heads // x.shape[-2]
    return mx.repeat(x, r, -2) if r > 1 else x


# ---------------------------------------------------------------------- one token

def _step_ops(q: Array, k: Array, v: Array, g: Array, beta: Array, state: Array) -> tuple[Array, Array]:
    state = state * g[..., None, None]
    kv_mem = mx.sum(state * k[..., None, :], axis=-1)
    delta = (v - kv_mem) * beta[..., None]
    state = state + k[..., None, :] * delta[..., None]
    y = mx.sum(state * q[..., None, :], axis=-1)
    return y.astype(q.dtype), state


def _masked_step_ops(q: Array, k: Array, v: Array, g: Array, beta: Array, state: Array,
                     mask: Array) -> tuple[Array, Array]:
    y, new = _step_ops(q, k, v, g, beta, state)
    return y, mx.where(mx.expand_dims(mask, (1, 2, 3)), new, state)


@functools.cache
def _compiled_step(masked: bool) -> Callable[..., Any]:
    return mx.compile(_masked_step_ops if masked else _step_ops)


def step(q: Array, k: Array, v: Array, g: Array, beta: Array, state: Array,
         mask: Array | None = None) -> tuple[Array, Array]:
    """One token: q, k [B, Hv, Dk] (heads repeated), v [B, Hv, Dv], g, beta [B, Hv], state [B, Hv,
    Dv, Dk] float32 -> y [B, Hv, Dv] (q's dtype), the new state. `mask` [B]: False keeps the state."""
    out: tuple[Array, Array]
    if mask is None:
        out = _compiled_step(False)(q, k, v, g, beta, state)
    else:
        out = _compiled_step(True)(q, k, v, g, beta, state, mask)
    return out


def recurrent(q: Array, k: Array, v: Array, g: Array, beta: Array, state: Array,
              mask: Array | None = None) -> tuple[Array, Array]:
    """Token by token (the reference the chunked form and the kernels are checked against):
    q, k [B, T, Hk, Dk], v [B, T, Hv, Dv], g, beta [B, T, Hv], state [B, Hv, Dv, Dk]."""
    hv = v.shape[-2]
    q, k = repeat_heads(q, hv), repeat_heads(k, hv)
    ys = []
    for t in range(q.shape[1]):
        y, state = step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state,
                        None if mask is None else mask[:, t])
        ys.append(y)
    return mx.stack(ys, axis=1), state


# ---------------------------------------------------------------------- a chunk at a time

def _unit_lower_inverse(m: Array) -> Array:
    """(I + m)^-1 for m [..., C, C] strictly lower triangular, C a power of two: diagonal blocks
    inverted by doubling, [[A, 0], [B, D]]^-1 = [[A^-1, 0], [-D^-1 B A^-1, D^-1]]."""
    c = m.shape[-1]
    lead = m.shape[:-2]
    inv = mx.ones((*lead, c, 1, 1), m.dtype)  # the 1 x 1 diagonal blocks of I + m
    size = 1
    while size < c:
        groups = c // (2 * size)
        # The 2s x 2s diagonal blocks of m: [..., groups, 2s, 2s].
        blocks = mx.reshape(m, (*lead, groups, 2 * size, groups, 2 * size))
        blocks = mx.moveaxis(mx.diagonal(blocks, 0, -4, -2), -1, -3)
        lower = blocks[..., size:, :size]
        pairs = mx.reshape(inv, (*lead, groups, 2, size, size))
        a_inv, d_inv = pairs[..., 0, :, :], pairs[..., 1, :, :]
        corner = -mx.matmul(mx.matmul(d_inv, lower), a_inv)
        zeros = mx.zeros(a_inv.shape, m.dtype)
        top = mx.concatenate([a_inv, zeros], axis=-1)
        bottom = mx.concatenate([corner, d_inv], axis=-1)
        inv = mx.concatenate([top, bottom], axis=-2)
        size *= 2
    return mx.reshape(inv, (*lead, c, c))


def _chunk_size(t: int) -> int:
    size = 1
    while size < min(t, CHUNK):
        size *= 2
    return size


def chunked(q: Array, k: Array, v: Array, log_g: Array, beta: Array, state: Array,
            mask: Array | None = None) -> tuple[Array, Array]:
    """The whole sequence in the parallel form (see the module doc): q, k [B, T, Hk, Dk] (q
    pre-scaled), v [B, T, Hv, Dv], log_g, beta [B, T, Hv], state [B, Hv, Dv, Dk] float32, mask [B, T]
    (True: a real token) -> y [B, T, Hv, Dv] in q's dtype and the final state (float32)."""
    out_dtype = q.dtype
    b, t, _, dk = q.shape
    hv, dv = v.shape[-2:]
    f32 = mx.float32
    q, k = repeat_heads(q, hv).astype(f32), repeat_heads(k, hv).astype(f32)
    v, log_g, beta = v.astype(f32), log_g.astype(f32), beta.astype(f32)
    if mask is not None:
        log_g = mx.where(mask[..., None], log_g, mx.array(0.0, f32))
        beta = mx.where(mask[..., None], beta, mx.array(0.0, f32))
    c = _chunk_size(t)
    n = -(-t // c)
    pad = n * c - t
    if pad:  # zero keys, values and writes, no decay: the padding leaves the state alone
        q, k, v = (mx.pad(x, [(0, 0), (0, pad), (0, 0), (0, 0)]) for x in (q, k, v))
        log_g, beta = (mx.pad(x, [(0, 0), (0, pad), (0, 0)]) for x in (log_g, beta))

    def heads_first(x: Array, d: int) -> Array:  # [B, T, H, d] -> [B, H, N, C, d]
        return mx.reshape(mx.transpose(x, (0, 2, 1, 3)), (b, hv, n, c, d))

    q, k, v = heads_first(q, dk), heads_first(k, dk), heads_first(v, dv)
    log_g = mx.reshape(mx.transpose(log_g, (0, 2, 1)), (b, hv, n, c))
    beta = mx.reshape(mx.transpose(beta, (0, 2, 1)), (b, hv, n, c))

    cum = mx.cumsum(log_g, axis=-1)  # log G_i
    causal = mx.tril(mx.ones((c, c), mx.bool_))
    diff = mx.where(causal, cum[..., :, None] - cum[..., None, :], mx.array(-float("inf"), f32))
    gamma = mx.exp(diff)  # G_i / G_j for j <= i, else 0
    strict = mx.tril(mx.ones((c, c), f32), -1)
    kkt = mx.matmul(k, mx.swapaxes(k, -1, -2))
    inv = _unit_lower_inverse(beta[..., :, None] * (kkt * gamma * strict))
    t_mat = inv * beta[..., None, :]  # (I + diag(beta) A)^-1 diag(beta)
    growth = mx.exp(cum)[..., None]  # G_i
    w = mx.matmul(t_mat, k * growth)  # rows: T (G k)
    u = mx.matmul(t_mat, v)
    scores = mx.matmul(q, mx.swapaxes(k, -1, -2)) * gamma  # causal (gamma is 0 above the diagonal)
    q_grown = q * growth
    last = cum[..., -1:]
    k_to_end = k * mx.exp(last - cum)[..., None]  # (G_C / G_i) k_i
    chunk_decay = mx.exp(last)[..., None]  # G_C, [B, H, N, 1, 1]

    ys = []
    for i in range(n):
        s_t = mx.swapaxes(state, -1, -2)  # [B, H, Dk, Dv]
        e = u[:, :, i] - mx.matmul(w[:, :, i], s_t)
        ys.append(mx.matmul(q_grown[:, :, i], s_t) + mx.matmul(scores[:, :, i], e))
        state = chunk_decay[:, :, i] * state + mx.matmul(mx.swapaxes(e, -1, -2), k_to_end[:, :, i])
    y = mx.stack(ys, axis=2) if n > 1 else ys[0][:, :, None]
    y = mx.transpose(mx.reshape(y, (b, hv, n * c, dv)), (0, 2, 1, 3))
    if pad:
        y = y[:, :t]
    return y.astype(out_dtype), state


__all__ = ["CHUNK", "chunked", "decay", "log_decay", "normalize_qk", "recurrent", "repeat_heads", "step"]

"""Each layer's RoPE and key/value writes as one CUDA kernel (backends/metal/kernels/rope_kv.py) in the
segmented decode.

Everywhere: the setting is read by name; off CUDA the segments keep MLX's kernels, and a forced
setting there warns and keeps them too; which RoPEs the kernel takes; the check rejects a kernel
whose queries, keys or values differ from MLX's in any bit; with the kernel stood in for by MLX's
kernels, the segments that call it (on private buffers) give the uncompiled loop's tokens.

On CUDA: the kernel equals MLX's RoPE and slice updates bit for bit over head layouts, types,
RoPEs and positions, and models decoded with it keep the uncompiled loop's greedy tokens.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pymlxc.core as mx
from pymlxc.backends.metal.decode import segments
from pymlxc.backends.metal.decode.decoder import CompiledDecoder
from pymlxc.backends.metal.kernels import rope_kv as cuda_rope_kv
from pymlxc.backends.metal.models.base import RoPE, llama3_freqs
from pymlxc.testing import LLAMA3_ROPE_SCALING

from .cuda_decode_helpers import (
    ON_CUDA,
    check_a_forced_setting_keeps_mlx_kernels,
    check_the_setting_is_read_by_name,
    cuda_only,
    forget_verdicts,
    greedy_ids,
    plan_flags,
    stood_in_decoder,
)

fresh_checks = forget_verdicts(cuda_rope_kv.checks)  # each test sees its own verdicts


def test_the_ropes_the_kernel_takes() -> None:
    plain = segments.rope_of(RoPE(64, base=10000.0), 64)
    assert plain is not None and not plain.with_freqs and plain.table.shape == (32,)  # a placeholder, not read
    assert abs(plain.log2_base - np.log2(10000.0)) < 1e-5 and plain.scale_value == 1.0
    assert segments.rope_of(RoPE(64, base=500000.0), 64).key != plain.key
    assert segments.rope_of(RoPE(64, base=10000.0, scale=0.5), 64).key != plain.key
    freqs = llama3_freqs(64, 500000.0, LLAMA3_ROPE_SCALING)
    scaled = segments.rope_of(RoPE(64, base=500000.0, freqs=freqs), 64)
    assert scaled is not None and scaled.with_freqs and scaled.table.shape == (32,) and scaled.table.dtype == mx.float32
    x, pos = mx.array(np.random.default_rng(1).standard_normal((1, 6, 1, 64)).astype(np.float32)), mx.array(77)
    for module, spec in ((RoPE(64, base=10000.0), plain), (RoPE(64, base=500000.0, freqs=freqs), scaled)):
        assert bool(mx.array_equal(spec.mlx(x, pos), module(x, pos)).item())  # the stand-ins' RoPE is the module's
    assert segments.rope_of(RoPE(64, base=10000.0, traditional=True), 64) is None
    assert segments.rope_of(RoPE(32, base=10000.0), 64) is None  # a partial rotation
    assert segments.rope_of(object(), 64) is None


def test_the_private_buffers_are_row_major() -> None:
    """A ring gathered with `take` (heads inside slots) comes out row-major, values unchanged."""
    from pymlxc.core._loader import ffi, lib

    k = mx.array(np.random.default_rng(2).standard_normal((1, 2, 5, 16)).astype(np.float32))
    gathered = mx.take(k, mx.array([0, 1, 2, 3, 4, 0, 0]), axis=2)
    copy = cuda_rope_kv.private_copy(gathered)
    mx.eval(gathered, copy)
    flag = ffi.new("bool *")
    assert lib._mlx_array_is_row_contiguous(flag, gathered.handle) == 0 and not flag[0]  # the layout at issue
    assert lib._mlx_array_is_row_contiguous(flag, copy.handle) == 0 and flag[0]
    assert bool(mx.array_equal(copy, gathered).item())


def test_the_decoder_reads_the_setting_by_name(tiny, monkeypatch: pytest.MonkeyPatch, switches: Any) -> None:
    check_the_setting_is_read_by_name(tiny(), switches, "PYMLXC_CUDA_ROPE_KV", "cuda_rope_kv", "rope_kv")


def _fusions(model: Any) -> Any:
    return segments.fusions_for(segments.plan(model), {})


@pytest.mark.skipif(ON_CUDA, reason="off CUDA only: there the kernel cannot run")
def test_off_cuda_the_segments_keep_mlx_kernels(tiny, monkeypatch: pytest.MonkeyPatch, switches: Any) -> None:
    model = tiny()
    blocks = segments.plan(model)
    assert segments.use_rope_kv(model, blocks, _fusions(model), "auto") is None
    assert segments.use_rope_kv(model, blocks, _fusions(model), "0") is None
    with pytest.warns(RuntimeWarning, match="cannot run here"):
        assert segments.use_rope_kv(model, blocks, _fusions(model), "1") is None
    check_a_forced_setting_keeps_mlx_kernels(model, switches, "PYMLXC_CUDA_ROPE_KV", "rope_kv")


def test_unfused_projections_keep_mlx_kernels(tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel takes the joint q and k heads: without fused projections it is not used."""
    model = tiny()
    monkeypatch.setattr(cuda_rope_kv, "check", lambda *a: True)
    assert segments.use_rope_kv(model, segments.plan(model), None, "1") is None
    assert segments.use_rope_kv(model, segments.plan(model), _fusions(model), "1") is not None


def _stand_in(calls: list[tuple[int, ...]]) -> Any:
    """MLX's kernels in the kernel's place (new arrays instead of writes in place), counting calls."""

    def stand_in(qk: Any, v: Any, pos: Any, keys: Any, values: Any, spec: Any, n_heads: int) -> Any:
        calls.append(tuple(qk.shape))
        return cuda_rope_kv.reference(qk, v, pos, keys, values, spec.mlx, n_heads)

    return stand_in


@pytest.mark.parametrize("arch,bits,kw", [("llama", None, {}), ("llama", 4, {}), ("qwen3", None, {}),
                                          ("llama", None, {"rope_scaling": LLAMA3_ROPE_SCALING})])
def test_segments_calling_the_kernel_keep_the_tokens(tiny, monkeypatch: pytest.MonkeyPatch, switches: Any, arch: str,
                                                     bits: int | None, kw: dict[str, Any]) -> None:
    """The kernel stood in for by MLX's RoPE and slice updates: the first and the middle segment
    (each traced once) hand it the fused projection's output as it comes [1, 1, (q + 2 kv heads) *
    D] (no views between them), or where q and k are normalized first (Qwen 3) the joint q/k heads
    [1, q + kv heads, 1, D]; the tokens are the uncompiled loop's; the session's buffers are private
    copies (a cache's own arrays are never handed over)."""
    model = tiny(arch, bits, **kw)
    calls: list[tuple[int, ...]] = []
    monkeypatch.setattr(cuda_rope_kv, "rope_write_kv", _stand_in(calls))
    monkeypatch.setattr(cuda_rope_kv, "check", lambda *a: True)
    copied: list[Any] = []
    real_copy = cuda_rope_kv.private_copy
    monkeypatch.setattr(cuda_rope_kv, "private_copy", lambda a: copied.append(a) or real_copy(a))
    switches.env("PYMLXC_CUDA_ROPE_KV", "1")
    decoder = stood_in_decoder(model, "rope_kv")
    attn = model.layers[0].self_attn
    heads = ((1, attn.n_heads + attn.n_kv_heads, 1, attn.head_dim) if attn.qk_norms()
             else (1, 1, (attn.n_heads + 2 * attn.n_kv_heads) * attn.head_dim))
    assert calls == [heads] * 2
    assert len(copied) == 2 * len(model.layers)
    decoder.close()


def test_heads_of_another_type_than_the_buffers_skip_the_kernel(tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel writes the heads' type into the buffers: a segment whose heads and buffers differ
    in type (float16 heads, float32 buffers here) uses MLX's RoPE and casting updates instead; with
    one type it calls the kernel."""
    model = tiny()
    attn = model.layers[0].self_attn
    (qkv, _), = segments.fusions_for(model.layers[:1], {})
    spec = segments.rope_of(attn.rope, attn.head_dim)
    group = segments.segment_group([], {}, rope=spec)
    x = mx.astype(mx.array(np.random.default_rng(3).standard_normal((1, 1, 64)).astype(np.float32)), mx.float16)
    pos = mx.array(4, dtype=mx.int32)
    calls: list[tuple[int, ...]] = []
    monkeypatch.setattr(cuda_rope_kv, "rope_write_kv", _stand_in(calls))
    for dtype, kernel in ((mx.float32, False), (mx.float16, True)):
        keys, values = (mx.zeros((1, attn.n_kv_heads, 8, attn.head_dim), dtype) for _ in range(2))
        _q, k, v = segments._heads(group, attn, x, pos, qkv.fused, [keys, values, spec.table])  # noqa: SLF001
        assert bool(calls) == kernel and k.dtype == v.dtype == dtype
        assert bool(mx.any(k[:, :, 4] != 0).item()) and not bool(mx.any(k[:, :, 5:] != 0).item())


@pytest.mark.parametrize("form", ["separate heads", "the fused projection's output"])
@pytest.mark.parametrize("fault", ["queries", "keys", "values"])
def test_the_check_rejects_any_difference(monkeypatch: pytest.MonkeyPatch, fault: str, form: str) -> None:
    """The check compares queries, keys and values with MLX's at every probed position, for both
    forms the kernel takes its heads in (apart, or the fused projection's output with `v` None): a
    kernel off by one unit in the last place in any of them, in either form, is rejected with a
    warning naming it; the exact one (MLX's kernels themselves) passes."""
    rope = RoPE(16, base=10000.0)
    spec = segments.rope_of(rope, 16)

    def stand_in(qk: Any, v: Any, pos: Any, keys: Any, values: Any, s: Any, n_heads: int) -> Any:
        out = list(cuda_rope_kv.reference(qk, v, pos, keys, values, rope, n_heads))
        if fault != "none" and (v is None) == (form != "separate heads"):
            i = ("queries", "keys", "values").index(fault)
            bits = mx.view(out[i], mx.int16)
            out[i] = mx.view(bits + mx.array(1, dtype=mx.int16), mx.float16)
        return tuple(out)

    monkeypatch.setattr(cuda_rope_kv, "rope_write_kv", stand_in)
    with pytest.warns(RuntimeWarning, match=f"its {fault} at position 0 from {form} differ"):
        assert not cuda_rope_kv.check(mx.float16, 4, 2, 16, 16, spec, rope)
    fault = "none"
    cuda_rope_kv.checks.forget()
    assert cuda_rope_kv.check(mx.float16, 4, 2, 16, 16, spec, rope)


# ---------------------------------------------------------------------- on CUDA

@cuda_only
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hq=st.sampled_from([1, 2, 4, 8, 16, 32]), group=st.sampled_from([1, 2, 4, 8]),
       d=st.sampled_from([16, 64, 128, 256]), dtype=st.sampled_from(["bfloat16", "float16", "float32"]),
       base=st.sampled_from([10000.0, 500000.0, 1000000.0]), llama3=st.booleans(),
       scale=st.sampled_from([1.0, 0.25]), position=st.integers(0, 131071), seed=st.integers(0, 2**16),
       joint=st.booleans())
def test_the_kernel_is_mlx_rope_and_slice_updates(hq: int, group: int, d: int, dtype: str, base: float,
                                                  llama3: bool, scale: float, position: int, seed: int,
                                                  joint: bool) -> None:
    """Bit for bit MLX's RoPE and slice updates, from separate heads or (`joint`) from the fused
    projection's output [1, 1, (q + 2 kv heads) * D]."""
    hkv = max(1, hq // group)
    freqs = llama3_freqs(d, base, LLAMA3_ROPE_SCALING) if llama3 else None
    rope = RoPE(d, base=base, scale=1.0 if llama3 else scale, freqs=freqs)
    spec = segments.rope_of(rope, d)
    rng = np.random.default_rng(seed)
    t = getattr(mx, dtype)
    qk, v = (mx.astype(mx.array(rng.standard_normal(s).astype(np.float32)), t)
             for s in [(1, hq + hkv, 1, d), (1, hkv, 1, d)])
    if joint:
        qk, v = mx.reshape(mx.concatenate([mx.reshape(qk, (1, 1, -1)), mx.reshape(v, (1, 1, -1))], axis=2),
                           (1, 1, (hq + 2 * hkv) * d)), None
    slots = position + 3
    keys, values = (mx.astype(mx.array(rng.standard_normal((1, hkv, slots, d)).astype(np.float32)), t)
                    for _ in range(2))
    pos = mx.array(position, dtype=mx.int32)
    want = cuda_rope_kv.reference(qk, v, pos, keys, values, rope, hq)
    got = cuda_rope_kv.rope_write_kv(qk, v, pos, cuda_rope_kv.private_copy(keys), cuda_rope_kv.private_copy(values),
                                     spec, hq)
    mx.eval(got[0])
    for name, g, w in zip(("queries", "keys", "values"), got, want, strict=True):
        assert bool(mx.array_equal(g, w).item()), name


@cuda_only
@pytest.mark.parametrize("arch,bits,kw", [("llama", None, {}), ("llama", 4, {}), ("qwen3", None, {}),
                                          ("llama", None, {"rope_scaling": LLAMA3_ROPE_SCALING})])
def test_decoding_with_the_kernel_keeps_the_tokens(tiny, arch: str, bits: int | None, kw: dict[str, Any]) -> None:
    model = tiny(arch, bits, **kw)
    want = greedy_ids(model, None, n=40)
    decoder = CompiledDecoder(model, "segmented")
    assert greedy_ids(model, decoder, n=40) == want
    assert decoder.stats["compiled"] == 1 and plan_flags(decoder, "rope_kv") == {True}
    decoder.close()

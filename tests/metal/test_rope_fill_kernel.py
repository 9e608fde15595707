"""A prompt's first chunk: each layer's RoPE and its cache's first buffers as one CUDA kernel
(backends/metal/kernels/rope_fill_kv.py), in the compiled prefill.

Everywhere: the reference is MLX's RoPE and the cache's own first update; the check rejects a
kernel whose queries, keys or values differ from it in any bit (MLX's kernels standing in for it
pass); a capacity under the chunk's length is refused. The runner's use of it: test_prefill_segments.py.

On CUDA: the kernel equals the reference bit for bit over head layouts, types, RoPEs, lengths,
capacities and the trace's strided heads, and generations that use it keep the uncompiled loop's
greedy tokens.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pymlxc.core as mx
from pymlxc.backends.metal import generate as loops
from pymlxc.backends.metal.cache import KVCache
from pymlxc.backends.metal.decode import segments
from pymlxc.backends.metal.decode.decoder import CompiledDecoder
from pymlxc.backends.metal.kernels import rope_fill_kv
from pymlxc.backends.metal.models.base import RoPE, llama3_freqs
from pymlxc.backends.metal.sample import greedy
from pymlxc.testing import LLAMA3_ROPE_SCALING

from .cuda_decode_helpers import cuda_only, forget_verdicts

fresh_checks = forget_verdicts(rope_fill_kv.checks)


def heads(rng: np.random.Generator, batch: int, length: int, hq: int, hkv: int, d: int, dtype: Any
          ) -> tuple[Any, Any, Any]:
    """q, k, v as the compiled prefill hands them over: views of one [B, L, heads * D] product."""
    joint = mx.astype(mx.array(rng.standard_normal((batch, length, (hq + 2 * hkv) * d)).astype(np.float32)), dtype)
    all_heads = mx.transpose(mx.reshape(joint, (batch, length, hq + 2 * hkv, d)), (0, 2, 1, 3))
    part = [mx.slice(all_heads, [0, a, 0, 0], [batch, b, length, d], [1, 1, 1, 1])
            for a, b in ((0, hq), (hq, hq + hkv), (hq + hkv, hq + 2 * hkv))]
    return part[0], part[1], part[2]


def test_the_reference_is_the_caches_first_update() -> None:
    """The reference's buffers are what a fresh KVCache holds after its first update of the RoPE'd
    keys, with the capacity it grows by (`growth`), and its queries the RoPE of q."""
    rope = RoPE(16, base=10000.0)
    q, k, v = heads(np.random.default_rng(0), 1, 9, 4, 2, 16, mx.float16)
    cache = KVCache()
    cache.reserve(300)
    capacity = cache.growth(9)
    got_q, keys, values = rope_fill_kv.reference(q, k, v, capacity, rope)
    cache.update_and_fetch(rope(k, 0), v)
    assert capacity == 300 and cache.keys.shape == keys.shape
    for a, b in ((got_q, rope(q, 0)), (keys, cache.keys), (values, cache.values)):
        assert bool(mx.array_equal(a, b).item())


def test_a_fresh_cache_starts_with_given_buffers() -> None:
    cache = KVCache()
    assert cache.fresh()
    keys, values = (mx.arange(2 * 3 * 8 * 4, dtype=mx.float32).reshape(2, 3, 8, 4) for _ in range(2))
    k, v = cache.start_with(keys, values, 5)
    assert cache.offset == 5 and k.shape == v.shape == (2, 3, 5, 4) and not cache.fresh()
    assert bool(mx.array_equal(k, keys[:, :, :5]).item())
    k2, _v2 = cache.update_and_fetch(mx.ones((2, 3, 3, 4)), mx.ones((2, 3, 3, 4)))  # fills the buffer
    assert k2.shape == (2, 3, 8, 4) and cache.keys.shape == (2, 3, 8, 4)
    with pytest.raises(RuntimeError, match="held nothing"):
        cache.start_with(keys, values, 5)


def test_a_capacity_under_the_length_is_refused() -> None:
    spec = segments.rope_of(RoPE(16, base=10000.0), 16)
    q, k, v = heads(np.random.default_rng(0), 1, 9, 4, 2, 16, mx.float16)
    with pytest.raises(ValueError, match="8 slots cannot take a chunk of 9"):
        rope_fill_kv.rope_fill_kv(q, k, v, rope_fill_kv.slots_array(8), 8, spec)


@pytest.mark.parametrize("fault", ["queries", "keys", "values"])
def test_the_check_rejects_any_difference(monkeypatch: pytest.MonkeyPatch, fault: str) -> None:
    """A kernel off by one unit in the last place in any output is rejected with a warning naming
    it; the exact one (the reference itself) passes."""
    rope = RoPE(16, base=10000.0)
    spec = segments.rope_of(rope, 16)

    def stand_in(q: Any, k: Any, v: Any, slots: Any, capacity: int, s: Any) -> Any:
        out = list(rope_fill_kv.reference(q, k, v, capacity, rope))
        if fault != "none":
            i = ("queries", "keys", "values").index(fault)
            out[i] = mx.view(mx.view(out[i], mx.int16) + mx.array(1, dtype=mx.int16), mx.float16)
        return tuple(out)

    monkeypatch.setattr(rope_fill_kv, "rope_fill_kv", stand_in)
    with pytest.warns(RuntimeWarning, match=f"its {fault} for 1 x 1 tokens into 264 slots differ"):
        assert not rope_fill_kv.check(mx.float16, 4, 2, 16, 16, spec, rope)
    fault = "none"
    rope_fill_kv.checks.forget()
    assert rope_fill_kv.check(mx.float16, 4, 2, 16, 16, spec, rope)


# ---------------------------------------------------------------------- on CUDA

@cuda_only
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hq=st.sampled_from([1, 2, 4, 8, 16, 32]), group=st.sampled_from([1, 2, 4, 8]),
       d=st.sampled_from([16, 64, 128, 256]), dtype=st.sampled_from(["bfloat16", "float16", "float32"]),
       base=st.sampled_from([10000.0, 500000.0, 1000000.0]), llama3=st.booleans(),
       scale=st.sampled_from([1.0, 0.25]), batch=st.integers(1, 3), length=st.integers(1, 700),
       room=st.integers(0, 300), seed=st.integers(0, 2**16))
def test_the_kernel_is_mlx_rope_and_the_first_update(hq: int, group: int, d: int, dtype: str, base: float,
                                                     llama3: bool, scale: float, batch: int, length: int,
                                                     room: int, seed: int) -> None:
    hkv = max(1, hq // group)
    freqs = llama3_freqs(d, base, LLAMA3_ROPE_SCALING) if llama3 else None
    rope = RoPE(d, base=base, scale=1.0 if llama3 else scale, freqs=freqs)
    spec = segments.rope_of(rope, d)
    q, k, v = heads(np.random.default_rng(seed), batch, length, hq, hkv, d, getattr(mx, dtype))
    capacity = length + room
    got = rope_fill_kv.rope_fill_kv(q, k, v, rope_fill_kv.slots_array(capacity), capacity, spec)
    want = rope_fill_kv.reference(q, k, v, capacity, rope)
    mx.eval(*got, *want)
    for name, g, w in zip(("queries", "keys", "values"), got, want, strict=True):
        assert g.shape == w.shape and bool(mx.array_equal(g, w).item()), name


@cuda_only
@pytest.mark.parametrize("arch,bits,kw", [("llama", None, {}), ("llama", 4, {}), ("qwen3", None, {}),
                                          ("llama", None, {"rope_scaling": LLAMA3_ROPE_SCALING})])
def test_generations_with_the_kernel_keep_their_tokens(tiny, arch: str, bits: int | None, kw: dict[str, Any]
                                                       ) -> None:
    model = tiny(arch, bits, **kw)
    decoder = CompiledDecoder(model, "segmented")
    try:
        runner = decoder.prefill_runner(True)
        assert runner is not None and runner._rope_fill is not None  # noqa: SLF001 - the choice under test
        for n in (7, 130):
            prompt = [int(i) for i in np.random.default_rng(n).integers(16, 200, size=n)]
            want = list(loops.generate_ids(model, prompt, cache=model.make_cache(None), max_tokens=16,
                                           sampler=greedy))
            got = list(loops.generate_ids(model, prompt, cache=model.make_cache(None), max_tokens=16,
                                          sampler=greedy, decoder=decoder))
            assert got == want
    finally:
        decoder.close()

"""pymlxc's 4-bit dequantization kernel (backends/metal/kernels/dequantize.py) and its choice.

Everywhere: the launch covers every packed word; the kernel takes 4-bit weights of its group sizes
in 2-byte dtypes only; `dequantized_weight` gives MLX's `dequantize` where the kernel does not
run (a CPU, other bit widths), and the load-time check runs nothing there.

On CUDA (MLX's CUDA build): the kernel's values are MLX's within one rounding of the dtype, for
weights whose word count is not a whole number of thread blocks, one or several weights a call;
its check passes.
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pymlxc.core as mx
from pymlxc.backends.metal import kernel_choice, nn
from pymlxc.backends.metal.kernels import dequantize

ON_CUDA = mx.cuda_available() and mx.default_device().type == "gpu"
cuda_only = pytest.mark.skipif(not ON_CUDA, reason="the kernel needs MLX's CUDA build (run on the GPU machine)")


@given(words=st.integers(1, 10**7))
def test_the_launch_covers_every_word(words: int) -> None:
    geo = dequantize.launch(words, mx.bfloat16, 64)
    threads = geo["grid"][0]
    assert geo["threadgroup"] == (dequantize.THREADS, 1, 1) and geo["grid"][1:] == (1, 1)
    assert threads % dequantize.THREADS == 0 and threads >= words > threads - dequantize.THREADS
    assert dict(geo["template"]) == {"T": mx.bfloat16, "G": 64}


def test_what_the_kernel_takes() -> None:
    assert dequantize.applies(4, 64, 2) and dequantize.applies(4, 32, 2) and dequantize.applies(4, 128, 2)
    assert not dequantize.applies(8, 64, 2) and not dequantize.applies(4, 16, 2)
    assert not dequantize.applies(4, 64, 4)  # float32 scales


@pytest.mark.parametrize(("bits", "group", "dtype"), [(4, 64, "bfloat16"), (4, 32, "float16"), (8, 64, "bfloat16"),
                                                      (3, 32, "float32"), (4, 128, "float32")])
def test_dequantized_weight_gives_mlx_values(bits: int, group: int, dtype: str) -> None:
    """Where the kernel does not run (here: the layout, or a machine without CUDA) MLX's own
    dequantization, bit for bit."""
    w = mx.array(np.random.default_rng(bits).standard_normal((40, 256)).astype(np.float32)).astype(getattr(mx, dtype))
    q = mx.quantize(w, group, bits)
    takes = kernel_choice.dequantize_kernel_takes(*q, group, bits)
    assert takes == (ON_CUDA and dequantize.applies(bits, group, q[1].dtype.size))
    got = kernel_choice.dequantized_weight(*q, group, bits, takes)
    want = mx.dequantize(*q, group, bits)
    assert got.shape == want.shape == (40, 256) and got.dtype == want.dtype
    if not takes:
        assert np.array_equal(np.asarray(got.astype(mx.float32)), np.asarray(want.astype(mx.float32)))


def test_the_sources_of_several_weights() -> None:
    """Each weight of a call has its inputs and output by index, and its stanza in the source."""
    assert dequantize.inputs(2) == ("w0", "scales0", "biases0", "w1", "scales1", "biases1")
    assert dequantize.outputs(3) == ("out0", "out1", "out2")
    for count in (1, dequantize.MAX_WEIGHTS):
        text = dequantize.source(count)
        assert all(f"w{i}_shape" in text and f"out{i}, t)" in text for i in range(count))
        assert f"w{count}" not in text
    assert len({dequantize.name(c) for c in range(1, dequantize.MAX_WEIGHTS + 1)}) == dequantize.MAX_WEIGHTS
    for bad in (0, dequantize.MAX_WEIGHTS + 1):
        with pytest.raises(ValueError, match="1 to"):
            dequantize.source(bad)


@given(kinds=st.lists(st.tuples(st.sampled_from([(4, 64), (4, 32), (8, 64), (3, 32)]), st.booleans()),
                      min_size=1, max_size=11))
@settings(max_examples=15, deadline=None)
def test_dequantized_weights_keep_their_order(kinds: list[tuple[tuple[int, int], bool]]) -> None:
    """Weights of several layouts, some of them asked of the kernel: each comes back in its place
    with its own values (MLX's where the kernel does not run, bit for bit)."""
    rng = np.random.default_rng(len(kinds))
    weights, asked, wants = [], [], []
    for i, ((bits, group), ask) in enumerate(kinds):
        w = mx.array(rng.standard_normal((3 + i, 128)).astype(np.float32)).astype(mx.float16)
        q = mx.quantize(w, group, bits)
        weights.append((*q, group, bits))
        asked.append(ask and kernel_choice.dequantize_kernel_takes(*q, group, bits))
        wants.append(np.asarray(mx.dequantize(*q, group, bits).astype(mx.float32)))
    got = kernel_choice.dequantized_weights(weights, asked)
    assert len(got) == len(weights)
    for g, want, kernel in zip(got, wants, asked, strict=True):
        values = np.asarray(g.astype(mx.float32))
        assert values.shape == want.shape
        if kernel:
            assert np.all(np.abs(values - want) <= np.abs(want) * 2.0 ** -10 + 1e-6)
        else:
            assert np.array_equal(values, want)
    with pytest.raises(ValueError, match="kernel choices"):
        kernel_choice.dequantized_weights(weights, asked[:-1])


@pytest.mark.skipif(ON_CUDA, reason="on CUDA the check runs (test_the_check_passes)")
def test_no_check_runs_without_cuda() -> None:
    layer = nn.QuantizedLinear(64, 16, group_size=32, bits=4)
    layer.weight, layer.scales, layer.biases = mx.quantize(mx.ones((16, 64), mx.bfloat16), 32, 4)
    before = kernel_choice.dequantize_checks.checks_run
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kernel_choice.check_dequantize_kernel([layer])
    assert kernel_choice.dequantize_checks.checks_run == before


@cuda_only
def test_the_check_passes() -> None:
    for dtype in (mx.bfloat16, mx.float16):
        for group in dequantize.GROUP_SIZES:
            assert kernel_choice.dequantize_ready(dtype, group), (dtype, group)


@cuda_only
@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 70), groups=st.integers(1, 12), group=st.sampled_from(list(dequantize.GROUP_SIZES)),
       dtype=st.sampled_from(["bfloat16", "float16"]), seed=st.integers(0, 2**16))
def test_the_kernel_gives_mlx_values(rows: int, groups: int, group: int, dtype: str, seed: int) -> None:
    dt = getattr(mx, dtype)
    w = mx.array(np.random.default_rng(seed).standard_normal((rows, groups * group)).astype(np.float32)).astype(dt)
    q = mx.quantize(w, group, 4)
    want = np.asarray(mx.dequantize(*q, group, 4).astype(mx.float32))
    assert kernel_choice.dequantize_kernel_takes(*q, group, 4)
    got = np.asarray(kernel_choice.dequantized_weight(*q, group, 4, True).astype(mx.float32))
    assert got.shape == want.shape
    ulp = 2.0 ** -(7 if dtype == "bfloat16" else 10)
    assert np.all(np.abs(got - want) <= np.abs(want) * ulp + 1e-6)


@cuda_only
@settings(max_examples=15, deadline=None)
@given(shapes=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 6)), min_size=2, max_size=dequantize.MAX_WEIGHTS),
       group=st.sampled_from(list(dequantize.GROUP_SIZES)), seed=st.integers(0, 2**16))
def test_one_call_of_several_weights_gives_mlx_values(shapes: list[tuple[int, int]], group: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    dense = [mx.array(rng.standard_normal((rows, groups * group)).astype(np.float32)).astype(mx.bfloat16)
             for rows, groups in shapes]
    weights = [(*mx.quantize(w, group, 4), group, 4) for w in dense]
    got = kernel_choice.dequantized_weights(weights, [True] * len(weights))
    for g, q in zip(got, weights, strict=True):
        want = np.asarray(mx.dequantize(*q).astype(mx.float32))
        assert np.all(np.abs(np.asarray(g.astype(mx.float32)) - want) <= np.abs(want) * 2.0 ** -7 + 1e-6)

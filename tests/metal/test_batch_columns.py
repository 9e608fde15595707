"""The decode batch's shared positions and masks (`batching.Columns`) and the folding of a decode
batch's rows into one quantized product, and a prefill's many rows as dense products (`nn._quantized_product`)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pymlxc.core as mx
from pymlxc.backends.metal import batching, nn


def _reference_mask(idx: int, valid: np.ndarray, window: int | None) -> np.ndarray | None:
    cols = np.arange(idx + 1)
    visible = cols[None, :] >= valid[:, None]
    if window is not None:
        visible &= (idx - cols)[None, :] < window
    return None if visible.all() else visible[:, None, None, :]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 6), min_size=1, max_size=5), st.integers(6, 12), st.integers(1, 6),
       st.sampled_from([None, 2, 5, 40]))
def test_positions_and_masks_follow_the_columns(valid_list: list[int], idx: int, steps: int,
                                               window: int | None) -> None:
    """Step by step (positions carried on the device) and after the rows change, the shared arrays
    equal the numpy definitions that each layer used to rebuild."""
    columns = batching.Columns()
    valid = np.array(valid_list)
    starts = valid - np.arange(len(valid_list))  # rows of different lengths
    for step in range(steps):
        at = idx + step
        for _layer in range(3):  # every layer asks; the arrays are the same
            offset = columns.offset(at, starts)
            assert offset.tolist() == (at - starts).tolist()
            got = columns.mask(at, valid, window)
            want = _reference_mask(at, valid, window)
            if want is None:
                assert got is None
            else:
                assert got is not None and np.array_equal(np.array(got.tolist()), want)
    # A row leaves: the columns shift, and nothing of the old rows' arrays is reused.
    keep = np.arange(len(valid_list))[:-1] if len(valid_list) > 1 else np.arange(1)
    starts, valid = starts[keep] - 1, np.maximum(valid[keep] - 1, 0)
    at = idx + steps - 1
    assert columns.offset(at, starts).tolist() == (at - starts).tolist()
    want = _reference_mask(at, valid, window)
    got = columns.mask(at, valid, window)
    assert (got is None) == (want is None)
    if want is not None and got is not None:
        assert np.array_equal(np.array(got.tolist()), want)


def test_a_decode_batch_is_one_product_of_its_rows(monkeypatch) -> None:
    """[B, 1, K] with B >= 8 reaches MLX's quantized product as [1, B, K] (one product of B rows),
    and gives each row its own product; fewer rows, one token of one row, and prompts reach it as
    they are."""
    seen: list[tuple[int, ...]] = []
    real = nn._qmm

    def spy(x, *args):
        seen.append(tuple(x.shape))
        return real(x, *args)

    monkeypatch.setattr(nn, "_qmm", spy)
    layer = nn.QuantizedLinear(64, 32, bias=True, group_size=32, bits=4)
    w = mx.random.normal((32, 64), key=mx.random.key(1))
    layer.weight, layer.scales, layer.biases = mx.quantize(w, 32, 4)
    layer.bias = mx.random.normal((32,), key=mx.random.key(2))
    x = mx.random.normal((9, 1, 64), key=mx.random.key(3))
    batch = np.array(layer(x).tolist())
    assert seen == [(1, 9, 64)] and batch.shape == (9, 1, 32)
    for b in range(9):
        alone = np.array(layer(x[b:b + 1]).tolist())
        np.testing.assert_allclose(batch[b], alone[0], rtol=1e-5, atol=1e-5)
    seen.clear()
    for shape in ((1, 1, 64), (7, 1, 64), (1, 7, 64), (3, 64)):
        assert layer(mx.zeros(shape)).shape == (*shape[:-1], 32)
    assert seen == [(1, 1, 64), (7, 1, 64), (1, 7, 64), (3, 64)]


@pytest.mark.parametrize("bits,group", [(4, 32), (4, 64), (8, 64)])
def test_many_rows_go_dense_in_chunks_with_the_quantized_product(monkeypatch, bits: int, group: int) -> None:
    """A layer marked for dense products (PYMLXC_DENSE_PREFILL) takes DENSE_MIN_ROWS rows or more as
    chunks of dequantized rows and dense matmuls, the quantized product's values; fewer rows, a
    shapeless trace and a gradient's kernels-only scope keep MLX's quantized product."""
    from pymlxc.backends.metal import kernel_choice

    calls: list[tuple[int, ...]] = []
    real = nn._qmm
    monkeypatch.setattr(nn, "_qmm", lambda x, *a: calls.append(tuple(x.shape)) or real(x, *a))
    monkeypatch.setattr(nn, "DENSE_CHUNK_WEIGHTS", 40 * 128)  # 40 rows of W a chunk: 3 chunks of 96
    layer = nn.QuantizedLinear(128, 96, group_size=group, bits=bits)
    w = mx.random.normal((96, 128), key=mx.random.key(4))
    layer.weight, layer.scales, layer.biases = mx.quantize(w, group, bits)
    nn.mark_dense_products(layer, True)
    x = mx.random.normal((2, nn.DENSE_MIN_ROWS // 2, 128), key=mx.random.key(5))
    dense = np.array(layer(x).tolist())
    assert calls == []
    nn.mark_dense_products(layer, False)
    want = np.array(layer(x).tolist())
    np.testing.assert_allclose(dense, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))
    nn.mark_dense_products(layer, True)
    calls.clear()
    layer(x[:, :3])
    with nn.shapeless_trace():
        layer(x)
    with kernel_choice.mlx_kernels_only():
        layer(x)
    assert len(calls) == 3

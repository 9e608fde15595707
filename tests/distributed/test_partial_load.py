"""Each rank reads only its part of a safetensors checkpoint: `read_part` returns exactly the
slice of the stored tensor (any dtype, axis and rank count), and a model loaded over 2 ranks peaks
at about half the split weights plus the whole ones, measured by MLX's peak memory."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pymlxc.core as mx
from pymlxc.backends.metal.distributed import ShardingError
from pymlxc.backends.metal.distributed.partial import Source, read_part, split_axis
from pymlxc.backends.metal.distributed.tensor import part
from pymlxc.testing import write_tiny_model

from .helpers import ranks, reference, result_of

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16, "uint32": mx.uint32,
          "int8": mx.int8}


@settings(max_examples=40, deadline=None)
@given(dtype=st.sampled_from(sorted(DTYPES)), dims=st.lists(st.integers(1, 5), min_size=1, max_size=3),
       size=st.sampled_from([1, 2, 4]), data=st.data())
def test_read_part_is_the_slice_of_the_stored_tensor(tmp_path_factory: pytest.TempPathFactory, dtype: str,
                                                     dims: list[int], size: int, data: st.DataObject) -> None:
    axis = data.draw(st.integers(0, len(dims) - 1))
    # The split axis in 1-3 sections (q, k, v one after the other), each cut on its own.
    per_rank = data.draw(st.lists(st.integers(1, 3), min_size=1, max_size=3))
    dims[axis] = sum(per_rank)
    sections = tuple(n * size for n in per_rank)
    shape = list(dims)
    shape[axis] *= size
    full = (mx.random.normal(shape) * 50).astype(DTYPES[dtype])
    file = tmp_path_factory.mktemp("st") / "t.safetensors"
    mx.save_safetensors(file, {"before": mx.ones((3,)), "t": full})  # "t" does not start the data
    whole = np.array(full.astype(mx.float32))
    for rank in range(size):
        got = read_part(Source(full, file, "t"), axis, rank, size, sections)
        assert got.dtype == full.dtype and got.shape == tuple(dims)
        rows, start = [], 0
        for n in per_rank:  # section by section: this rank's n rows of each
            rows += range(start + rank * n, start + (rank + 1) * n)
            start += n * size
        want = np.take(whole, rows, axis=axis)
        np.testing.assert_array_equal(np.array(got.astype(mx.float32)), want)
        # The in-memory split (a model loaded whole, e.g. GGUF) cuts the same rows.
        np.testing.assert_array_equal(np.array(part(full, axis, rank, size, sections).astype(mx.float32)), want)


def test_shapes_that_are_not_parts_are_named() -> None:
    assert split_axis("w", (8, 6), (4, 6), 2) == 0
    assert split_axis("w", (8, 6), (8, 3), 2) == 1
    for full, mine in (((8, 6), (4, 3)), ((8, 6), (3, 6)), ((8, 6), (8,))):
        with pytest.raises(ShardingError, match=r"tensor 'w': shape .* is not 2 parts of this rank's"):
            split_axis("w", full, mine, 2)


def test_a_corrupt_header_is_named(tmp_path: Path) -> None:
    file = tmp_path / "bad.safetensors"
    file.write_bytes(struct.pack("<Q", 5) + b"{nope")
    with pytest.raises(ShardingError, match=r"bad\.safetensors: the safetensors header is not JSON"):
        read_part(Source(mx.zeros((2,)), file, "t"), 0, 0, 2)
    header = json.dumps({"t": {"dtype": "F64X", "shape": [2], "data_offsets": [0, 16]}}).encode()
    file.write_bytes(struct.pack("<Q", len(header)) + header + bytes(16))
    with pytest.raises(ShardingError, match="tensor 't' has dtype 'F64X', which cannot be read in parts"):
        read_part(Source(mx.zeros((2,)), file, "t"), 0, 0, 2)


def _split_bytes(model: Path) -> tuple[int, int]:
    """(bytes of the tensors tensor parallelism splits, bytes of the others) in the checkpoint."""
    split = whole = 0
    arrays, _ = mx.load_safetensors(model / "model.safetensors")
    for name, a in arrays.items():
        if any(p in name for p in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")):
            split += a.nbytes
        else:
            whole += a.nbytes
    return split, whole


@pytest.mark.parametrize("bits", [None, 4])
def test_two_ranks_peak_at_half_the_split_weights(tmp_path: Path, bits: int | None) -> None:
    # The MLP dominates (as in a real model): 4 layers of 128 -> 2048 -> 128.
    model = write_tiny_model(tmp_path / "m", "llama", quantize_bits=bits, hidden_size=128, intermediate_size=2048,
                             num_layers=4, vocab_size=320)
    split, whole = _split_bytes(model)
    assert split > 4 * whole
    alone = reference(model, "--load-only")["load_peak"]
    assert alone >= split + whole
    for r in ranks(2, model, "tensor", "--load-only"):
        got = result_of(r.stdout)
        # Half the split weights and all the others, and 10% for what loading allocates on the way.
        assert got["load_peak"] <= 1.1 * (split / 2 + whole), (got, split, whole)
        assert got["load_active"] >= split / 2 + whole
    for r in ranks(2, model, "pipeline", "--load-only"):
        assert result_of(r.stdout)["load_peak"] <= 1.1 * (split / 2 + whole)  # two of the four blocks each


def test_tensors_sanitize_computes_are_split_too(tmp_path: Path) -> None:
    """A MoE checkpoint in per-expert tensors: the stacked experts are made by sanitize, then cut."""
    model = write_tiny_model(tmp_path / "moe", "qwen3_moe", extra_config={"moe_intermediate_size": 64})
    want = reference(model, "--tokens", "4")
    for r in ranks(2, model, "tensor", "--tokens", "4"):
        assert result_of(r.stdout)["ids"] == want["ids"]

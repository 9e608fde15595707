"""Gemma 3's whole-step decode graph with fused parts (backends/metal/decode/graph_fusions.py): each
block's q/k/v and gate/up projections as one matmul, and on CUDA each residual add with the offset
norm after it as one kernel (kernels/add_rms_norm.py).

Everywhere: the graph decode fuses the projections (views of one joint weight), installs them on
the trace's copy only, and gives the uncompiled loop's tokens, in float and 4-bit; the setting turns
it off; with the add + norm kernel stood in for by MLX's two ops, the restructured residual stream
(each block's two halves added with the next norm) keeps the tokens. On CUDA: the real kernel keeps
a bfloat16 Gemma's tokens.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import pymlxc.core as mx
from pymlxc.backends.metal import nn
from pymlxc.backends.metal.decode import graph_fusions
from pymlxc.backends.metal.decode.decoder import CompiledDecoder
from pymlxc.backends.metal.kernels import add_rms_norm as cuda_norm
from pymlxc.backends.metal.loader import load_weights_and_config
from pymlxc.testing.tiny import write_tiny_model

from .cuda_decode_helpers import ON_CUDA, cuda_only, greedy_ids, stand_in_for_add_norm

LAYERS = 3


@pytest.fixture
def gemma(tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """`gemma(dtype="bfloat16", bits=None, hidden=64)`: a 3-layer Gemma 3, freed at the end."""
    opened = []

    def load(dtype: str = "bfloat16", bits: int | None = None, hidden: int = 64) -> Any:
        path = write_tiny_model(tmp_path / f"g-{bits}-{hidden}", "gemma3_text", num_layers=LAYERS,
                                dtype="float32", quantize_bits=bits, hidden_size=hidden)
        loaded = load_weights_and_config(path, dtype=dtype)
        opened.append(loaded)
        return loaded.model

    yield load
    for m in opened:
        m.free()


def _traced_fusions(decoder: CompiledDecoder) -> set[Any]:
    """The graph-fusion keys of the decoder's traces (None: a trace without fused parts)."""
    return {key[0][2] for key in decoder._compiled}  # noqa: SLF001 - (classes, inputs, fusions) of each trace


@pytest.mark.parametrize("bits", [None, 4])
def test_the_graph_fuses_the_projections_on_its_copy_and_keeps_the_tokens(gemma, bits: int | None) -> None:
    model = gemma(bits=bits)
    want = greedy_ids(model, None)
    decoder = CompiledDecoder(model, "graph")
    assert greedy_ids(model, decoder) == want
    assert decoder.stats["compiled"] == 1
    pairs = tuple((True, True) for _ in range(LAYERS))
    assert _traced_fusions(decoder) == {(pairs, ON_CUDA)}  # the add + norm kernel on CUDA alone
    # The fusions hold the linears' rows; the model itself holds no fused projection.
    for block in model.layers:
        attn, mlp = block.self_attn, block.mlp
        assert attn._qkv is None and mlp._gate_up is None  # noqa: SLF001
        qkv = decoder._fusions[id(block)][1].fused  # noqa: SLF001
        x = mx.ones((1, 1, attn.q_proj.weight.shape[-1] * (8 if bits else 1)), mx.bfloat16)
        for got, linear in zip(qkv(x), (attn.q_proj, attn.k_proj, attn.v_proj), strict=True):
            assert mx.array_equal(got, linear(x)).item()
    assert len(decoder._fusions) == LAYERS  # noqa: SLF001
    # A second generation reuses the fusions and the trace.
    traces = decoder.stats["traces"]
    assert greedy_ids(model, decoder) == want and decoder.stats["traces"] == traces
    decoder.close()


def test_the_setting_keeps_the_projections_apart(gemma, switches: Any) -> None:
    model = gemma()
    switches.env("PYMLXC_FUSE_PROJECTIONS", "0")
    decoder = CompiledDecoder(model, "graph")
    assert greedy_ids(model, decoder) == greedy_ids(model, None)
    apart = tuple((False, False) for _ in range(LAYERS))
    assert _traced_fusions(decoder) == ({(apart, True)} if ON_CUDA else {None})  # the kernel still on CUDA
    assert not decoder._fusions  # noqa: SLF001
    decoder.close()


def test_a_replaced_weight_is_fused_again(gemma) -> None:
    model = gemma()
    decoder = CompiledDecoder(model, "graph")
    greedy_ids(model, decoder)
    block = model.layers[1]
    old = decoder._fusions[id(block)][1]  # noqa: SLF001
    block.self_attn.k_proj.weight = mx.zeros_like(block.self_attn.k_proj.weight) + 0.01  # the fusion is stale
    assert not old.valid()
    want = greedy_ids(model, None)
    assert greedy_ids(model, decoder) == want
    assert decoder._fusions[id(block)][1] is not old  # noqa: SLF001
    decoder.close()


@pytest.mark.parametrize("width", [64, 1152])
def test_the_add_norm_kernel_stood_in_keeps_the_tokens(gemma, monkeypatch: pytest.MonkeyPatch, width: int) -> None:
    """The kernel stood in for by MLX's own two ops, with the offset norm's 1 + w as its weight:
    the graph that calls it gives the uncompiled loop's tokens (a wrong wiring of the residual
    stream, or the raw w as the weight, changes the tokens of these random models)."""
    model = gemma(hidden=width)
    calls = stand_in_for_add_norm(monkeypatch)
    monkeypatch.setattr(graph_fusions, "use_fused_norm", lambda *a: True)
    want = greedy_ids(model, None)
    decoder = CompiledDecoder(model, "graph")
    assert greedy_ids(model, decoder) == want
    assert _traced_fusions(decoder) == {(tuple((True, True) for _ in range(LAYERS)), True)}
    # Per trace: after each block's attention, between blocks, and before the head.
    assert calls and len(calls) % (2 * LAYERS) == 0
    decoder.close()


def test_the_kernel_is_kept_off_where_it_cannot_serve(gemma, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the kernel's check passing: bfloat16 takes it; float16 (Gemma adds its float16 residuals in
    float32), no norms, the setting 0, and a norm of another class do not."""
    monkeypatch.setattr(cuda_norm, "check", lambda *a: True)
    norms = list(gemma().decode_add_norms())
    assert graph_fusions.use_fused_norm(norms, "1")
    assert not graph_fusions.use_fused_norm(gemma(dtype="float16").decode_add_norms(), "1")
    assert not graph_fusions.use_fused_norm([], "1")
    assert not graph_fusions.use_fused_norm(norms, "0")
    assert not graph_fusions.use_fused_norm([*norms[:-1], nn.RMSNorm(64)], "1")


@cuda_only
def test_on_cuda_the_kernel_keeps_the_tokens(gemma) -> None:
    model = gemma(hidden=1152)
    want = greedy_ids(model, None, n=24)
    decoder = CompiledDecoder(model, "graph")
    assert greedy_ids(model, decoder, n=24) == want
    assert {k[1] for k in _traced_fusions(decoder)} == {True}
    decoder.close()

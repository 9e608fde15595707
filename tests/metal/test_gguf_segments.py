"""GGUF models in the segmented decode. llama.cpp's K-quant recipes give some layers' value
projections another type than their q and k (Q4_K_M: Q6_K in about half the layers); those layers'
q and k still run as one product, with v apart, so that every layer keeps the joint q/k heads (and
CUDA's RoPE + cache-write kernel, which needs them in every layer). On CUDA the layers whose value
and down projections are 4-bit take the matvec kernel's residual and normalized forms, the others
keep MLX's norm before their q/k/v products and MLX's add after their Q6_K down product, while their
o_proj still adds the residual and their gate/up product still normalizes (`segments.fused_layers`)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

import pymlxc.core as mx
from pymlxc.backends.metal import generate as loops
from pymlxc.backends.metal.decode import segments
from pymlxc.backends.metal.decode.decoder import CompiledDecoder
from pymlxc.backends.metal.gguf_layers import BlockLinear
from pymlxc.backends.metal.loader import load_weights_and_config
from pymlxc.backends.metal.sample import greedy
from pymlxc.testing import write_tiny_model

from .cuda_decode_helpers import cuda_only, plan_flags
from .gguf_export import export_gguf


def _tokens(model: Any, ids: list[int], decoder: CompiledDecoder | None, steps: int = 20) -> list[int]:
    return list(loops.generate_ids(model, ids, cache=model.make_cache(None), max_tokens=steps, decoder=decoder,
                                   sampler=greedy))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_value_projection_of_another_type_runs_apart_from_the_joint_q_and_k(
        tmp_path: Path, switches: Any, arch: str) -> None:
    switches(decode="segmented")
    model_dir = write_tiny_model(tmp_path / "hf", arch, seed=3, hidden_size=256, intermediate_size=512,
                                 num_layers=3)
    path = export_gguf(model_dir, tmp_path / "m.gguf", Q.Q4_K,
                       extra_types={"blk.0.attn_v.weight": Q.Q6_K, "blk.2.attn_v.weight": Q.Q8_0})
    loaded = load_weights_and_config(path)
    model = loaded.model
    attns = [layer.self_attn for layer in model.layers]
    assert isinstance(attns[0].v_proj, BlockLinear) and not isinstance(attns[1].v_proj, BlockLinear)
    ids = [int(i) for i in np.random.default_rng(1).integers(16, 500, size=19)]
    want = _tokens(model, ids, None)
    decoder = CompiledDecoder(model)
    assert _tokens(model, ids, decoder) == want
    joint = [decoder._fusions[id(layer)][1] for layer in model.layers]  # noqa: SLF001
    assert all(f is not None for f in joint)
    tails = [f.fused.tail if f is not None else None for f in joint]
    assert tails[0] is attns[0].v_proj and tails[1] is None and tails[2] is attns[2].v_proj
    # The projections' outputs: the joint q/k rows, then v, as the three linears give them.
    x = mx.array(np.random.default_rng(2).standard_normal((1, 1, 256)).astype(np.float32)).astype(model.compute_dtype)
    fused = joint[0].fused if joint[0] is not None else None
    assert fused is not None
    got = fused(x)
    expect = [attns[0].q_proj(x), attns[0].k_proj(x), attns[0].v_proj(x)]
    for g, e in zip(got, expect, strict=True):
        np.testing.assert_array_equal(np.asarray(g.astype(mx.float32)), np.asarray(e.astype(mx.float32)))
    # A new value weight makes that layer's fusion stale, and it is made again.
    attns[0].v_proj.weight = attns[0].v_proj.weight + 0
    assert joint[0] is not None and not joint[0].valid()
    assert _tokens(model, ids, decoder) == want
    decoder.close()
    loaded.free()


@cuda_only
def test_layers_of_another_type_keep_mlx_adds_beside_the_fused_forms(tmp_path: Path, switches: Any) -> None:
    """A Q4_K file with block 0's value and down projections in Q6_K (as Q4_K_M's recipe makes about
    half the layers): blocks 1 and 2 take the products' residual and normalized forms, block 0 its
    o_proj's residual form and the normalized gate/up product (END_O) with its own q/k/v and down
    products and MLX's norm and add around them, and greedy tokens are the uncompiled loop's."""
    switches(decode="segmented")
    switches.env("PYMLXC_CUDA_MATVEC", "1")
    switches.env("PYMLXC_CUDA_MATVEC_FUSION", "1")
    model_dir = write_tiny_model(tmp_path / "hf", "llama", seed=3, hidden_size=256, intermediate_size=512,
                                 num_layers=3)
    path = export_gguf(model_dir, tmp_path / "m.gguf", Q.Q4_K,
                       extra_types={"blk.0.attn_v.weight": Q.Q6_K, "blk.0.ffn_down.weight": Q.Q6_K})
    loaded = load_weights_and_config(path)
    model = loaded.model
    assert isinstance(model.layers[0].mlp.down_proj, BlockLinear)
    ids = [int(i) for i in np.random.default_rng(1).integers(16, 500, size=19)]
    want = _tokens(model, ids, None, steps=30)
    decoder = CompiledDecoder(model)
    assert _tokens(model, ids, decoder, steps=30) == want
    assert plan_flags(decoder, "matvec_fusion") == {"all"}
    both = segments.END_BOTH
    assert plan_flags(decoder, "layers") == {((False, True, True), (segments.END_O, both, both))}
    decoder.close()
    loaded.free()

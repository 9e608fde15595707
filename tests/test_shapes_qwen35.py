"""The real-shape writer's Qwen 3.5 MoE (`pymlxc.testing.shapes`, narrow widths, 4 layers: three
Gated DeltaNet layers and one full-attention layer, all MoE): the directory it writes is an
mlx-community checkpoint after mlx-lm's conversion, which pymlxc and mlx-lm load to the same logits.

float32 weights (dense and 4-bit with float32 scales): the CPU's gather_mm takes float32 only, and
the logits agree to float32 rounding (mlx-lm runs the recurrence token by token, pymlxc in chunks).
bfloat16 4-bit: both load it and agree over a short prompt; longer ones can pick other experts
where the bfloat16 router scores tie.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

mlx = pytest.importorskip("mlx.core")
mlx_utils = pytest.importorskip("mlx_lm.utils")

from safetensors import safe_open  # noqa: E402

import pymlxc.core as mx  # noqa: E402
from pymlxc.backends.metal.loader import load_weights_and_config  # noqa: E402
from pymlxc.testing.shapes import write_random_model  # noqa: E402

SHAPE = "qwen3.5-35b-a3b-narrow"
LAYERS = 4
PROMPT = [[1017, 42, 5000, 3, 777, 6100, 250, 8000, 12, 901]]


def _both(path: Path, prompt: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    ours = load_weights_and_config(path)
    try:
        a = np.asarray(ours.model(mx.array(prompt)).astype(mx.float32))
    finally:
        ours.free()
    ref = mlx_utils.load_model(path)[0]
    return a, np.array(ref(mlx.array(prompt)).astype(mlx.float32))


@pytest.mark.parametrize("bits,dtype,atol", [(None, "float32", 1e-3), (4, "float32", 1e-3), (4, "bfloat16", 1e-2)])
def test_written_model_loads_in_both_with_equal_logits(tmp_path: Path, bits: int | None, dtype: str,
                                                       atol: float) -> None:
    path = write_random_model(tmp_path / "m", SHAPE, bits=bits, layers=LAYERS, dtype=dtype)
    prompt = [PROMPT[0][:8]] if dtype == "bfloat16" else PROMPT
    a, b = _both(path, prompt)
    assert a.shape == (1, len(prompt[0]), 8192) and np.isfinite(a).all()
    assert np.abs(b).max() > 1.0  # not all alike
    np.testing.assert_allclose(a, b, atol=atol, rtol=0)


def test_written_layout_is_mlx_lms_converted_checkpoint(tmp_path: Path) -> None:
    path = write_random_model(tmp_path / "m", SHAPE, bits=4, layers=LAYERS)
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_moe" and config["text_config"]["model_type"] == "qwen3_5_moe_text"
    assert config["text_config"]["num_hidden_layers"] == LAYERS
    quant = config["quantization"]
    assert (quant["bits"], quant["group_size"]) == (4, 64)
    for i in range(LAYERS):
        for router in ("mlp.gate", "mlp.shared_expert_gate"):
            assert quant[f"language_model.model.layers.{i}.{router}"] == {"group_size": 64, "bits": 8}
    index = json.loads((path / "model.safetensors.index.json").read_text())
    names = set(index["weight_map"])
    p = "language_model.model.layers."
    assert {p + "0.linear_attn.conv1d.weight", p + "0.linear_attn.A_log", p + "0.linear_attn.dt_bias",
            p + "3.self_attn.q_proj.scales", p + "0.mlp.switch_mlp.down_proj.scales",
            "language_model.lm_head.scales", "language_model.model.embed_tokens.scales"} <= names
    assert p + "0.linear_attn.conv1d.scales" not in names and p + "0.linear_attn.in_proj_qkv.scales" in names
    shard = path / index["weight_map"][p + "0.linear_attn.conv1d.weight"]
    with safe_open(str(shard), framework="numpy") as f:
        assert f.get_slice(p + "0.linear_attn.conv1d.weight").get_shape() == [2 * 128 + 256, 4, 1]
        assert f.get_slice(p + "0.linear_attn.A_log").get_dtype() == "F32"
        assert f.get_slice(p + "0.mlp.switch_mlp.gate_proj.weight").get_shape() == [8, 128, 256 * 4 // 32]

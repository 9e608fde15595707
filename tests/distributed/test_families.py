"""Tensor parallelism for Gemma 4 (per-layer inputs, shared keys/values, experts beside the MLP)
and the Gated DeltaNet families (Qwen3-Next, Qwen 3.5 dense and MoE): 2 ranks over the ring give
one process's greedy tokens and logits, dense and 4-bit; sizes that do not split are named."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pymlxc.launch import LaunchError
from pymlxc.testing import write_tiny_model

from .helpers import ranks, reference
from .test_parity import TOKENS, _check

FAMILIES = ("gemma4_text", "gemma4", "qwen3_next", "qwen3_5", "qwen3_5_moe")
MOE = ("gemma4", "qwen3_next", "qwen3_5_moe")


def _model(root: Path, arch: str, bits: int | None, **kw: Any) -> Path:
    extra: dict[str, Any] = {}
    if arch in MOE:
        extra["moe_intermediate_size"] = 64  # a 4-bit expert's half of it is one whole group of 32
    if arch == "gemma4":
        extra["num_global_key_value_heads"] = 2  # the tiny default has 1: not divisible by 2
    return write_tiny_model(root / f"{arch}-{bits or 'dense'}", arch, quantize_bits=bits, seed=5, extra_config=extra,
                            **kw)


@pytest.mark.parametrize("bits", [None, 4], ids=["dense", "4bit"])
@pytest.mark.parametrize("arch", FAMILIES)
def test_two_ranks_match_one_process(tmp_path: Path, arch: str, bits: int | None) -> None:
    model = _model(tmp_path, arch, bits)
    _check(ranks(2, model, "tensor", "--tokens", TOKENS), reference(model, "--tokens", TOKENS))


def test_four_ranks_match_one_process(tmp_path: Path) -> None:
    # Qwen 3.5 MoE, 4-bit, every head count and MLP width a multiple of 4 (of whole groups of 32).
    model = write_tiny_model(tmp_path / "q4", "qwen3_5_moe", quantize_bits=4, seed=3, hidden_size=128,
                             num_kv_heads=4, extra_config={"linear_num_key_heads": 4, "linear_num_value_heads": 8,
                                                           "moe_intermediate_size": 128,
                                                           "shared_expert_intermediate_size": 128})
    _check(ranks(4, model, "tensor", "--tokens", TOKENS), reference(model, "--tokens", TOKENS))


def test_batch_and_chat_with_linear_attention(tmp_path: Path) -> None:
    model = _model(tmp_path, "qwen3_5", 4)
    want = reference(model, "--tokens", TOKENS, "--batch")
    _check(ranks(2, model, "tensor", "--tokens", TOKENS, "--batch"), want, ("batch", "chat"))


def test_linear_key_heads_not_divisible(tmp_path: Path) -> None:
    # 4 attention heads and 4 key/value heads split in 4, but the 2 linear key heads cannot.
    model = _model(tmp_path, "qwen3_5", None, num_kv_heads=4)
    with pytest.raises(LaunchError) as info:
        ranks(4, model, "tensor", timeout=120)
    assert "needs the linear-attention key heads divisible by 4: this qwen3_5 model has 2 (4 value heads)" \
        in str(info.value)


def test_gemma4_global_heads_not_divisible(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "g", "gemma4", extra_config={"moe_intermediate_size": 64})
    with pytest.raises(LaunchError) as info:
        ranks(2, model, "tensor", timeout=120)
    assert "4 query heads and 2 key/value heads (1 in its global layers)" in str(info.value)


def test_pipeline_refuses_gemma4_by_name(tmp_path: Path) -> None:
    # Its blocks pass more than a hidden state: shared keys/values, per-layer inputs.
    model = _model(tmp_path, "gemma4_text", None)
    with pytest.raises(LaunchError) as info:
        ranks(2, model, "pipeline", timeout=120)
    assert "pipeline parallelism does not support model type 'gemma4_text'" in str(info.value)

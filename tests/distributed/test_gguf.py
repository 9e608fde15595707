"""GGUF files split over 2 ranks after loading: the block layers (Q2_K, Q3_K, Q6_K) by whole rows
(column parallel) and whole blocks (row parallel), the types repacked as MLX affine layers (Q4_0,
Q4_K, ...) at group boundaries, experts alike, and pipeline stages; the same greedy tokens as one
process, logits within half precision (GGUF quantized models compute in float16, and a sum of two
partial products rounds differently)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from pymlxc.launch import LaunchError
from pymlxc.testing import write_tiny_model
from pymlxc.testing_gguf import export_gguf

from .helpers import ranks, reference, result_of


def _gguf(root: Path, arch: str, qtype: Q, width: int = 512) -> Path:
    # 512 inputs: two 256-weight K-quant blocks a row, one for each rank.
    extra: dict[str, Any] = {"moe_intermediate_size": width} if arch.endswith("_moe") else {}
    src = write_tiny_model(root / f"{arch}-{width}", arch, hidden_size=width, intermediate_size=width, num_heads=4,
                           num_kv_heads=2, vocab_size=320, num_layers=2, seed=1, extra_config=extra)
    return export_gguf(src, root / f"{arch}-{width}.{qtype.name}.gguf", qtype)


@pytest.mark.parametrize("arch,qtype,mode", [("llama", Q.Q6_K, "tensor"), ("llama", Q.Q6_K, "pipeline"),
                                             ("llama", Q.Q4_K, "tensor"), ("qwen3_moe", Q.Q6_K, "tensor")])
def test_two_ranks_match_one_process(tmp_path: Path, arch: str, qtype: Q, mode: str) -> None:
    model = _gguf(tmp_path, arch, qtype)
    want = reference(model, "--tokens", "4", timeout=300)
    for r in ranks(2, model, mode, "--tokens", "4", timeout=300):
        got = result_of(r.stdout)
        assert got["ids"] == want["ids"], f"rank {r.rank}: greedy tokens differ"
        np.testing.assert_allclose(np.array(got["logits"]), np.array(want["logits"]), rtol=1e-2, atol=5e-2)


def test_rows_of_one_block_do_not_split(tmp_path: Path) -> None:
    model = _gguf(tmp_path, "llama", Q.Q6_K, width=256)
    with pytest.raises(LaunchError) as info:
        ranks(2, model, "tensor", timeout=300)
    assert "o_proj: 1 blocks of Q6_K a row cannot be split in 2 equal parts of whole blocks" in str(info.value)

"""2 and 4 ranks over the ring backend (processes on 127.0.0.1) give one process's greedy tokens,
and its logits within float tolerance, for every family that splits, in both modes, dense and
4-bit; batch_generate and chat run the same on every rank."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pymlxc.testing import write_tiny_model

from .helpers import ranks, reference, result_of

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "qwen2_moe", "qwen3_moe")
QUANTIZED = FAMILIES
TOKENS = "6"


def _model(root: Path, arch: str, bits: int | None, *, width: int = 64, kv_heads: int = 2, layers: int = 2) -> Path:
    extra: dict[str, Any] = {}
    if arch.endswith("_moe"):
        # each rank's share of a 4-bit expert is whole groups of 32 (2 ranks at width 64, 4 at 128)
        extra["moe_intermediate_size"] = width
        if arch == "qwen2_moe":
            extra["shared_expert_intermediate_size"] = 2 * width
    return write_tiny_model(root / f"{arch}-{bits or 'dense'}-{width}-{layers}", arch, quantize_bits=bits, seed=3,
                            hidden_size=width, num_kv_heads=kv_heads, num_layers=layers, extra_config=extra)


def _check(results: list[Any], want: dict[str, Any], extra: tuple[str, ...] = ()) -> None:
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
        got = result_of(r.stdout)
        assert got["rank"] == r.rank
        assert got["ids"] == want["ids"], f"rank {r.rank}: greedy tokens differ"
        np.testing.assert_allclose(np.array(got["logits"]), np.array(want["logits"]), rtol=1e-4, atol=1e-4,
                                   err_msg=f"rank {r.rank}: logits differ")
        for key in extra:
            assert got[key] == want[key], f"rank {r.rank}: {key} differs"


CASES = [(arch, None) for arch in FAMILIES] + [(arch, 4) for arch in QUANTIZED]


@pytest.mark.parametrize("mode", ["tensor", "pipeline"])
@pytest.mark.parametrize("arch,bits", CASES, ids=[f"{a}-{b or 'dense'}" for a, b in CASES])
def test_two_ranks_match_one_process(tmp_path_factory: pytest.TempPathFactory, arch: str, bits: int | None,
                                     mode: str) -> None:
    model = _model(tmp_path_factory.getbasetemp() / "models", arch, bits)
    _check(ranks(2, model, mode, "--tokens", TOKENS), reference(model, "--tokens", TOKENS))


@pytest.mark.parametrize("mode", ["tensor", "pipeline"])
def test_batch_and_chat_on_two_ranks(tmp_path_factory: pytest.TempPathFactory, mode: str) -> None:
    model = _model(tmp_path_factory.getbasetemp() / "models", "llama", 4)
    want = reference(model, "--tokens", TOKENS, "--batch")
    _check(ranks(2, model, mode, "--tokens", TOKENS, "--batch"), want, ("batch", "chat"))


@pytest.mark.parametrize("mode", ["tensor", "pipeline"])
@pytest.mark.parametrize("arch,bits", CASES, ids=[f"{a}-{b or 'dense'}" for a, b in CASES])
def test_four_ranks_match_one_process(tmp_path_factory: pytest.TempPathFactory, arch: str, bits: int | None,
                                      mode: str) -> None:
    # 4 key/value heads and 128 wide: each rank's o_proj columns are whole groups of 32; 4 layers.
    model = _model(tmp_path_factory.getbasetemp() / "models", arch, bits, width=128, kv_heads=4, layers=4)
    _check(ranks(4, model, mode, "--tokens", TOKENS), reference(model, "--tokens", TOKENS))


def test_sampling_agrees_across_ranks(tmp_path_factory: pytest.TempPathFactory) -> None:
    """With temperature and no seed, every rank draws rank 0's seed: the same tokens everywhere."""
    model = _model(tmp_path_factory.getbasetemp() / "models", "llama", None)
    got = [result_of(r.stdout)["ids"] for r in ranks(2, model, "tensor", "--tokens", "12", "--temperature", "1.5")]
    assert got[0] == got[1]

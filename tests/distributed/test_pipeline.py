"""Pipeline parallelism beyond the plain attention families: Qwen3-Next and Qwen 3.5 (linear
attention blocks with recurrent caches beside attention blocks) match one process on 2 ranks, with
batch_generate and chat; and a prompt longer than one prefill chunk (whose earlier chunks only fill
caches) still reaches the next stage."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pymlxc.backends.metal.generate import PREFILL_STEP
from pymlxc.testing import write_tiny_model

from .helpers import ranks, reference, result_of
from .test_parity import TOKENS, _check


def _model(root: Path, arch: str, bits: int | None) -> Path:
    extra: dict[str, Any] = {"moe_intermediate_size": 64} if arch != "qwen3_5" else {}
    return write_tiny_model(root / f"{arch}-{bits or 'dense'}", arch, quantize_bits=bits, seed=6, extra_config=extra)


@pytest.mark.parametrize("arch,bits", [("qwen3_next", None), ("qwen3_5", 4), ("qwen3_5_moe", None)])
def test_linear_attention_families_in_stages(tmp_path: Path, arch: str, bits: int | None) -> None:
    model = _model(tmp_path, arch, bits)
    want = reference(model, "--tokens", TOKENS, "--batch")
    _check(ranks(2, model, "pipeline", "--tokens", TOKENS, "--batch"), want, ("batch", "chat"))


@pytest.mark.parametrize("arch", ["llama", "qwen3_next"])
def test_a_prompt_of_several_prefill_chunks(tmp_path: Path, arch: str) -> None:
    model = write_tiny_model(tmp_path / arch, arch, seed=2, num_layers=2 if arch == "llama" else 4)
    args = ("--tokens", "3", "--long-prompt", str(PREFILL_STEP + 600))
    want = reference(model, *args, timeout=300)
    assert want["prompt_tokens"] > PREFILL_STEP
    results = ranks(2, model, "pipeline", *args, timeout=300)
    assert want["prompt_cache"] is True
    for r in results:
        assert result_of(r.stdout)["ids"] == want["ids"], f"rank {r.rank}"
        # Pipeline ranks hold other layers and could decide an entry apart: no prompt cache.
        assert result_of(r.stdout)["prompt_cache"] is False, f"rank {r.rank}"

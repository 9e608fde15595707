"""The bench's sides refuse a prompt id past the model's embedding rows (the generation loop they
call reads out of bounds there, and the timing and tokens would be garbage); the probes' fixed
prompt folds into a small vocabulary and keeps its ids for real ones."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import compare_mlx_lm  # noqa: E402

from pymlxc.testing import write_tiny_model  # noqa: E402


@given(n=st.integers(0, 3000), vocab=st.integers(11, 200_000))
def test_the_probe_prompt_stays_inside_the_vocabulary(n: int, vocab: int) -> None:
    prompt = compare_mlx_lm.probe_prompt(n, vocab)
    assert len(prompt) == n and all(10 <= t < vocab for t in prompt)
    if vocab >= 1010:  # a real model's vocabulary: the ids the probes always used
        assert prompt == [(7 * i) % 1000 + 10 for i in range(n)]


def test_a_vocabulary_too_small_for_a_probe_prompt_is_refused() -> None:
    with pytest.raises(ValueError, match="too small"):
        compare_mlx_lm.probe_prompt(4, 10)


def test_the_pymlxc_side_refuses_an_id_past_the_embedding(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "tiny", hidden_size=64, num_layers=1, vocab_size=512)
    side = compare_mlx_lm.Pymlxc()
    side.load(model)
    try:
        assert side.vocab == 512
        with pytest.raises(ValueError, match=r"token id 512 \(position 1 of the prompt\) is outside the model's "
                                             "vocabulary of 512"):
            next(iter(side.stream([5, 512, 6], 2)))
        assert len(list(side.stream([5, 511, 6], 2))) == 2
    finally:
        side.free()

"""The continuous batch's compiled step (`decode/batch_step.py`, `PYMLXC_BATCH_COMPILE`, on
here) on the architectures whose layers differ from the Llama family's: sliding windows that
cut in during the generation (Gemma 3's window of 16), experts (Qwen 3 MoE), Gemma 4, and Gated
DeltaNet layers beside attention (Qwen3-Next, Qwen 3.5: their conv windows and states in and out
of the graph)."""
from __future__ import annotations

from pathlib import Path

import pytest

import pymlxc
from pymlxc import settings
from pymlxc.testing import write_tiny_model

PROMPTS = ["Once upon a time", "The baker counted the coins in her drawer before she locked the door.", "hi"]


@pytest.mark.parametrize("arch", ["gemma3_text", "qwen3_moe", "gemma4_text", "qwen3_next", "qwen3_5"])
def test_compiled_batch_step_matches_single_generations(tmp_path: Path, arch: str) -> None:
    path = write_tiny_model(tmp_path / arch, arch, seed=3,
                            extra_config={"moe_intermediate_size": 64} if arch == "qwen3_next" else None)
    with settings.override(batch_compile="1"), pymlxc.load_model(str(path), backend="metal") as model:
        results = model.batch_generate(PROMPTS, max_tokens=24)
        stats = model._batch_step.stats  # noqa: SLF001 - the step's own counters
        assert stats["compiled"] > 0 and stats["fallback"] == 0
        for result, prompt in zip(results, PROMPTS, strict=True):
            assert [t.id for t in result.tokens] == [t.id for t in model.generate(prompt, max_tokens=24)]


@pytest.mark.parametrize("arch", ["gemma3_text", "llama", "qwen3_5"])
def test_compiled_batch_step_logits_equal_the_op_by_op_step(tmp_path: Path, arch: str) -> None:
    """Step by step, rows of different lengths past Gemma 3's window of 16: the compiled step's logits
    equal those of the step built op by op on the same batch (their tokens alone would not show an
    attention error: a tiny random model repeats one token)."""
    import numpy as np

    import pymlxc.core as mx
    from pymlxc.backends.metal import batching

    path = write_tiny_model(tmp_path / arch, arch, seed=5)
    with settings.override(batch_compile="1"), pymlxc.load_model(str(path), backend="metal") as model:
        lm, step = model.model, model._batch_step  # noqa: SLF001 - the step under test
        batches = []
        for _ in range(2):
            batch = batching.Batch()
            for n, prompt_len in enumerate((3, 21, 9)):
                cache = lm.make_cache(None)
                mx.eval(lm(mx.array([[5 + (n * 7 + i) % 40 for i in range(prompt_len)]], dtype=mx.int32), cache=cache))
                batch.add(object(), cache)
            batches.append(batch)
        compiled, plain = batches
        ids = mx.array([[7], [11], [13]], dtype=mx.int32)
        for _ in range(24):
            a = compiled.logits(lm, ids, step)
            b = plain.logits(lm, ids, None)
            np.testing.assert_allclose(np.array(a.tolist()), np.array(b.tolist()), rtol=1e-4, atol=1e-4)
            ids = mx.expand_dims(mx.argmax(b, axis=-1).astype(mx.int32), 1)
        assert step.stats["compiled"] == 24 and step.stats["fallback"] == 0


def test_a_step_that_cannot_be_traced_is_built_op_by_op_and_not_traced_again(tmp_path: Path, monkeypatch) -> None:
    """A forward that fails to trace: the batch decodes op by op with the same tokens, and that
    structure is tried once, not at every step."""
    from pymlxc.backends.metal.decode import batch_step

    tries = []

    def untraceable(inputs):
        tries.append(1)
        raise RuntimeError("cannot trace this forward")

    monkeypatch.setattr(batch_step, "_trace_batch_step", untraceable)
    path = write_tiny_model(tmp_path / "llama", "llama", seed=3)
    with settings.override(batch_compile="1"), pymlxc.load_model(str(path), backend="metal") as model:
        results = model.batch_generate(PROMPTS, max_tokens=6)
        for result, prompt in zip(results, PROMPTS, strict=True):
            assert [t.id for t in result.tokens] == [t.id for t in model.generate(prompt, max_tokens=6)]
        stats = model._batch_step.stats  # noqa: SLF001 - the step's own counters
        assert stats["compiled"] == 0 and stats["fallback"] > 1
        assert len(tries) == 1

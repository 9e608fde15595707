"""The mlx_lm backend gives what mlx-lm itself gives on the same weights (and, later, the metal backend)."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pymlxc.backends.mlx_lm import MlxLmBackend, MlxLmModel
from pymlxc.options import LoadConfig
from pymlxc.testing import write_tiny_model

mx = pytest.importorskip("mlx.core")
mlx_lm = pytest.importorskip("mlx_lm")
from mlx_lm.sample_utils import (  # noqa: E402
    apply_min_p,
    apply_top_k,
    apply_top_p,
    categorical_sampling,
    make_logits_processors,
)

PROMPTS = ["The baker counted the coins", "héllo wörld 你好 🙂", "x"]


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> tuple[Any, Any]:
    """mlx-lm in this process, on the same directory."""
    return mlx_lm.load(str(tiny_model))


def _mlx_lm_stream(reference: tuple[Any, Any], prompt: Any, max_tokens: int, **kwargs: Any) -> tuple[list[int], str]:
    model, tokenizer = reference
    ids, text = [], ""
    for r in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=max_tokens, **kwargs):
        if r.finish_reason != "stop":
            ids.append(r.token)
        text += r.text
    return ids, text


def _ours(model: MlxLmModel, tokens: Iterator[Any]) -> tuple[list[int], str]:
    out = list(tokens)
    assert model.err() is None, model.err()
    return [t.id for t in out], "".join(t.text for t in out)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_tokens_equal_mlx_lm_in_process(model: MlxLmModel, reference: tuple[Any, Any], prompt: str) -> None:
    ids, text = _ours(model, model.generate(prompt, max_tokens=24))
    assert (ids, text) == _mlx_lm_stream(reference, prompt, 24)
    assert len(ids) == 24


def test_chat_equals_mlx_lm_on_the_chat_template(model: MlxLmModel, reference: tuple[Any, Any]) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    prompt = reference[1].apply_chat_template(messages, add_generation_prompt=True)
    assert _ours(model, model.chat(messages, max_tokens=16)) == _mlx_lm_stream(reference, prompt, 16)


def test_seeded_sampling_equals_mlx_lm_with_the_same_options(model: MlxLmModel, reference: tuple[Any, Any]) -> None:
    options = dict(temperature=0.9, top_k=40, top_p=0.95, min_p=0.02, repeat_penalty=1.3, seed=11)
    ids, _ = _ours(model, model.generate(PROMPTS[0], max_tokens=20, **options))
    mx.random.seed(11)

    # mlx-lm's own filters and penalty in pymlxc's semantics, shared with the metal backend: top-k
    # before top-p (make_sampler applies top-p first), over the last 64 tokens (its default is 20).
    def sampler(logprobs: Any) -> Any:
        logprobs = apply_min_p(apply_top_p(apply_top_k(logprobs, 40), 0.95), 0.02)
        return categorical_sampling(logprobs, 0.9)

    expected, _ = _mlx_lm_stream(
        reference, PROMPTS[0], 20, sampler=sampler,
        logits_processors=make_logits_processors(repetition_penalty=1.3, repetition_context_size=64)
    )
    assert ids == expected
    again, _ = _ours(model, model.generate(PROMPTS[0], max_tokens=20, **options))
    assert again == ids  # the seed makes it repeatable


def test_batch_generate_equals_mlx_lm_batch_generate(model: MlxLmModel, reference: tuple[Any, Any]) -> None:
    results = model.batch_generate(PROMPTS, max_tokens=10)
    assert model.err() is None
    ref_model, tokenizer = reference
    expected = mlx_lm.batch_generate(
        ref_model, tokenizer, [tokenizer.encode(p) for p in PROMPTS], max_tokens=10, return_token_ids=True
    )
    assert [[t.id for t in r.tokens] for r in results] == expected.token_ids
    assert [r.text for r in results] == expected.texts


def test_classify_picks_the_greedy_next_token(model: MlxLmModel, reference: tuple[Any, Any]) -> None:
    results = model.classify(PROMPTS, return_logits=True)
    for prompt, result in zip(PROMPTS, results, strict=True):
        first_ids, _ = _mlx_lm_stream(reference, prompt, 1)
        assert result.token.id == first_ids[0]
        assert result.logits is not None and len(result.logits) == model.info().vocab_size


def test_adapter_path_reaches_mlx_lm(
    backend: MlxLmBackend, tiny_model: Path, tiny_adapter: Path, reference: tuple[Any, Any]
) -> None:
    from pymlxc import registry

    registry.register(backend)
    adapted_ref = mlx_lm.load(str(tiny_model), adapter_path=str(tiny_adapter))
    with registry.load_model(str(tiny_model), backend="mlx_lm", adapter_path=str(tiny_adapter)) as adapted:
        ids, text = _ours(adapted, adapted.generate(PROMPTS[0], max_tokens=16))  # type: ignore[arg-type]
    assert (ids, text) == _mlx_lm_stream(adapted_ref, PROMPTS[0], 16)
    assert ids != _mlx_lm_stream(reference, PROMPTS[0], 16)[0]  # the adapter changed the answer


def test_quantized_model_matches_and_reports_its_bits(backend: MlxLmBackend, tmp_path: Path) -> None:
    path = write_tiny_model(tmp_path / "q4", "llama", seed=3, quantize_bits=4)
    with backend.load(str(path), LoadConfig()) as quantized:
        info = quantized.info()
        ids, text = _ours(quantized, quantized.generate(PROMPTS[0], max_tokens=12))
    assert (info.quant_bits, info.quant_group) == (4, 32)
    assert (ids, text) == _mlx_lm_stream(mlx_lm.load(str(path)), PROMPTS[0], 12)


def test_matches_metal_backend(model: MlxLmModel, tiny_model: Path) -> None:
    import pymlxc

    with pymlxc.load_model(str(tiny_model), backend="metal") as metal:
        for prompt in PROMPTS:
            ours = [t.id for t in model.generate(prompt, max_tokens=16)]
            theirs = [t.id for t in metal.generate(prompt, max_tokens=16)]
            assert ours == theirs, prompt

"""The gated-delta families through the public model: generate on the compiled and the uncompiled
decode (same tokens), chat with thinking on and off, batch_generate in the continuous batch and
classify with left padding (each row as alone), the prompt cache reusing a shared prefix at a kept
recurrent state (warm tokens equal cold ones), its files, and inspect_attention over the attention
layers."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import pymlxc
import pymlxc.core as mx
from pymlxc.backends.metal import generate as loops
from pymlxc.backends.metal.batching import Collector, Request, SamplingParams
from pymlxc.backends.metal.chat_template import render_chat
from pymlxc.backends.metal.decode.decoder import CompiledDecoder
from pymlxc.backends.metal.prompt_cache import PromptCacheError
from pymlxc.backends.metal.recurrent_cache import RecurrentCache
from pymlxc.backends.metal.sample import greedy
from pymlxc.testing import write_tiny_model

ARCHS = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
TEXT = "The baker counted the coins in her drawer before she locked the door, and the river turned dark"


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("qwen3_next_use")
    return {arch: write_tiny_model(root / arch, arch, num_layers=4) for arch in ARCHS}


def ids_of(tokens: Any) -> list[int]:
    return [t.id for t in tokens]


@pytest.mark.parametrize("arch", ARCHS)
def test_compiled_decode_gives_the_uncompiled_tokens(paths: dict[str, Path], arch: str) -> None:
    with pymlxc.load_model(paths[arch]) as model:
        inner = model.model
        prompt = model.encode(TEXT)
        expected = list(loops.generate_ids(inner, prompt, cache=inner.make_cache(None), sampler=greedy,
                                           max_tokens=32))
        decoder = CompiledDecoder(inner)
        got = list(loops.generate_ids(inner, prompt, cache=inner.make_cache(None), sampler=greedy, max_tokens=32,
                                      decoder=decoder))
        assert got == expected
        assert decoder.stats["compiled"] == 1 and decoder.stats["fallback"] == 0
        decoder.close()
        assert ids_of(model.generate(TEXT, max_tokens=32)) == expected


def test_chat_thinking_on_and_off(paths: dict[str, Path]) -> None:
    with pymlxc.load_model(paths["qwen3_5"]) as model:
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        on = render_chat(messages, model.tokenizer, add_generation_prompt=True)
        off = render_chat(messages, model.tokenizer, add_generation_prompt=True, enable_thinking=False)
        assert on.endswith("<|im_start|>assistant\n<think>\n")
        assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
        answer = ids_of(model.chat(messages, max_tokens=12))
        assert answer == ids_of(model.generate(on, max_tokens=12)) and len(answer) == 12


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5_moe"])
def test_rows_of_the_continuous_batch_equal_generating_alone(paths: dict[str, Path], arch: str) -> None:
    """`batch_generate` and the scheduler: prompts prefilled as a left-padded group (the padding
    masked out of the recurrent states), the rows' states side by side in the decode steps, rows
    joining while others decode (a second wave submitted after the first has started) and leaving
    at different lengths; a prompt whose prefix the prompt cache holds is prefilled alone on top of
    it."""
    with pymlxc.load_model(paths[arch]) as model:
        texts = ["A", "Once upon a time", TEXT[:60], "x y z"]
        alone = [ids_of(model.generate(t, max_tokens=n)) for t, n in zip(texts, (16, 5, 12, 9), strict=True)]
        got = model.batch_generate(texts[:2], max_tokens=16)
        assert [[t.id for t in r.tokens] for r in got] == [alone[0], ids_of(model.generate(texts[1], max_tokens=16))]
        scheduler = model.scheduler()
        first = [Collector() for _ in texts[:2]]
        scheduler.submit_all([Request(model.encode(t), SamplingParams(max_tokens=n), c)
                              for t, n, c in zip(texts[:2], (16, 5), first, strict=True)], bounded=False)
        deadline = time.monotonic() + 60
        while not first[0].tokens() and not first[0].finished and time.monotonic() < deadline:
            time.sleep(0.001)
        later = [Collector() for _ in texts[2:]]
        scheduler.submit_all([Request(model.encode(t), SamplingParams(max_tokens=n), c)
                              for t, n, c in zip(texts[2:], (12, 9), later, strict=True)], bounded=False)
        for c in first + later:
            assert c.wait(60)
        assert [c.tokens() for c in first + later] == alone
        assert scheduler.peak_rows >= 2 and scheduler.grouped >= 2
        # A cached prefix (a kept state at its end) with a fresh prompt beside it.
        model.prompt_cache.clear()
        assert model.warm_prompt_cache(TEXT[:40]) > 0
        texts = [TEXT[:40] + " and the rest", "a fresh one"]
        want = [ids_of(model.generate(t, max_tokens=10)) for t in texts]
        model.prompt_cache.clear()
        assert model.warm_prompt_cache(TEXT[:40]) > 0
        grouped = scheduler.grouped
        got = model.batch_generate(texts, max_tokens=10)
        assert [[t.id for t in r.tokens] for r in got] == want
        assert scheduler.grouped == grouped  # the cached row went alone, and the other with it


def test_classify_equals_the_first_generated_token(paths: dict[str, Path]) -> None:
    with pymlxc.load_model(paths["qwen3_5"]) as model:
        prompts = ["Numbers matter", TEXT, "A programmer writes"]
        got = model.classify(prompts, return_logits=True)
        for prompt, result in zip(prompts, got, strict=True):
            first = ids_of(model.generate(prompt, max_tokens=1))
            assert [result.token.id] == first
            assert int(np.argmax(result.logits)) == first[0]


def test_context_len_bounds_the_attention_layers(paths: dict[str, Path]) -> None:
    with pymlxc.load_model(paths["qwen3_next"], context_len=16) as model:
        caches = model.model.make_cache(16)
        assert sum(isinstance(c, RecurrentCache) for c in caches) == 2
        prompt = TEXT[:20]  # fits the context; the generated tokens go past it
        assert model.prompt_length(prompt) <= 16
        tokens = ids_of(model.generate(prompt, max_tokens=24))
        assert len(tokens) == 24


def test_prompt_cache_reuses_a_shared_prefix(paths: dict[str, Path]) -> None:
    """A second prompt that extends the first restores the state kept at the first one's end (the
    last prefill chunk's end), prefills only the rest, and generates the cold tokens."""
    with pymlxc.load_model(paths["qwen3_5_moe"]) as model:
        cold = ids_of(model.generate(TEXT + " again", max_tokens=16))
        model.prompt_cache.clear()
        first = TEXT[:50]
        ids_of(model.generate(first, max_tokens=4))
        n_first = len(model.encode(first))
        warm = ids_of(model.generate(TEXT + " again", max_tokens=16))
        metrics = model.metrics()
        assert warm == cold
        assert metrics.prompt_cache_hits == 1
        # The kept state is the first prompt's end (the generated tokens diverge from the new prompt).
        assert 0 < metrics.prompt_cache_hit_tokens <= n_first


def test_prompt_cache_warm_and_files(paths: dict[str, Path], tmp_path: Path) -> None:
    with pymlxc.load_model(paths["qwen3_next"]) as model:
        system = "You are a careful assistant who answers briefly."
        n = model.warm_prompt_cache(system)
        cold = ids_of(model.generate(system + " " + TEXT, max_tokens=12))  # hit at the warmed prefix
        assert model.metrics().prompt_cache_hit_tokens == n
        saved = model.save_prompt_cache(tmp_path / "cache.safetensors")
        assert saved >= 1
        model.prompt_cache.clear()
    with pymlxc.load_model(paths["qwen3_next"]) as model:
        assert model.load_prompt_cache(tmp_path / "cache.safetensors") == saved
        assert ids_of(model.generate(system + " " + TEXT, max_tokens=12)) == cold
        assert model.metrics().prompt_cache_hits == 1
    with pymlxc.load_model(paths["qwen3_5"]) as other, pytest.raises(PromptCacheError, match="qwen3_next"):
        other.load_prompt_cache(tmp_path / "cache.safetensors")


def test_damaged_recurrent_state_in_a_file_is_refused(paths: dict[str, Path], tmp_path: Path) -> None:
    with pymlxc.load_model(paths["qwen3_next"]) as model:
        model.warm_prompt_cache("Some words from elsewhere")
        path = tmp_path / "c.safetensors"
        model.save_prompt_cache(path)
        arrays, metadata = mx.load_safetensors(str(path))
        arrays["0.0.values"] = arrays["0.0.values"][..., :2]  # layer 0 is linear: its states, cut
        mx.save_safetensors(str(path), arrays, metadata)
        with pytest.raises(PromptCacheError, match=r"entry 0 layer 0: the state has shape"):
            model.load_prompt_cache(path)


def test_inspect_attention_reports_the_attention_layers(paths: dict[str, Path]) -> None:
    with pymlxc.load_model(paths["qwen3_5"]) as model:
        snap = model.inspect_attention(TEXT[:40], include_queries=True)
        n = len(model.encode(TEXT[:40]))
        assert snap.num_layers == 2  # layers 1 and 3 of 4
        assert snap.seq_len == n and snap.head_dim == 16 and snap.num_kv_heads == 2
        assert len(snap.keys[0]) == 2 and snap.keys[0][0].shape == (n, 16)
        assert snap.queries is not None and len(snap.queries[0]) == 4

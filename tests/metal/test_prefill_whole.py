"""A fresh prompt of a length seen before, prefilled as one fixed-shape trace
(`decode/prefill.py`, `WholePrompts`).

Its caches equal the model forward's bit for bit (every Llama-family architecture, dense and
quantized, mixed bit widths); a length is traced on its second prefill, not its first; prompts into
caches that already hold tokens, and longer chunks, keep the segments; a trace that fails leaves the
caches as they were and the segments take over; the traces kept are bounded, and `close()` drops
them; generations that use it give the uncompiled loop's tokens.
"""
from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pymlxc.core as mx
from pymlxc.backends.metal import generate as loops
from pymlxc.backends.metal.decode import prefill
from pymlxc.backends.metal.decode.decoder import CompiledDecoder
from pymlxc.backends.metal.loader import LoadedModel, load_weights_and_config
from pymlxc.backends.metal.sample import greedy
from pymlxc.testing import write_tiny_model

_loaded: dict[Any, LoadedModel] = {}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("whole")

    def get(arch: str, bits: int | None = None) -> LoadedModel:
        if (arch, bits) not in _loaded:
            path = write_tiny_model(root / f"{arch}-{bits}", arch, quantize_bits=bits, num_layers=3)
            _loaded[(arch, bits)] = load_weights_and_config(path)
        return _loaded[(arch, bits)]

    yield get
    for m in _loaded.values():
        m.free()
    _loaded.clear()


def ids(n: int, seed: int = 1) -> list[int]:
    return [int(i) for i in np.random.default_rng(seed).integers(16, 500, size=n)]


def runner_of(decoder: CompiledDecoder) -> prefill.PrefillRunner:
    decoder.prefill_runner(True)  # the first plan fuses the projections, which changes the arrays once
    runner = decoder.prefill_runner(True)
    assert runner is not None
    return runner


class Paths:
    """Counts which path each runner call took: the segments (`_run`) or the whole trace."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[str] = []
        real_run, real_whole = prefill.PrefillRunner._run, prefill.WholePrompts.run
        monkeypatch.setattr(prefill.PrefillRunner, "_run",
                            lambda runner, *a: self.calls.append("segments") or real_run(runner, *a))
        monkeypatch.setattr(prefill.WholePrompts, "run",
                            lambda whole, *a: self.calls.append("whole") or real_whole(whole, *a))


def assert_caches_equal(ours: list[Any], theirs: list[Any]) -> None:
    assert [c.offset for c in ours] == [c.offset for c in theirs]
    for c, d in zip(ours, theirs, strict=True):
        for a, b in zip(c.state, d.state, strict=True):
            assert a.shape == b.shape  # the buffers too (zeros past the prompt), not only the filled part
            np.testing.assert_array_equal(np.asarray(a.astype(mx.float32)), np.asarray(b.astype(mx.float32)))


def prefill_both(runner: Any, model: Any, tokens: Any, on_layer: Any = None) -> tuple[Any, list[Any]]:
    """The runner's last hidden state, with its caches checked against the model forward's."""
    ours, theirs = model.make_cache(None), model.make_cache(None)
    h = runner(tokens, ours, on_layer)
    model(tokens, cache=theirs)
    assert_caches_equal(ours, theirs)
    return h, ours


@pytest.mark.parametrize("bits", [None, 4])
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_the_second_prefill_of_a_length_is_one_trace_and_fills_as_the_forward(
        models, monkeypatch: pytest.MonkeyPatch, arch: str, bits: int | None) -> None:
    model = models(arch, bits).model
    decoder = CompiledDecoder(model, "segmented")
    runner = runner_of(decoder)
    paths = Paths(monkeypatch)
    tokens = mx.array([ids(33)], dtype=mx.int32)
    first, _ = prefill_both(runner, model, tokens)
    layers: list[Any] = []
    again, cache = prefill_both(runner, model, tokens, lambda h, c: layers.append(c))
    prefill_both(runner, model, mx.array([ids(33, seed=5)], dtype=mx.int32))  # another prompt, same length
    assert paths.calls == ["segments", "whole", "whole"]
    assert layers == [cache[-1]]  # one graph, handed over once
    # The last position's hidden state, as the segments give it.
    np.testing.assert_array_equal(np.asarray(first.astype(mx.float32)), np.asarray(again.astype(mx.float32)))
    decoder.close()


def test_only_fresh_short_chunks_take_it(models, monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk into caches that hold tokens (a prompt's second chunk, a prompt-cache hit), a chunk
    of more than WHOLE_PROMPT_ROWS rows and a single token keep the segments, seen before or not."""
    model = models("llama").model
    decoder = CompiledDecoder(model, "segmented")
    runner = runner_of(decoder)
    monkeypatch.setattr(prefill, "WHOLE_PROMPT_ROWS", 20)
    paths = Paths(monkeypatch)
    tokens = mx.array([ids(40)], dtype=mx.int32)
    for _ in range(2):
        ours, theirs = model.make_cache(None), model.make_cache(None)
        for start, stop in ((0, 12), (12, 24), (24, 40)):
            runner(tokens[:, start:stop], ours)
            model(tokens[:, start:stop], cache=theirs)
        assert_caches_equal(ours, theirs)
    assert paths.calls == ["segments"] * 3 + ["whole", "segments", "segments"]
    paths.calls.clear()
    for _ in range(2):
        prefill_both(runner, model, tokens[:, :21])  # 21 rows: over the bound
    assert paths.calls == ["segments", "segments"]
    decoder.close()


def test_a_trace_that_fails_hands_back_to_the_segments(models, monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    model = models("qwen3").model
    decoder = CompiledDecoder(model, "segmented")
    runner = runner_of(decoder)
    paths = Paths(monkeypatch)

    def broken(inputs: list[Any]) -> list[Any]:
        raise ValueError("cannot trace this")

    monkeypatch.setattr(prefill, "_trace_whole", broken)
    tokens = mx.array([ids(17)], dtype=mx.int32)
    with caplog.at_level(logging.WARNING, logger=prefill.__name__):
        for _ in range(3):
            prefill_both(runner, model, tokens)  # the failed trace's caches were put back, then the segments ran
    assert paths.calls == ["segments", "whole", "segments", "segments"]  # not tried again
    assert "cannot trace this" in caplog.text
    assert decoder.prefill_runner(True) is runner  # the segments stay
    decoder.close()


def test_the_traces_kept_are_bounded_and_closed(models, monkeypatch: pytest.MonkeyPatch) -> None:
    model = models("llama").model
    decoder = CompiledDecoder(model, "segmented")
    runner = runner_of(decoder)
    monkeypatch.setattr(prefill, "WHOLE_PROMPT_TRACES", 2)
    cleared: list[Any] = []
    real_compile = prefill.mx.compile

    def compile_spy(fn: Any, *a: Any, **k: Any) -> Any:
        compiled = real_compile(fn, *a, **k)
        real_clear = compiled.clear
        compiled.clear = lambda: cleared.append(compiled) or real_clear()  # type: ignore[method-assign]
        return compiled

    monkeypatch.setattr(prefill.mx, "compile", compile_spy)
    whole = runner._whole
    assert whole is not None
    for n in (5, 6, 7):
        for _ in range(2):
            prefill_both(runner, model, mx.array([ids(n)], dtype=mx.int32))
    kept = list(whole._traces.values())
    assert len(kept) == 2 and len(cleared) == 1  # the length 5 trace went first
    prefill_both(runner, model, mx.array([ids(7)], dtype=mx.int32))  # a kept one still serves
    decoder.close()
    assert all(any(fn is c for c in cleared) for fn in kept) and whole._fixed is None and not whole._traces


def test_a_mixed_precision_checkpoint(tmp_path) -> None:
    """6- and 8-bit layers among 4-bit ones and a dense one, in one trace of every layer."""
    from pymlxc.testing import shapes

    mix = {f"model.layers.{i}.{m}": 6 for i in (0, 2) for m in ("self_attn.v_proj", "mlp.down_proj")}
    mix["model.layers.1.self_attn.o_proj"] = 8
    mix["model.layers.3.mlp.up_proj"] = 0
    path = shapes.write_random_model(tmp_path / "mix", "llama-3.2-1b-narrow", bits=4, layers=4, module_bits=mix)
    with load_weights_and_config(path) as loaded:
        decoder = CompiledDecoder(loaded.model, "segmented")
        runner = runner_of(decoder)
        tokens = mx.array([ids(19, seed=4)], dtype=mx.int32)
        for _ in range(2):
            prefill_both(runner, loaded.model, tokens)
        assert runner._whole is not None and runner._whole._traces
        decoder.close()


@settings(max_examples=8, deadline=None)
@given(length=st.integers(2, 48), batch=st.integers(1, 3), arch=st.sampled_from(["llama", "qwen3"]))
def test_any_fresh_length_fills_as_the_forward(models, length: int, batch: int, arch: str) -> None:
    model = models(arch, 4).model
    decoder = CompiledDecoder(model, "segmented")
    runner = runner_of(decoder)
    tokens = mx.array([ids(length, seed=length + r) for r in range(batch)], dtype=mx.int32)
    for _ in range(2):
        prefill_both(runner, model, tokens)
    decoder.close()


def test_generations_use_it_and_keep_their_tokens(models, monkeypatch: pytest.MonkeyPatch, switches) -> None:
    switches(decode="segmented")
    model = models("llama", 4).model
    decoder = CompiledDecoder(model)
    paths = Paths(monkeypatch)
    for seed in (1, 2, 3):
        prompt = ids(24, seed=seed)
        want = list(loops.generate_ids(model, prompt, cache=model.make_cache(None), max_tokens=12, sampler=greedy))
        got = list(loops.generate_ids(model, prompt, cache=model.make_cache(None), max_tokens=12, sampler=greedy,
                                      decoder=decoder))
        assert got == want
    # The first generation's plan fuses the projections (new arrays: a new plan and runner), whose
    # runner knows the length from the decoder.
    assert paths.calls == ["segments", "whole", "whole"]
    decoder.close()

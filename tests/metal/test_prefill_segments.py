"""Prefill through shapeless compiled segments (backends/metal/decode/prefill.py).

The caches it fills equal the model forward's, bit for bit (on CUDA, with fused dense products, to
float32's rounding), over chunks of changing lengths (one trace serves them all), for every
Llama-family architecture, dense and quantized, with biases;
generations that use it give the uncompiled loop's tokens; a segment that cannot trace leaves the
caches as they were and the prefill goes on with the model's forward.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pymlxc.core as mx
from pymlxc.backends.metal import generate as loops
from pymlxc.backends.metal import nn
from pymlxc.backends.metal.decode import prefill
from pymlxc.backends.metal.decode.decoder import CompiledDecoder
from pymlxc.backends.metal.loader import LoadedModel, load_weights_and_config
from pymlxc.backends.metal.sample import greedy
from pymlxc.settings import Settings
from pymlxc.testing import write_tiny_model

ON_CUDA = mx.cuda_available() and mx.default_device().type == "gpu"

_loaded: dict[Any, LoadedModel] = {}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("prefill")

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


def filled(cache: list[Any]) -> list[np.ndarray]:
    return [np.asarray(a[:, :, :c.offset].astype(mx.float32)) for c in cache for a in (c.keys, c.values)]


def settled_runner(decoder: CompiledDecoder) -> prefill.PrefillRunner:
    """The decoder's runner once its plan is settled: the first plan fuses the projections, which
    changes the model's arrays once."""
    decoder.prefill_runner(True)
    runner = decoder.prefill_runner(True)
    assert runner is not None
    return runner


def check_fills_like_the_forward(runner: Any, model: Any, bounds: list[tuple[int, int]],
                                 on_layer: Any = None) -> list[Any]:
    """Run the chunks `bounds` of one prompt through `runner` and through the model's forward, each
    into caches of its own, and check the caches equal bit for bit; returns the runner's caches."""
    tokens = mx.array([ids(bounds[-1][1])], dtype=mx.int32)
    ours, theirs = model.make_cache(None), model.make_cache(None)
    for start, stop in bounds:
        runner(tokens[:, start:stop], ours, on_layer)
        model(tokens[:, start:stop], cache=theirs)
    assert [c.offset for c in ours] == [c.offset for c in theirs] == [bounds[-1][1]] * len(ours)
    assert_like_the_forward(runner, filled(ours), filled(theirs))
    return list(ours)


def assert_like_the_forward(runner: Any, ours: list[np.ndarray], theirs: list[np.ndarray]) -> None:
    """The runner's cache contents against the model forward's: bit for bit, but on CUDA a fused
    product is one cuBLAS call of the joint width, whose kernel (chosen by the shape) may round
    otherwise than the separate products: its float32 sums differ in their last bits, and where
    one lies near a rounding boundary of the 16-bit type, the stored value differs by one unit of
    it (bfloat16's is 2**-8 of the value: seen on an H200 in one element of 2688). A dequantized
    product is a dense matmul, not MLX's quantized one."""
    fused = ON_CUDA and any(s.joint_heads or s.pair for s in getattr(runner, "specs", ()))
    for a, b in zip(ours, theirs, strict=True):
        if getattr(runner, "dequantized", False):
            np.testing.assert_allclose(a, b, rtol=2e-3, atol=2e-4)
        elif fused:
            np.testing.assert_allclose(a, b, rtol=2.0 ** -7, atol=1e-5)
        else:
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("bits", [None, 4])
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_caches_equal_the_model_forward(models, arch: str, bits: int | None) -> None:
    model = models(arch, bits).model
    decoder = CompiledDecoder(model, "segmented")
    runner = decoder.prefill_runner(True)
    assert runner is not None
    layers_seen: list[Any] = []
    ours = check_fills_like_the_forward(runner, model, [(0, 25), (25, 40), (40, 41), (41, 61)],  # one trace
                                        lambda h, c: layers_seen.append(c))
    assert len(ours) == 3 and layers_seen == ours * 4
    decoder.close()


@pytest.mark.parametrize("bits", [None, 4])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_fused_products_fill_the_caches_as_the_forward(models, arch: str, bits: int | None,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan's fused q/k/v and gate/up products run as one matmul each (joint heads split
    outside the trace, the SiLU product as a reduction over the pair), bit for bit as the model's
    own three and two products; with `fused=False` the separate products give the same caches.
    Quantized fusions take the fused forms where `DENSE_ONLY` is off (by default dense only)."""
    model = models(arch, bits).model
    decoder = CompiledDecoder(model, "segmented",
                              settings=Settings(prefill_fused_products="1", prefill_dequantized="0"))
    settled_runner(decoder)
    default = decoder.prefill_runner(True)
    assert default is not None
    assert [s.joint_heads for s in default.specs] == [bits is None] * 3 + [False]
    decoder.close()
    monkeypatch.setattr(prefill, "DENSE_ONLY", False)
    decoder = CompiledDecoder(model, "segmented", settings=Settings(prefill_fused_products="1"))
    runner = settled_runner(decoder)
    specs = runner.specs
    assert [s.joint_heads for s in specs] == [True] * 3 + [False]
    assert [s.pair for s in specs] == [False] + [True] * 3
    fused = check_fills_like_the_forward(runner, model, [(0, 17), (17, 40)])
    calls = []
    real = prefill.SiluPair.silu_product
    decoder.prefill_fused_products = False
    try:
        separate = decoder.prefill_runner(True)
        assert separate is not None and separate is not runner
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(prefill.SiluPair, "silu_product", lambda self, x: calls.append(x) or real(self, x))
            check_fills_like_the_forward(separate, model, [(0, 17), (17, 40)])
    finally:
        decoder.close()
    assert calls == []  # the separate products' traces never made the pair
    assert len(fused) == 3


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_dequantized_products_fill_the_caches_as_the_forward(models, arch: str, monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    """With `prefill_dequantized` the quantized products run as a dequantization and a dense matmul
    each, the fused q/k/v and gate/up ones as one each: the caches as the model's forward fills them
    to float32's rounding; with it off MLX's quantized products run."""
    model = models(arch, 4).model
    calls: list[tuple[int, ...]] = []
    real = nn.dequantized_product
    monkeypatch.setattr(nn, "dequantized_product", lambda x, *a: calls.append(tuple(x.shape)) or real(x, *a))
    decoder = CompiledDecoder(model, "segmented",  # the dequantization inside the trace (on CUDA the
                              # kernel's, before it, is the default: the test after this one)
                              settings=Settings(prefill_fused_products="1", prefill_dequantized="1",
                                                prefill_dequantize_kernel="0"))
    try:
        runner = settled_runner(decoder)
        assert runner.dequantized and runner.dense_block_bytes == nn.dequantized_block_bytes(model) > 0
        assert [s.joint_heads for s in runner.specs] == [True] * 3 + [False]
        assert [s.pair for s in runner.specs] == [False] + [True] * 3
        check_fills_like_the_forward(runner, model, [(0, 17), (17, 40)])
        # Each trace once (it serves both chunks, and the middle blocks alike): the first segment's
        # q/k/v, a middle one's o, gate/up, down and the next q/k/v, the last's three on one row.
        assert [shape[-2] for shape in calls] == [17] * 5 + [1] * 3
        calls.clear()
        decoder.prefill_dequantized = False
        plain = decoder.prefill_runner(True)
        assert plain is not None and not plain.dequantized
        check_fills_like_the_forward(plain, model, [(0, 17), (17, 40)])
        assert calls == []
    finally:
        decoder.close()


@pytest.mark.parametrize(("arch", "fused"), [("llama", "1"), ("llama", "0"), ("qwen2", "1"), ("qwen3", "1")])
def test_weights_dequantized_before_the_trace_fill_the_caches_as_the_forward(models, arch: str, fused: str,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """With `prefill_dequantize_kernel` every quantized product of a Llama block takes a weight
    dequantized before its segment (kernel_choice.dequantized_weights: one per product of the
    segments' traces, the fused ones with `prefill_fused_products`, in one call a segment) and none
    dequantizes inside the trace; the caches fill as the model's forward fills them. Switched off
    on the decoder, a runner of its own dequantizes inside the trace."""
    model = models(arch, 4).model
    outside: list[tuple[int, ...]] = []
    inside: list[tuple[int, ...]] = []
    calls: list[int] = []
    real_outside, real_inside = prefill.dequantized_weights, nn.dequantized_product

    def counted(weights: list[tuple], kernels: list[bool]) -> list:
        calls.append(len(weights))
        outside.extend(tuple(w[0].shape) for w in weights)
        return real_outside(weights, kernels)

    monkeypatch.setattr(prefill, "dequantized_weights", counted)
    monkeypatch.setattr(nn, "dequantized_product", lambda x, *a: inside.append(tuple(x.shape)) or real_inside(x, *a))
    decoder = CompiledDecoder(model, "segmented", settings=Settings(
        prefill_fused_products=fused, prefill_dequantized="1", prefill_dequantize_kernel="1"))
    try:
        runner = settled_runner(decoder)
        assert runner.dequantized
        n = len(model.layers)
        per_block = 4 if fused == "1" else 7  # q/k/v, o, gate/up, down; or each of the seven
        assert sum(len(spec.weight_places) for spec in runner.specs) == per_block * n
        check_fills_like_the_forward(runner, model, [(0, 17), (17, 40)])
        assert inside == []
        assert len(outside) == 2 * per_block * n  # every product's weight, once a chunk
        assert len(calls) == 2 * len(runner.specs) and all(calls)  # one call a segment and chunk
        outside.clear()
        decoder.prefill_dequantize_kernel = False
        plain = decoder.prefill_runner(True)
        assert plain is not None and plain is not runner and plain.dequantized
        assert all(spec.weight_places == () for spec in plain.specs)
        check_fills_like_the_forward(plain, model, [(0, 17), (17, 40)])
        assert outside == [] and inside != []
    finally:
        decoder.close()


def test_dequantized_products_by_default_for_large_blocks_on_cuda(models, monkeypatch: pytest.MonkeyPatch) -> None:
    """`auto` dequantizes on CUDA where the quantized blocks hold nn.DEQUANTIZED_MIN_BLOCK_BYTES or
    more (the tiny model's do not), `1` at any size, `0` never."""
    model = models("llama", 4).model
    for threshold, setting, want in ((nn.DEQUANTIZED_MIN_BLOCK_BYTES, "auto", False), (1, "auto", ON_CUDA),
                                     (1, "0", False), (nn.DEQUANTIZED_MIN_BLOCK_BYTES, "1", True)):
        monkeypatch.setattr(nn, "DEQUANTIZED_MIN_BLOCK_BYTES", threshold)
        decoder = CompiledDecoder(model, "segmented", settings=Settings(prefill_dequantized=setting))
        try:
            assert settled_runner(decoder).dequantized is want, (threshold, setting)
            if setting == "auto":  # as on CUDA: the blocks' size decides
                decoder.prefill_dequantized = True
                runner = decoder.prefill_runner(True)
                assert runner is not None and runner.dequantized is (threshold == 1)
        finally:
            decoder.close()


def test_fused_products_by_default_on_cuda_only(models) -> None:
    """`auto` takes the fused products on CUDA only (on a CPU they measured no faster)."""
    model = models("llama").model
    for setting, want in (("auto", ON_CUDA), ("0", False), ("1", True)):
        decoder = CompiledDecoder(model, "segmented", settings=Settings(prefill_fused_products=setting))
        try:
            settled_runner(decoder)
            runner = decoder.prefill_runner(True)
            assert runner is not None and runner.specs[0].joint_heads is want
        finally:
            decoder.close()


def test_generations_use_it_and_keep_their_tokens(models, monkeypatch: pytest.MonkeyPatch, switches) -> None:
    switches(decode="segmented")
    model = models("llama").model
    decoder = CompiledDecoder(model)
    calls = []
    real = prefill.PrefillRunner.__call__
    monkeypatch.setattr(prefill.PrefillRunner, "__call__",
                        lambda self, *a, **k: calls.append(a[0].shape) or real(self, *a, **k))
    for n in (30, 9, 300):
        prompt = ids(n, seed=n)
        want = list(loops.generate_ids(model, prompt, cache=model.make_cache(None), max_tokens=12, sampler=greedy))
        got = list(loops.generate_ids(model, prompt, cache=model.make_cache(None), max_tokens=12, sampler=greedy,
                                      decoder=decoder, prefill_step=128))
        assert got == want
    assert calls == [(1, 30), (1, 9), (1, 128), (1, 128), (1, 44)]  # the whole prompts, in chunks of prefill_step


def test_a_segment_that_cannot_trace_hands_back_to_the_model(models, monkeypatch: pytest.MonkeyPatch) -> None:
    model = models("qwen3").model
    decoder = CompiledDecoder(model, "segmented")
    prompt = ids(20)
    want = list(loops.generate_ids(model, prompt, cache=model.make_cache(None), max_tokens=8, sampler=greedy))

    def broken(inputs: list[Any]) -> list[Any]:
        raise ValueError("cannot trace this")

    monkeypatch.setattr(prefill, "_trace_mid", broken)
    got = list(loops.generate_ids(model, prompt, cache=model.make_cache(None), max_tokens=8, sampler=greedy,
                                  decoder=decoder))
    assert got == want  # the first layer's cache update was undone, then the model's forward ran
    assert decoder.prefill_runner(True) is None  # remembered: not tried again
    assert decoder.stats["compiled"] == 1  # the decode itself stayed compiled


def test_only_for_the_segmented_decode(models) -> None:
    assert CompiledDecoder(models("llama").model, "graph").prefill_runner(True) is None
    assert CompiledDecoder(models("gemma3_text").model, "segmented").prefill_runner(True) is None


def test_a_mixed_precision_checkpoint(tmp_path, switches) -> None:
    """Blocks whose layers differ in bit width (a 6-bit value and down projection among 4-bit ones,
    as mlx-lm's mixed recipes make them, and a dense one) do not share a trace: the shapeless trace
    of one block's segment would take the other's packed weights as its own (wrong values on a CPU, an illegal
    memory access on a GPU). The caches equal the model forward's bit for bit, and a generation
    gives the uncompiled loop's tokens."""
    from pymlxc.testing import shapes

    mix = {f"model.layers.{i}.{m}": 6 for i in (0, 2) for m in ("self_attn.v_proj", "mlp.down_proj")}
    mix["model.layers.3.mlp.up_proj"] = 0  # left dense, as mlx-lm's predicates leave some layers
    path = shapes.write_random_model(tmp_path / "mix", "llama-3.2-1b-narrow", bits=4, layers=4, module_bits=mix)
    with load_weights_and_config(path) as loaded:
        model = loaded.model
        assert model.layers[0].self_attn.v_proj.bits == 6 and model.layers[1].self_attn.v_proj.bits == 4
        assert type(model.layers[3].mlp.up_proj).__name__ == "Linear"
        decoder = CompiledDecoder(model, "segmented")
        check_fills_like_the_forward(settled_runner(decoder), model, [(0, 17), (17, 30)])
        switches(decode="segmented")
        prompt = ids(40, seed=3)
        want = list(loops.generate_ids(model, prompt, cache=model.make_cache(None), max_tokens=10, sampler=greedy))
        got = list(loops.generate_ids(model, prompt, cache=model.make_cache(None), max_tokens=10, sampler=greedy,
                                      decoder=decoder))
        assert got == want
        decoder.close()


def test_a_prompt_longer_than_the_context(models) -> None:
    """A rotating cache (a context shorter than the prompt): the mask is made before the cache takes
    the chunk, as the model's forward makes it. Made after, it no longer fit the keys: the runner
    failed with MLX's broadcast error and the decoder left the compiled prefill for good."""
    model = models("llama").model
    decoder = CompiledDecoder(model, "segmented")
    runner = settled_runner(decoder)
    tokens = mx.array([ids(40)], dtype=mx.int32)
    for bounds in ([(0, 40)], [(0, 12), (12, 40)]):
        ours, theirs = model.make_cache(16), model.make_cache(16)
        for start, stop in bounds:
            runner(tokens[:, start:stop], ours)
            model(tokens[:, start:stop], cache=theirs)
        assert_like_the_forward(runner, [np.asarray(x.astype(mx.float32)) for c in ours for x in c.state],
                                [np.asarray(x.astype(mx.float32)) for c in theirs for x in c.state])
    assert decoder.prefill_runner(True) is runner  # not marked failed
    decoder.close()


_PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


@settings(max_examples=10, deadline=None)
@given(widths=st.lists(st.sampled_from([0, 4, 6, 8]), min_size=3 * len(_PROJECTIONS),
                       max_size=3 * len(_PROJECTIONS)))
def test_any_mix_of_bit_widths_fills_the_caches_as_the_forward(tmp_path_factory, widths: list[int]) -> None:
    """Whatever bit width each projection of each block has (4, 6 or 8, group 64, or dense: 0, as
    mlx-lm's quantization predicates leave some layers), the compiled prefill's caches equal the
    model forward's bit for bit over two chunks."""
    from pymlxc.testing import shapes

    bits = {f"model.layers.{i // len(_PROJECTIONS)}.{_PROJECTIONS[i % len(_PROJECTIONS)]}": b
            for i, b in enumerate(widths) if b != 4}
    root = tmp_path_factory.mktemp("mix")
    path = shapes.write_random_model(root, "llama-3.2-1b-narrow", bits=4, layers=3, module_bits=bits)
    with load_weights_and_config(path) as loaded:
        model = loaded.model
        decoder = CompiledDecoder(model, "segmented")
        check_fills_like_the_forward(settled_runner(decoder), model, [(0, 13), (13, 21)])
        decoder.close()


def test_one_runner_per_plan(models) -> None:
    """The decoder keeps a plan's runner (its specs walk the modules once), and makes a new one with
    a new plan: here after a weight is replaced, which the old plan's fixed arrays would not see
    (the new runner's caches equal the model forward's with the new weight)."""
    model = models("llama").model
    decoder = CompiledDecoder(model, "segmented")
    first = settled_runner(decoder)
    assert decoder.prefill_runner(True) is first
    layer = model.layers[1].mlp.up_proj
    old = layer.weight
    layer.weight = old * 2
    try:
        again = settled_runner(decoder)  # a new plan, whose fusion of the new weight changes the arrays again
        assert again is not first and decoder.prefill_runner(True) is again
        check_fills_like_the_forward(again, model, [(0, 9)])
    finally:
        layer.weight = old
    decoder.close()


def test_chunks_from_the_models_dense_rows_skip_the_runner(models, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the model's layers go dense from `dense_rows` rows (which a shapeless trace cannot
    hold), a chunk of that many rows (batch times length) runs the model's forward; a smaller one
    the runner. The smaller of `dense_rows` and `qmm_rows` counts."""
    model = models("llama").model
    monkeypatch.setattr(model, "dense_rows", 4, raising=False)
    monkeypatch.setattr(model, "qmm_rows", 0, raising=False)
    decoder = CompiledDecoder(model, "segmented")
    runner = decoder.prefill_runner(True)
    assert runner is not None
    assert runner.takes(mx.zeros((1, 3), mx.int32)) and not runner.takes(mx.zeros((2, 2), mx.int32))
    seen: list[int] = []
    real = prefill.PrefillRunner.__call__
    monkeypatch.setattr(prefill.PrefillRunner, "__call__",
                        lambda self, chunk, *a: seen.append(chunk.shape[1]) or real(self, chunk, *a))
    forward = loops._chunk_forward(model, None, runner)
    cache = model.make_cache(None)
    for n in (3, 4, 2):
        forward(mx.array([ids(n, seed=n)], dtype=mx.int32), cache, 0, None)
    assert seen == [3, 2] and cache[0].offset == 9
    monkeypatch.setattr(model, "qmm_rows", 3, raising=False)
    runner = decoder.prefill_runner(True)
    assert runner is not None and not runner.takes(mx.zeros((1, 3), mx.int32))
    decoder.close()

"""pymlxc's 4-bit CUDA matrix-vector kernel (backends/metal/kernels/matvec.py) and the choice of
kernel (backends/metal/kernel_choice.py).

Everywhere: the kernel's arithmetic (x rounded to int16 per 32 values, integer products), replayed
in numpy on MLX's own quantized layout, gives the product with the dequantized weights within the
rounding's stated bound; the launch covers every output row and no more blocks than needed;
`configure` marks layers only on CUDA, refuses a bad setting by name, and leaves the model on MLX's
kernel, with a warning, when the kernel cannot run; inside
`mlx_kernels_only()` a marked product runs MLX's kernel (on a machine without CUDA the kernel
itself raises MLXError, so the scope is seen to work).

On CUDA (MLX's CUDA build): the kernel matches a float64 reference as closely as MLX's own
`quantized_matmul` for varied shapes, group sizes and dtypes; models marked to use it give the same
tokens in every decode mode, logits close to MLX's, a compiled prefill that serves short and long
chunks, and LoRA gradients.
"""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pymlxc.core as mx
from pymlxc.backends.metal import generate as loops
from pymlxc.backends.metal import kernel_choice, nn, training
from pymlxc.backends.metal.decode.decoder import CompiledDecoder
from pymlxc.backends.metal.kernels import matvec as cuda_matvec
from pymlxc.backends.metal.loader import load_weights_and_config
from pymlxc.backends.metal.nn import choose_cuda_matvec
from pymlxc.backends.metal.sample import greedy
from pymlxc.testing import write_tiny_model

from .cuda_decode_helpers import int16_rounding

ON_CUDA = mx.cuda_available()
cuda_only = pytest.mark.skipif(not ON_CUDA, reason="the kernel needs MLX's CUDA build (run on the GPU machine)")


def _quantized(rng: np.random.Generator, n: int, k: int, group: int, dtype: Any) -> tuple[Any, Any, Any, np.ndarray]:
    dense = mx.array((rng.standard_normal((n, k)) * 0.05).astype(np.float32)).astype(dtype)
    w, s, b = mx.quantize(dense, group, 4)
    deq = np.asarray(mx.dequantize(w, s, b, group, 4).astype(mx.float32), dtype=np.float64)
    return w, s, b, deq


def _replay(x: np.ndarray, w: np.ndarray, s: np.ndarray, b: np.ndarray, group: int) -> np.ndarray:
    """The kernel's arithmetic in numpy: per 32-weight chunk, x rounded to int16 (xi = rint(x * 32767
    / max |x|), one rounding as the kernel's FMA gives it), the integer sum of xi * q, then
    scale * d * that + bias * sum x in float32 (d = max |x| / 32767)."""
    m, k = x.shape
    n = w.shape[0]
    words = w.reshape(n, k // 8).astype(np.uint64)
    codes = np.stack([(words >> (4 * i)) & 0xF for i in range(8)], axis=-1).reshape(n, k // 32, 32).astype(np.int64)
    chunk_group = (np.arange(k // 32) * 32) // group
    sc, bi = s[:, chunk_group].astype(np.float32), b[:, chunk_group].astype(np.float32)
    xc = x.astype(np.float32).reshape(m, k // 32, 32)
    xi, d = int16_rounding(xc)
    d = d[..., 0]
    dots = np.einsum("mcj,ncj->mnc", xi, codes).astype(np.float32)
    xs = xc.sum(-1, dtype=np.float32)[:, None, :]
    return (sc[None] * d[:, None, :] * dots + bi[None] * xs).sum(-1, dtype=np.float32)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(m=st.integers(1, 8), chunks=st.integers(1, 40), n=st.integers(1, 70), group=st.sampled_from([32, 64, 128]),
       seed=st.integers(0, 2**16), spread=st.sampled_from([0.0, 3.0]))
def test_the_kernel_arithmetic_gives_the_dequantized_product(m: int, chunks: int, n: int, group: int,
                                                              seed: int, spread: float) -> None:
    k = ((chunks * 32 + group - 1) // group) * group
    rng = np.random.default_rng(seed)
    w, s, b, deq = _quantized(rng, n, k, group, mx.float32)
    # spread: activations of very different sizes within a chunk (outlier features), where rounding
    # to int16 against the chunk's largest value loses the most
    x = (rng.standard_normal((m, k)) * np.exp(spread * rng.standard_normal((m, k)))).astype(np.float32)
    got = _replay(x, np.asarray(w), np.asarray(s), np.asarray(b), group)
    want = x.astype(np.float64) @ deq.T
    # Rounding x to int16 moves each value by at most half a step, max |x| of its chunk / 65534, in
    # the scale * q part of each weight only (the bias multiplies the float sum of x); the float32
    # sums add 1e-5 of the terms' magnitude, sum |x| (|scale q| + |bias|) (a dot product's error bound:
    # one nearly cancelling output is otherwise held to a tolerance float32 sums cannot meet).
    step = np.repeat(np.abs(x.reshape(m, k // 32, 32)).max(-1) / 65534, 32, axis=-1).astype(np.float64)
    bias = np.repeat(np.asarray(b, np.float64), group, axis=1)
    scaled = np.abs(deq - bias)
    rounding = step @ scaled.T
    bound = float((np.abs(x).astype(np.float64) @ (scaled + np.abs(bias)).T).max())
    assert np.all(np.abs(got - want) <= 1.001 * rounding + 1e-5 * bound)


@given(n=st.integers(1, 200_000), k=st.sampled_from([64, 1024, 2048, 2080, 4096, 14336]), m=st.integers(1, 8),
       norm=st.booleans())
def test_the_launch_covers_every_row_once(n: int, k: int, m: int, norm: bool) -> None:
    geo = cuda_matvec.launch(m, k, n, mx.bfloat16, 64, norm=(128, 1, 0) if norm else None)
    template = dict(geo["template"])
    assert geo["threadgroup"] == (cuda_matvec.THREADS_PER_BLOCK, 1, 1) and geo["grid"][1:] == (1, 1)
    blocks, rem = divmod(geo["grid"][0], cuda_matvec.THREADS_PER_BLOCK)
    assert rem == 0
    # a block's units: its row groups (two where K has at most 64 chunks) times U, each unit 2 rows
    groups = 2 if k // 32 <= 64 else 1
    assert cuda_matvec.row_groups(k) == template["S"] == groups
    per_block = groups * template["U"]
    assert per_block == cuda_matvec.units_per_block(k, norm) and per_block * 32 <= cuda_matvec.THREADS_PER_BLOCK
    units = -(-n // 2)
    assert blocks * per_block >= units > (blocks - 1) * per_block
    assert template["KC"] == k // 32 and template["M"] == m and template["G"] == 64 and not template["PAIR"]
    assert ("D" in template) == norm
    # The paired gate/up form: a unit per hidden unit (rows j and j + n / 2).
    paired = cuda_matvec.launch(m, k, 2 * n, mx.bfloat16, 64, pair=True)
    assert dict(paired["template"])["PAIR"]
    per_block = cuda_matvec.units_per_block(k)
    assert paired["grid"][0] // cuda_matvec.THREADS_PER_BLOCK == -(-n // per_block)


def test_what_the_kernel_applies_to() -> None:
    q = cuda_matvec.quantized_applies
    assert q(1, 4096, 4, 64, 2) and q(8, 64, 4, 32, 2)
    assert not q(9, 4096, 4, 64, 2)  # prefill rows: MLX's tensor-core kernels
    assert not q(0, 4096, 4, 64, 2)
    assert not q(1, 4096, 8, 64, 2)  # 8-bit
    assert not q(1, 4096, 4, 16, 2)  # a group size MLX does not make
    assert not q(1, 4096, 4, 64, 4)  # float32 x
    assert not q(1, 48, 4, 16, 2)  # K not a multiple of 32


@pytest.fixture
def tiny(tmp_path: Path):
    opened = []

    def load(arch: str = "qwen3", bits: int | None = 4):
        path = write_tiny_model(tmp_path / f"{arch}-{bits}", arch, quantize_bits=bits, num_layers=2, dtype="float16")
        loaded = load_weights_and_config(path)
        opened.append(loaded)
        return loaded

    yield load
    for m in opened:
        m.free()


def _quantized_layers(model: Any) -> list[Any]:
    return [m for _, m in model.named_modules() if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))]


def test_configure_marks_layers_only_on_cuda(tiny, monkeypatch: pytest.MonkeyPatch, switches: Any) -> None:
    loaded = tiny()
    layers = _quantized_layers(loaded.model)
    assert len(layers) == 2 * 7 + 1  # seven linears per block, the tied embedding
    assert choose_cuda_matvec(loaded.model, "1") is ON_CUDA
    assert [m.cuda_matvec for m in layers] == [ON_CUDA] * len(layers)
    assert choose_cuda_matvec(loaded.model, "auto") is False  # a tiny model is far below the size where it pays
    assert not any(m.cuda_matvec for m in layers)
    with pytest.raises(ValueError, match="cuda_matvec setting"):
        choose_cuda_matvec(loaded.model, "fast")
    with pytest.raises(ValueError, match="PYMLXC_CUDA_MATVEC"):
        switches.env("PYMLXC_CUDA_MATVEC", "fast")


def test_a_kernel_that_cannot_run_leaves_the_model_on_mlx(tiny, monkeypatch: pytest.MonkeyPatch, switches: Any) -> None:
    loaded = tiny()
    layers = _quantized_layers(loaded.model)

    def broken() -> Any:
        raise mx.MLXError("nvrtc: error: no such architecture")

    switches.env("PYMLXC_CUDA_MATVEC", "1")
    monkeypatch.setattr(kernel_choice.mx, "cuda_available", lambda: True)  # as on a CUDA machine
    monkeypatch.setattr(kernel_choice.mx, "default_device", lambda: mx.Device("gpu", 0))
    monkeypatch.setattr(kernel_choice, "_the_kernel", broken)
    with pytest.warns(RuntimeWarning, match="no such architecture"):
        assert choose_cuda_matvec(loaded.model, "1") is False
    assert not any(m.cuda_matvec for m in layers)


def test_mlx_kernels_only_holds_on_its_thread() -> None:
    rng = np.random.default_rng(0)
    w, s, b, deq = _quantized(rng, 40, 128, 64, mx.bfloat16)
    x = mx.array(rng.standard_normal((1, 128)).astype(np.float32)).astype(mx.bfloat16)
    want = np.asarray(x.astype(mx.float32), np.float64) @ deq.T

    def product() -> np.ndarray:
        return np.asarray(kernel_choice.quantized_matmul(x, w, s, b, 64, 4, cuda_matvec=True).astype(mx.float32))

    seen: list[Any] = []
    with kernel_choice.mlx_kernels_only():
        np.testing.assert_allclose(product(), want, rtol=2e-2, atol=2e-2 * np.abs(want).max())
        other = threading.Thread(target=lambda: seen.append(_outcome(product)))
        other.start()
        other.join()
    # Outside the scope (and on the other thread) the CUDA kernel runs: without CUDA it cannot.
    for outcome in (seen[0], _outcome(product)):
        if ON_CUDA:
            np.testing.assert_allclose(outcome, want, rtol=2e-2, atol=2e-2 * np.abs(want).max())
        else:
            assert isinstance(outcome, mx.MLXError) and "CUDA" in str(outcome)


def test_shapes_that_do_not_fit_get_mlx_s_error() -> None:
    """The kernel sizes its reads by the weight; a mismatched x must not reach it (it would read
    past the rows), but MLX's check, which names the shapes."""
    w, s, b = mx.quantize(mx.zeros((16, 128), mx.float16), 64, 4)
    with pytest.raises(mx.MLXError, match=r"Last dimension of first input with shape \(\.\.\., 64\)"):
        mx.eval(kernel_choice.quantized_matmul(mx.zeros((1, 64), mx.float16), w, s, b, 64, 4, cuda_matvec=True))


def _outcome(fn: Any) -> Any:
    try:
        return fn()
    except mx.MLXError as exc:
        return exc


# ---------------------------------------------------------------------- on CUDA

@cuda_only
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(m=st.integers(1, 8), chunks=st.integers(1, 300), n=st.integers(1, 700), group=st.sampled_from([32, 64, 128]),
       dtype=st.sampled_from(["bfloat16", "float16"]), seed=st.integers(0, 2**16))
def test_the_kernel_is_as_close_to_float64_as_mlx(m: int, chunks: int, n: int, group: int, dtype: str,
                                                   seed: int) -> None:
    k = ((chunks * 32 + group - 1) // group) * group
    rng = np.random.default_rng(seed)
    w, s, b, deq = _quantized(rng, n, k, group, getattr(mx, dtype))
    x = mx.array(rng.standard_normal((m, k)).astype(np.float32)).astype(getattr(mx, dtype))
    xf = np.asarray(x.astype(mx.float32), np.float64)
    want = xf @ deq.T
    # Errors relative to the terms' magnitude, sum |x| |w| (a dot product's error bound): a single
    # output that nearly cancels (n = m = 1, K = 32 on an H100) says nothing about the kernel.
    scale = float((np.abs(xf) @ np.abs(deq).T).max()) or 1.0
    ours = np.asarray(kernel_choice.quantized_matmul(x, w, s, b, group, 4, cuda_matvec=True).astype(mx.float32))
    theirs = np.asarray(mx.quantized_matmul(x, w, s, b, True, group, 4).astype(mx.float32))
    err_ours = float(np.abs(ours - want).max()) / scale
    err_theirs = float(np.abs(theirs - want).max()) / scale
    assert ours.shape == (m, n)
    assert err_ours <= max(err_theirs * 1.5, 8e-3), (err_ours, err_theirs)


def _greedy_run(model: Any, prompt: list[int], decoder: CompiledDecoder | None) -> list[int]:
    return list(loops.generate_ids(model, prompt, cache=model.make_cache(None), max_tokens=16, sampler=greedy,
                                   decoder=decoder))


@cuda_only
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_marked_models_keep_their_tokens_in_every_decode_mode(tiny, monkeypatch: pytest.MonkeyPatch, switches: Any,
                                                              arch: str) -> None:
    switches.env("PYMLXC_CUDA_MATVEC", "1")
    loaded = tiny(arch)
    assert loaded.cuda_matvec
    model = loaded.model
    prompt = [int(i) for i in np.random.default_rng(3).integers(16, 500, size=37)]
    want = _greedy_run(model, prompt, None)
    for mode in ("graph", "segmented"):
        decoder = CompiledDecoder(model, mode)
        assert _greedy_run(model, prompt, decoder) == want, mode
        assert decoder.stats["compiled"] >= 1
        decoder.close()
    # Against MLX's kernel: the same model's logits for one decode step, to bfloat16 rounding.
    tokens = mx.array([prompt], dtype=mx.int32)
    cache = model.make_cache(None)
    model(tokens[:, :-1], cache=cache)
    ours = np.asarray(model(tokens[:, -1:], cache=cache).astype(mx.float32))
    with kernel_choice.mlx_kernels_only():
        cache = model.make_cache(None)
        model(tokens[:, :-1], cache=cache)
        theirs = np.asarray(model(tokens[:, -1:], cache=cache).astype(mx.float32))
    np.testing.assert_allclose(ours, theirs, atol=0.05 * float(np.abs(theirs).max()))


@cuda_only
def test_the_compiled_prefill_serves_short_and_long_chunks(tiny, monkeypatch: pytest.MonkeyPatch,
                                                            switches: Any) -> None:
    switches.env("PYMLXC_CUDA_MATVEC", "1")
    model = tiny().model
    decoder = CompiledDecoder(model, "segmented")
    runner = decoder.prefill_runner(True)
    assert runner is not None
    tokens = mx.array([[int(i) for i in np.random.default_rng(4).integers(16, 500, size=45)]], dtype=mx.int32)
    ours, theirs = model.make_cache(None), model.make_cache(None)
    with kernel_choice.mlx_kernels_only():
        for start, stop in ((0, 3), (3, 45)):  # traced on 3 rows (the kernel's range), replayed on 42
            runner(tokens[:, start:stop], ours)
            model(tokens[:, start:stop], cache=theirs)
    for c, d in zip(ours, theirs, strict=True):
        assert c.offset == d.offset == 45
        np.testing.assert_array_equal(np.asarray(c.keys[:, :, :45].astype(mx.float32)),
                                      np.asarray(d.keys[:, :, :45].astype(mx.float32)))
    decoder.close()


@cuda_only
def test_lora_gradients_through_a_marked_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, switches: Any) -> None:
    import pymlxc
    from pymlxc.training import LoRAConfig, TrainConfig, Trainer
    from pymlxc.training.data import Example, make_batch

    switches.env("PYMLXC_CUDA_MATVEC", "1")
    path = write_tiny_model(tmp_path / "m", "llama", quantize_bits=4, num_layers=2, dtype="float16")
    with pymlxc.load_model(str(path), backend="metal") as model:
        adapter = model.apply_lora(LoRAConfig(rank=4, alpha=8, target_keys=("q_proj", "v_proj")))
        before = {k: np.asarray(v.astype(mx.float32)) for k, v in adapter.trainable_parameters().items()}
        trainer = Trainer(model, TrainConfig(learning_rate=1e-2), adapter)
        batch = make_batch([Example((5, 9, 14, 20, 31, 7), 0, "x")], 64)  # 6 rows: the kernel's range
        model.set_grad_checkpoint(True)  # the recomputed forward is traced outside `logits`
        losses = [trainer.step(batch) for _ in range(3)]
        after = {k: np.asarray(v.astype(mx.float32)) for k, v in adapter.trainable_parameters().items()}
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]
    assert any(not np.array_equal(before[k], after[k]) for k in before)


def test_fused_adapter_layers_choose_their_kernel_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        switches: Any) -> None:
    """Fusing requantizes the adapted layers into new modules; they are marked like the rest."""
    import pymlxc
    from pymlxc.training import LoRAConfig

    path = write_tiny_model(tmp_path / "m", "qwen3", quantize_bits=4, num_layers=2, dtype="float16")
    switches.env("PYMLXC_CUDA_MATVEC", "1")
    switches.env("PYMLXC_CUDA_QMM", "0")  # its check would run the kernel, which needs a real GPU
    monkeypatch.setattr(kernel_choice.mx, "cuda_available", lambda: True)  # the choice alone, as on CUDA
    monkeypatch.setattr(kernel_choice.mx, "default_device", lambda: mx.Device("gpu", 0))
    monkeypatch.setattr(nn, "runs_on", lambda layer: True)
    with pymlxc.load_model(str(path), backend="metal") as model:
        model.apply_lora(LoRAConfig(rank=4, alpha=8, target_keys=("q_proj", "v_proj")))
        calls: list[Any] = []
        monkeypatch.setattr(training, "choose_kernels", _counting(nn.choose_kernels, calls))
        assert model.fuse_adapter() == 2 * 2
        net = model._net()  # noqa: SLF001 - the module tree behind the model
        layers = _quantized_layers(net)
        assert len(calls) == 1 and len(layers) == 2 * 7 + 1
        assert all(m.cuda_matvec for m in layers)


def _counting(fn: Any, calls: list[Any]) -> Any:
    def wrapped(*args: Any) -> Any:
        calls.append(args)
        return fn(*args)

    return wrapped

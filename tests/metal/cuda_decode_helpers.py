"""What the CUDA-kernel test files share: tiny float16 models written on demand (freed at the end),
the greedy ids of one generation with or without a compiled decoder, the integer products'
rounding of x replayed in numpy, and MLX's operations standing in for the matvec kernel's forms."""
from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import pymlxc.core as mx
from pymlxc import settings
from pymlxc.backends.metal import generate as loops
from pymlxc.backends.metal import kernel_choice
from pymlxc.backends.metal.decode import segments
from pymlxc.backends.metal.decode.decoder import CompiledDecoder
from pymlxc.backends.metal.kernels import add_rms_norm as cuda_norm
from pymlxc.backends.metal.kernels import rope_kv as cuda_rope_kv
from pymlxc.backends.metal.loader import load_weights_and_config
from pymlxc.backends.metal.sample import greedy
from pymlxc.settings import Settings
from pymlxc.testing import write_tiny_model

ON_CUDA = mx.cuda_available() and mx.default_device().type == "gpu"


def int16_rounding(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The kernels' rounding of x (float32) to int16 over its last axis (`pymlxc_mv::int16_pair`,
    shared by the 4-bit and Q6_K kernels): xi = rint(x * inv), inv = 32767 / max |x| in float32 (0
    where x is all zero), one rounding as the kernel's FMA gives it; and the step d = max |x| / 32767
    in float32, [..., 1]."""
    x = np.asarray(x, np.float32)
    amax = np.abs(x).max(-1, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(32767) / amax, np.float32(0)).astype(np.float32)
    xi = np.rint(x.astype(np.float64) * inv.astype(np.float64)).astype(np.int64)
    return xi, (amax * np.float32(1 / 32767)).astype(np.float32)


def tiny_settings() -> Settings:
    """The process's settings for the tiny models' loads, the dense matvec kernel off where it is
    `auto`: the float16 models serve the tests of the other decode kernels, whose plans they check as
    MLX's dense products make them (test_cuda_dense_matvec.py sets it to 1)."""
    chosen = settings.current()
    return dataclasses.replace(chosen, cuda_dense_matvec="0") if chosen.cuda_dense_matvec == "auto" else chosen


def tiny_models(tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """For a fixture: `load(arch, **kw)` gives a 3-layer float16 model (write_tiny_model's `kw`),
    loaded with `tiny_settings()`."""
    opened = []

    def load(arch: str = "llama", **kw: Any) -> Any:
        name = "-".join([arch, *(f"{k}{v}" for k, v in sorted(kw.items()))])
        loaded = load_weights_and_config(write_tiny_model(tmp_path / name, arch, num_layers=3, dtype="float16", **kw),
                                         settings=tiny_settings())
        opened.append(loaded)
        return loaded.model

    yield load
    for m in opened:
        m.free()


def greedy_ids(model: Any, decoder: CompiledDecoder | None, n: int = 12) -> list[int]:
    """n greedy ids after a fixed 21-token prompt."""
    prompt = [int(i) for i in np.random.default_rng(5).integers(16, 500, size=21)]
    return list(loops.generate_ids(model, prompt, cache=model.make_cache(None), max_tokens=n, sampler=greedy,
                                   decoder=decoder))


def plan_flags(decoder: CompiledDecoder, flag: str) -> set[Any]:
    """The values of a segment-plan flag (`fused_norm`, `cuda_argmax`, `attention`) over the decoder's plans."""
    return {getattr(plan, flag) for plan in decoder._plans.values()}  # noqa: SLF001


def check_the_setting_is_read_by_name(model: Any, switches: Any, variable: str, attribute: str, flag: str,
                                      off: Any = False) -> None:
    """A CUDA switch (`variable`) read by `CompiledDecoder` into `attribute`: a bad value is an error
    naming it; `0` keeps MLX's kernels (every plan's `flag` is `off`) and the uncompiled loop's tokens."""
    with pytest.raises(ValueError, match=variable):
        switches.env(variable, "sometimes")
    switches.env(variable, " 0 ")
    decoder = CompiledDecoder(model, "segmented")
    assert getattr(decoder, attribute) == "0"
    assert greedy_ids(model, decoder) == greedy_ids(model, None) and plan_flags(decoder, flag) == {off}
    decoder.close()


def forget_verdicts(*checks: Any) -> Any:
    """An autouse fixture for a kernel's test module (`fresh_checks = forget_verdicts(module.checks)`):
    each test starts and ends with none of these checks' verdicts, in this process or the user cache."""

    @pytest.fixture(autouse=True)
    def fresh_checks() -> Iterator[None]:
        for c in checks:
            c.forget()
        yield
        for c in checks:
            c.forget()

    return fresh_checks


def stood_in_decoder(model: Any, flag: str) -> CompiledDecoder:
    """A segmented decoder run with a kernel stood in for (the caller patched it and forced its
    use): its greedy ids are the uncompiled loop's, it decoded compiled, and its plan sets `flag`.
    Returned for further checks; the caller closes it."""
    want = greedy_ids(model, None)
    decoder = CompiledDecoder(model, "segmented")
    assert greedy_ids(model, decoder) == want
    assert decoder.stats["compiled"] == 1 and plan_flags(decoder, flag) == {True}
    return decoder


def check_a_forced_setting_keeps_mlx_kernels(model: Any, switches: Any, variable: str, flag: str) -> None:
    """Off CUDA, a CUDA switch (`variable`) forced to `1`: the kernel's check failed already (its
    verdict is cached, so no second warning), no plan sets `flag`, the tokens are the uncompiled loop's."""
    switches.env(variable, "1")
    decoder = CompiledDecoder(model, "segmented")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        assert greedy_ids(model, decoder) == greedy_ids(model, None)
    assert plan_flags(decoder, flag) == {False}
    decoder.close()


cuda_only = pytest.mark.skipif(not ON_CUDA, reason="the kernel needs MLX's CUDA build (run on the GPU machine)")


def stand_in_for_add_norm(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """Replace the add + RMSNorm kernel by MLX's own two ops (`unfused`); the list returned gets the
    shape of each call's first operand."""
    calls: list[tuple[int, ...]] = []

    def stand_in(a: Any, b: Any, w: Any, eps: float) -> tuple[Any, Any]:
        calls.append(tuple(a.shape))
        return cuda_norm.unfused(a, b, w, eps)

    monkeypatch.setattr(cuda_norm, "add_rms_norm", stand_in)
    return calls


class StandIns:
    """MLX's operations in place of the matvec kernel's forms (4-bit, or dense where `s` is None),
    each call recorded by name in `calls`."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    @staticmethod
    def product(x: Any, w: Any, s: Any, b: Any, group: int) -> Any:
        if s is None:
            return mx.matmul(x, mx.transpose(w))
        return mx.quantized_matmul(x, w, s, b, True, group, 4)

    def residual(self, x: Any, w: Any, s: Any, b: Any, group: int, res: Any) -> Any:
        self.calls.append("residual")
        return res + self.product(x, w, s, b, group)

    def normed(self, h: Any, w: Any, s: Any, b: Any, group: int, nw: Any, eps: float, pair: bool = False) -> Any:
        self.calls.append("pair" if pair else "normed")
        y = self.product(mx.fast.rms_norm(h, nw, eps), w, s, b, group)
        return kernel_choice.silu_of_pair(y) if pair else y

    def plain_pair(self, x: Any, w: Any, s: Any, b: Any, group: int, bits: int, cuda_matvec: bool) -> Any:
        self.calls.append("plain pair")
        return kernel_choice.silu_of_pair(self.product(x, w, s, b, group))

    def rope_form(self, h: Any, w: Any, s: Any, b: Any, group: int, nw: Any, eps: float, pos: Any, keys: Any,
                  values: Any, rope: Any, n_heads: int) -> Any:
        self.calls.append("rope form")
        qkv = self.product(mx.fast.rms_norm(h, nw, eps), w, s, b, group)
        return cuda_rope_kv.reference(qkv, None, pos, keys, values, rope.mlx, n_heads)

    def rope_kernel(self, qk: Any, v: Any, pos: Any, keys: Any, values: Any, rope: Any, n_heads: int) -> Any:
        self.calls.append("rope kernel")
        return cuda_rope_kv.reference(qk, v, pos, keys, values, rope.mlx, n_heads)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """The forms and the paired kernels replaced, their checks passed, the plain products MLX's."""
        monkeypatch.setattr(kernel_choice, "_use", lambda cuda_matvec: False)
        monkeypatch.setattr(segments, "residual_product", self.residual)
        monkeypatch.setattr(segments, "normed_product", self.normed)
        monkeypatch.setattr(segments, "normed_rope_product", self.rope_form)
        monkeypatch.setattr(segments, "kernel_silu_product", self.plain_pair)
        monkeypatch.setattr(segments, "fusion_ready", lambda *a: True)
        monkeypatch.setattr(segments, "rope_fusion_ready", lambda *a: True)
        monkeypatch.setattr(segments, "pair_ready", lambda *a: True)

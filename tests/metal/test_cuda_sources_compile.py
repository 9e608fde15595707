"""pymlxc's CUDA kernel sources compile for sm_90 as MLX wraps them (tests/metal/nvrtc_compile.py),
with the template arguments their `launch` functions give, on a machine without a GPU: the prefill
attention kernel at every head size and a group of each kind, the tensor-core qmm at every group
size, the dequantization kernel of one and of eight weights. A source that does not compile failed
only on the GPU machine, at its first call. (Wrapping a body that does not compile fails here too.)
"""
from __future__ import annotations

import sys

import pytest

import pymlxc.core as mx
from pymlxc.backends.metal.kernels import dequantize, prefill_attention, qmm

from .nvrtc_compile import available, compile_source, wrap

pytestmark = pytest.mark.skipif(not available() and sys.platform != "linux",
                                reason="NVIDIA's NVRTC wheels are Linux's (the test extras install them there)")

def _compiles(name: str, source: str, header: str, inputs: list[tuple[str, str]], outputs: list[tuple[str, str]],
              template: list[tuple[str, object]]) -> None:
    log = compile_source(wrap(name, source, header, inputs, outputs, template), name)
    assert log is None, log


@pytest.mark.parametrize(("dtype", "heads", "kv_heads", "head_dim"), [
    (mx.bfloat16, 32, 8, 64), (mx.bfloat16, 28, 4, 128), (mx.bfloat16, 40, 8, 112), (mx.float16, 12, 4, 80),
    (mx.float16, 64, 1, 96), (mx.float16, 8, 8, 64)])
def test_prefill_attention(dtype: mx.Dtype, heads: int, kv_heads: int, head_dim: int) -> None:
    t = str(dtype).split(".")[-1]
    template = prefill_attention.launch(1, 37, heads, kv_heads, head_dim, dtype, head_dim ** -0.5)["template"]
    _compiles(prefill_attention.NAME, prefill_attention.SOURCE, prefill_attention.HEADER,
              [(n, t) for n in prefill_attention.INPUTS], [(prefill_attention.OUTPUT_NAMES[0], t)], template)


@pytest.mark.parametrize(("dtype", "group"), [*((mx.bfloat16, g) for g in qmm.GROUP_SIZES), (mx.float16, 64)])
def test_qmm(dtype: mx.Dtype, group: int) -> None:
    t = str(dtype).split(".")[-1]
    _compiles(qmm.NAME, qmm.SOURCE, qmm.HEADER, [("x", t), ("w", "uint32"), ("scales", t), ("biases", t)],
              [(qmm.OUTPUT_NAMES[0], t)], qmm.launch(128, 2048, 8192, dtype, group)["template"])


@pytest.mark.parametrize("count", [1, dequantize.MAX_WEIGHTS])
def test_dequantize(count: int) -> None:
    kinds = {"w": "uint32", "scales": "bfloat16", "biases": "bfloat16"}
    inputs = [(n, kinds[n.rstrip("0123456789")]) for n in dequantize.inputs(count)]
    outputs = [(n, "bfloat16") for n in dequantize.outputs(count)]
    _compiles(dequantize.name(count), dequantize.source(count), dequantize.HEADER, inputs, outputs,
              dequantize.launch(1024, mx.bfloat16, 64)["template"])


def test_a_body_that_does_not_compile_is_caught() -> None:
    log = compile_source(wrap("broken", "  out[0] = undefined_name;", "", [("x", "float32")], [("out", "float32")], []))
    assert log is not None and "undefined_name" in log

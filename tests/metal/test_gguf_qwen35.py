"""Qwen3-Next and Qwen 3.5 from GGUF (llama.cpp's qwen3next, qwen35 and qwen35moe): tiny models
written as llama.cpp's converter writes them (`pymlxc.testing_gguf`: A_log as -exp(A_log), squeezed
conv weights, norms as 1 + w, Qwen3-Next's q|k|v|z split, Qwen 3.5's value heads tiled, a
multi-token prediction block after the model's) load with the original's config, logits and greedy
tokens (F32), and quantized with a twin checkpoint's weights (the `gguf` package's dequantization of
the very blocks written).

Tolerances: an F32 file differs from the safetensors original only by A_log's round trip through
-exp (a float32 ulp). Quantized files: each layer's values are checked against the twin's (bit-exact,
or Q4_K/Q5_K within the float16 rounding of their scales, docs/gguf.md); the twin then takes the
values as loaded and the embedding rows the file yields, so the logits check the wiring alone and
agree to float32 summation order (a Q4_K model's rounding alone moves these logits by up to 0.14, and
a flipped expert choice by more). An F16 file computes in float16 (measured 0.03 from the twin).
"""
from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from hypothesis import given, settings
from hypothesis import strategies as st

import pymlxc
import pymlxc.core as mx
from pymlxc.backends.metal import generate as loops
from pymlxc.backends.metal import nn
from pymlxc.backends.metal.formats.gguf import GGUFError, gguf_config, read_gguf
from pymlxc.backends.metal.formats.gguf_quants import dequantize_blocks
from pymlxc.backends.metal.formats.gguf_tensors import _value_order
from pymlxc.backends.metal.gguf_layers import BlockLinear
from pymlxc.backends.metal.loader import load_weights_and_config
from pymlxc.backends.metal.sample import greedy
from pymlxc.testing import write_tiny_model
from pymlxc.testing_gguf import _tiled

from .gguf_export import export_gguf

ARCHS = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
IDS = [3, 17, 260, 99, 5, 301, 42, 8, 150, 77, 2, 400]
F32_ATOL = 1e-4
ATOL = {Q.F16: 0.06, Q.Q8_0: 1e-4, Q.Q4_K: 1e-4, "mixed": 1e-4}
MEMORY_BOUND = 1.12
# Widths that fit the K-quants' 256-value blocks: value heads of 64 (4 of them), experts of 256.
DIMS: dict[str, Any] = {"hidden_size": 256, "intermediate_size": 256,
                        "extra_config": {"linear_value_head_dim": 64, "moe_intermediate_size": 256,
                                         "shared_expert_intermediate_size": 256}}


def recipe(arch: str) -> dict[str, Q]:
    """A Q4_K_M-like mix: Q6_K head and some down projections, one output projection of a linear
    layer in Q6_K (its blocks span two value heads: loaded dense), attn_qkv and attn_gate one step up
    (Qwen3-Next merges them into one projection)."""
    down = "ffn_down_exps" if arch != "qwen3_5" else "ffn_down"
    return {"output.weight": Q.Q6_K, "token_embd.weight": Q.Q4_K, "blk.0.ssm_out.weight": Q.Q6_K,
            "blk.2.ssm_out.weight": Q.Q5_K, f"blk.0.{down}.weight": Q.Q6_K, "blk.1.attn_v.weight": Q.Q6_K,
            "blk.2.attn_qkv.weight": Q.Q5_K, "blk.2.attn_gate.weight": Q.Q5_K, "blk.0.ssm_beta.weight": Q.Q8_0}


@pytest.fixture(autouse=True)
def _quiet() -> None:
    warnings.simplefilter("ignore", DeprecationWarning)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    root = tmp_path_factory.mktemp("qwen35")
    cache: dict[str, Path] = {}

    def make(arch: str) -> Path:
        if arch not in cache:
            cache[arch] = write_tiny_model(root / arch, arch, seed=3, **DIMS)
        return cache[arch]

    return make


def export(src: Path, root: Path, qtype: Q, extra: Mapping[str, Q] | None = None) -> tuple[Path, Path]:
    (root / "gguf").mkdir(parents=True)
    return export_gguf(src, root / "gguf" / "m.gguf", qtype, extra_types=extra, twin=root / "twin"), root / "twin"


def run(model: Any) -> tuple[np.ndarray, list[int]]:
    """Logits of IDS and 16 greedy tokens after them."""
    logits = np.array(model(mx.array([IDS])).astype(mx.float32))
    tokens = list(loops.generate_ids(model, IDS, cache=model.make_cache(), sampler=greedy, max_tokens=16))
    assert len(tokens) == 16
    return logits, tokens


# ---------------------------------------------------------------------- F32: the original's model

@pytest.mark.parametrize("arch", ARCHS)
def test_f32_file_is_the_safetensors_model(arch: str, tiny: Callable[[str], Path], tmp_path: Path) -> None:
    src = tiny(arch)
    path, _ = export(src, tmp_path, Q.F32)
    with load_weights_and_config(path) as got, load_weights_and_config(src) as want:
        assert type(got.model) is type(want.model)
        (a, ta), (b, tb) = run(got.model), run(want.model)
    np.testing.assert_allclose(a, b, atol=F32_ATOL, rtol=0)
    assert ta == tb
    config = gguf_config(read_gguf(path))
    original = json.loads((src / "config.json").read_text())
    text = original.get("text_config", original)
    for key in ("num_hidden_layers", "full_attention_interval", "linear_num_key_heads", "linear_num_value_heads",
                "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim", "num_key_value_heads",
                "head_dim", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                "shared_expert_intermediate_size", "norm_topk_prob", "tie_word_embeddings"):
        if key in text and ("num_experts" in text or not key.startswith(("moe_", "shared_"))):
            assert config[key] == text[key], key
    assert config["model_type"] == arch
    assert config["partial_rotary_factor"] == 0.25
    # The converter appends the multi-token prediction block; pymlxc drops it.
    reader = gguf.GGUFReader(path)
    layers = text["num_hidden_layers"]
    assert any(t.name == f"blk.{layers}.nextn.eh_proj.weight" for t in reader.tensors)


# ---------------------------------------------------------------------- quantized: the twin's weights

def effective(layer: Any) -> np.ndarray:
    """A projection's weight as it computes with it (float32)."""
    if "qtype" in vars(layer):  # BlockLinear, BlockSwitchLinear
        w = dequantize_blocks(layer.weight, layer.qtype)
    elif "scales" in vars(layer):
        w = mx.dequantize(layer.weight, layer.scales.astype(mx.float32), layer.biases.astype(mx.float32),
                          layer.group_size, layer.bits)
    else:
        w = layer.weight
    return np.array(w.astype(mx.float32))


def rounded_scale_bound(layer: Any) -> np.ndarray:
    """Q4_K/Q5_K (docs/gguf.md): each weight within 2^-11 (|scale| q + |bias|) of the reference, the
    scale and bias rounded to float16 (taken from the loaded layer, so 2^-10 covers both roundings)."""
    scales = np.abs(np.array(layer.scales.astype(mx.float32)))
    biases = np.abs(np.array(layer.biases.astype(mx.float32)))
    bound = 2.0**-10 * (scales * (2**layer.bits - 1) + biases) + 2.0**-24
    return np.repeat(bound, layer.group_size, axis=-1)


def check_weights(got: Any, want: Any, rounded: bool) -> None:
    """Every layer of the GGUF model holds the twin's values (then the twin takes the layer's values,
    so that its logits check the wiring alone); every other parameter is the twin's too."""
    theirs = dict(want.named_modules())
    for path, layer in got.named_modules():
        if ("weight" not in vars(layer) or layer.weight.ndim < 2 or path not in theirs
                or path.endswith("conv1d")):
            continue
        a, b = effective(layer), effective(theirs[path])
        assert a.shape == b.shape, path
        if type(layer) is nn.Linear and layer.weight.dtype != theirs[path].weight.dtype:
            # A dense fallback (or an F16 matrix) in the activations' dtype: the reference, rounded.
            b = np.array(mx.array(b).astype(layer.weight.dtype).astype(mx.float32))
        if rounded and "scales" in vars(layer):
            assert np.all(np.abs(a - b) <= rounded_scale_bound(layer)), path
        else:
            np.testing.assert_array_equal(a, b, err_msg=path)
        theirs[path].weight = mx.array(a)  # the scales rounded to float16 (Q4_K/Q5_K), as loaded
    mine, theirs_params = got.parameters(), want.parameters()
    checked = [n for n in mine if n.endswith(("A_log", "dt_bias", "norm.weight", "layernorm.weight", "conv1d.weight"))]
    assert len(checked) > 10
    for name in checked:  # stored as they are, or in float16 where the file's matrices are F16
        np.testing.assert_array_equal(np.array(mine[name].astype(mx.float32)),
                                      np.array(theirs_params[name].astype(mine[name].dtype).astype(mx.float32)),
                                      err_msg=name)


class _Rows(nn.Module):
    """An embedding that looks up `table` and, as a tied head, stays `head` (the exact weights)."""

    def __init__(self, table: mx.Array, head: nn.Embedding) -> None:
        super().__init__()
        self.table, self.head = table, head

    def __call__(self, ids: mx.Array) -> mx.Array:
        return mx.take(self.table, ids, axis=0)

    def as_linear(self, h: mx.Array) -> mx.Array:
        return self.head.as_linear(h)


def near_tie(steps: np.ndarray, i: int, margin: float) -> bool:
    """True when greedy step i is a near tie in the reference's logits `steps` (one row a step):
    a difference of `margin` may pick either token there."""
    top = np.sort(steps[i])[-2:]
    return bool(top[1] - top[0] < margin)


@pytest.mark.parametrize("kind", [Q.F16, Q.Q8_0, Q.Q4_K, "mixed"], ids=lambda k: getattr(k, "name", k))
@pytest.mark.parametrize("arch", ARCHS)
def test_quantized_file_holds_the_reference(arch: str, kind: Any, tiny: Callable[[str], Path], tmp_path: Path) -> None:
    main = Q.Q4_K if kind == "mixed" else kind
    extra = recipe(arch) if kind == "mixed" else None
    path, twin = export(tiny(arch), tmp_path, main, extra)
    # An F16 file computes in float16, which MLX's CPU gather_mm (the experts) does not take.
    cpu_moe = kind == Q.F16 and arch != "qwen3_5" and mx.default_device().type == "cpu"
    with load_weights_and_config(path, dtype="float32" if cpu_moe else "auto") as got, \
            load_weights_and_config(twin) as want:
        check_weights(got.model, want.model, rounded=main in (Q.Q4_K,) or kind == "mixed")
        kinds = {p: type(m) for p, m in got.model.named_modules()}
        file_tensors = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(path).tensors}
        ratio = got.nbytes / sum(file_tensors.values())
        # A dense fallback's bytes beyond the file's: the model's dtype against Q6_K's 6.6 bits.
        dense_bytes = got.model.model.layers[0].linear_attn.out_proj.weight.nbytes
        fallback = (dense_bytes - file_tensors["blk.0.ssm_out.weight"]) / sum(file_tensors.values())
        # The twin reads the rows the file's embedding yields (float16 where quantized): from there
        # on both compute the same products.
        table = got.model.model.embed_tokens(mx.arange(want.model.args.vocab_size)[None])[0]
        want.model.model.embed_tokens = _Rows(table.astype(mx.float32), want.model.model.embed_tokens)
        (a, ta), (b, tb) = run(got.model), run(want.model)
        want_steps = np.array(want.model(mx.array([IDS + tb])).astype(mx.float32))[0, len(IDS) - 1:]
    np.testing.assert_allclose(a, b, atol=ATOL[kind], rtol=0)
    if kind != Q.F16 or cpu_moe:  # the same values, computed in float32: the same tokens
        assert ta == tb
    else:  # computed in float16: the same tokens wherever the reference's choice is clear of the rounding
        assert ta[:4] == tb[:4]
        for i, (x, y) in enumerate(zip(ta, tb, strict=True)):
            if x != y:
                assert i >= 4 and near_tie(want_steps, i, 2 * ATOL[kind]), (i, ta, tb)
                break
    out_proj = kinds["model.layers.0.linear_attn.out_proj"]
    if kind == "mixed":
        # Q6_K blocks span two value heads: Qwen 3.5's untiling needs them dense; Qwen3-Next's are not tiled.
        assert out_proj is (BlockLinear if arch == "qwen3_next" else nn.Linear)
        assert kinds["model.layers.2.linear_attn.out_proj"] is nn.QuantizedLinear  # Q5_K: whole groups move
        bound = MEMORY_BOUND + (0.0 if arch == "qwen3_next" else fallback)
    else:
        assert out_proj is (nn.Linear if kind == Q.F16 else nn.QuantizedLinear)
        bound = MEMORY_BOUND
    assert cpu_moe or ratio <= bound, ratio  # (float32 asked for: the F16 matrices widened)


def test_qwen3_next_projections_of_two_types_load_dense(tiny: Callable[[str], Path], tmp_path: Path) -> None:
    """Qwen3-Next's in_proj_qkvz is rebuilt from attn_qkv and attn_gate; of two types, from their
    reference dequantizations."""
    path, twin = export(tiny("qwen3_next"), tmp_path, Q.Q4_K, {"blk.0.attn_gate.weight": Q.Q8_0})
    with load_weights_and_config(path) as got, load_weights_and_config(twin) as want:
        layer = got.model.model.layers[0].linear_attn.in_proj_qkvz
        assert type(layer) is nn.Linear
        np.testing.assert_allclose(effective(layer), effective(want.model.model.layers[0].linear_attn.in_proj_qkvz),
                                   rtol=2.0**-10, atol=1e-6)  # float16, the activations' dtype
        assert type(got.model.model.layers[2].linear_attn.in_proj_qkvz) is nn.QuantizedLinear


def test_generates_from_the_file_with_its_tokenizer(tiny: Callable[[str], Path], tmp_path: Path) -> None:
    (tmp_path / "g").mkdir()
    path = export_gguf(tiny("qwen3_5_moe"), tmp_path / "g" / "m.gguf", Q.Q4_K, pre="qwen35")
    with pymlxc.load_model(str(path), backend="metal") as model:
        assert len(list(model.generate("Once upon a time", max_tokens=6))) == 6


# ---------------------------------------------------------------------- metadata

@settings(max_examples=40, deadline=None)
@given(key_heads=st.integers(1, 6), per=st.integers(1, 5), head=st.integers(1, 9))
def test_value_order_undoes_the_converters_tiling(key_heads: int, per: int, head: int) -> None:
    grouped = np.arange(key_heads * per * head * 3).reshape(key_heads * per * head, 3)
    tiled = _tiled(grouped, 0, key_heads, key_heads * per, head)
    np.testing.assert_array_equal(tiled[_value_order(key_heads, key_heads * per, head)], grouped)


def _rewrite(path: Path, out: Path, edit: Callable[[gguf.GGUFWriter, str, Any], bool],
             tensors: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]] | None = None) -> Path:
    """A copy of the GGUF file at `path` whose metadata passes through `edit(writer, key, value)`
    (True: the edit wrote it, else copied as is) and, for an F32 file, its tensors through `tensors`."""
    reader = gguf.GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(out), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = field.contents()
        if edit(writer, name, value):
            continue
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_array(name, value)
        else:
            writer.add_key_value(name, value, vtype)
    if tensors is not None:
        for name, value in tensors({t.name: np.array(t.data) for t in reader.tensors}).items():
            writer.add_tensor(name, value)
    else:
        for t in reader.tensors:
            writer.add_tensor(t.name, np.asarray(t.data), raw_shape=list(reversed([int(d) for d in t.shape])),
                              raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def test_recurrent_layers_list_sets_the_interval(tiny: Callable[[str], Path], tmp_path: Path) -> None:
    path, _ = export(tiny("qwen3_5"), tmp_path, Q.F32)
    key = "qwen35.attention.recurrent_layers"

    def listed(pattern: list[bool]) -> Callable[[gguf.GGUFWriter, str, Any], bool]:
        def edit(writer: gguf.GGUFWriter, name: str, value: Any) -> bool:
            if name == "qwen35.full_attention_interval":
                writer.add_uint32(name, 7)  # the list wins over the interval
                writer.add_array(key, pattern)
                return True
            return False
        return edit

    good = _rewrite(path, tmp_path / "good.gguf", listed([True, False, True, False, False]))
    assert gguf_config(read_gguf(good))["full_attention_interval"] == 2
    bad = _rewrite(path, tmp_path / "bad.gguf", listed([True, False, False, True, False]))
    with pytest.raises(GGUFError, match="recurrent_layers"):
        gguf_config(read_gguf(bad))


def test_wrong_linear_sizes_name_the_key_or_tensor(tiny: Callable[[str], Path], tmp_path: Path) -> None:
    path, _ = export(tiny("qwen3_5"), tmp_path, Q.F32)

    def change(key: str, value: int) -> Callable[[gguf.GGUFWriter, str, Any], bool]:
        def edit(writer: gguf.GGUFWriter, name: str, _: Any) -> bool:
            if name == key:
                writer.add_uint32(name, value)
                return True
            return False
        return edit

    odd = _rewrite(path, tmp_path / "odd.gguf", change("qwen35.ssm.time_step_rank", 3))
    with pytest.raises(GGUFError, match=r"ssm\.time_step_rank"):
        gguf_config(read_gguf(odd))
    wide = _rewrite(path, tmp_path / "wide.gguf", change("qwen35.ssm.state_size", 64))
    with pytest.raises(GGUFError, match=r"attn_qkv\.weight|ssm_conv1d\.weight"):
        gguf_config(read_gguf(wide))
    with pytest.raises(GGUFError, match="nextn_predict_layers"):
        gguf_config(read_gguf(_rewrite(path, tmp_path / "mtp.gguf", change("qwen35.nextn_predict_layers", 5))))


def test_qwen3_next_legacy_ssm_in(tiny: Callable[[str], Path], tmp_path: Path) -> None:
    """Older converters wrote Qwen3-Next's projection as `ssm_in`, HF's q|k|v|z per key head: the
    same model as today's attn_qkv + attn_gate."""
    src = tiny("qwen3_next")
    path, _ = export(src, tmp_path, Q.F32)
    text = json.loads((src / "config.json").read_text())
    nk, dk = text["linear_num_key_heads"], text["linear_key_head_dim"]

    def legacy(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = {}
        for name, value in tensors.items():
            if name.endswith(".attn_gate.weight"):
                continue
            if name.endswith(".attn_qkv.weight"):
                z = tensors[name.replace("attn_qkv", "attn_gate")]
                hidden = value.shape[-1]
                q, k = (value[i * nk * dk:(i + 1) * nk * dk].reshape(nk, dk, hidden) for i in (0, 1))
                v = value[2 * nk * dk:].reshape(nk, -1, hidden)
                name = name.replace("attn_qkv", "ssm_in")
                value = np.concatenate([q, k, v, z.reshape(nk, -1, hidden)], axis=1).reshape(-1, hidden)
            out[name] = value
        return out

    old = _rewrite(path, tmp_path / "legacy.gguf", lambda *_: False, legacy)
    assert any(t.name == "blk.0.ssm_in.weight" for t in gguf.GGUFReader(old).tensors)
    with load_weights_and_config(old) as a, load_weights_and_config(path) as b:
        np.testing.assert_array_equal(np.array(a.model(mx.array([IDS]))), np.array(b.model(mx.array([IDS]))))

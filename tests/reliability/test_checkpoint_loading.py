"""A safetensors checkpoint directory whose parts disagree (shards, index, config, tensors) is
refused with an error naming the file, field or tensor, instead of loading silently wrong or
failing with an MLX error that names nothing. Cases that could exhaust memory run in a child
process (`run_case`)."""
from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import load_file, save_file

from pymlxc.backends.metal import nn
from pymlxc.backends.metal.loader import ConfigError, WeightsFileError, load_weights_and_config
from pymlxc.backends.metal.tokenizer import Tokenizer, TokenizerLoadError
from pymlxc.files import JSON_LIMIT, UnsafeFileError
from pymlxc.testing import write_tiny_model

from .subproc import run_case

SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


@pytest.fixture(scope="module")
def llama_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("src") / "llama", "llama")  # untied: has lm_head.weight


@pytest.fixture(scope="module")
def moe_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("src") / "moe", "qwen3_moe")  # 4 experts, stored one by one


@pytest.fixture()
def llama(llama_source: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(llama_source, tmp_path / "llama"))


@pytest.fixture()
def moe(moe_source: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(moe_source, tmp_path / "moe"))


def _edit_config(path: Path, **changes: Any) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def _split(path: Path, edit: Callable[[dict[str, dict[str, np.ndarray]]], None] = lambda parts: None,
           index: bool = True) -> list[str]:
    """model.safetensors -> two shards (and their index); `edit(parts)` (shard name -> tensors)
    changes them after the index is made. Returns the tensor names, sorted."""
    weights = load_file(str(path / "model.safetensors"))
    (path / "model.safetensors").unlink()
    names = sorted(weights)
    half = len(names) // 2
    parts = {SHARDS[0]: {k: weights[k] for k in names[:half]}, SHARDS[1]: {k: weights[k] for k in names[half:]}}
    if index:
        weight_map = {k: file for file, part in parts.items() for k in part}
        (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    edit(parts)
    for file, part in parts.items():
        save_file(part, str(path / file))
    return names


def _set_shape(file: Path, tensor: str, shape: list[int]) -> None:
    """Rewrite the shape `tensor` has in the header of the safetensors `file` (its bytes kept)."""
    data = file.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    header[tensor]["shape"] = shape
    raw = json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])


# -- shards and index ------------------------------------------------------------------------------

@pytest.mark.parametrize("index", [True, False])
def test_a_tensor_in_two_shards_is_refused(llama: Path, index: bool) -> None:
    """The second shard's copy (zeros) used to replace the first's silently: which one loaded
    depended on the order the files were read in."""
    def duplicate(parts: dict[str, dict[str, np.ndarray]]) -> None:
        assert "model.embed_tokens.weight" in parts[SHARDS[0]]
        parts[SHARDS[1]]["model.embed_tokens.weight"] = np.zeros((512, 64), np.float32)

    _split(llama, duplicate, index=index)
    with pytest.raises(WeightsFileError, match=r"tensor 'model\.embed_tokens\.weight' is in two weights files: "
                                               rf".*{SHARDS[0]} and .*{SHARDS[1]}"):
        load_weights_and_config(llama)


def test_a_tensor_the_index_lists_but_no_shard_holds_is_refused(llama: Path) -> None:
    """An index listing lm_head.weight whose shard lacks it (an incomplete download) used to load
    with the embedding as the output head."""
    _split(llama, lambda parts: parts[SHARDS[0]].pop("lm_head.weight"))
    _edit_config(llama, tie_word_embeddings=None)  # not said: a head the checkpoint lacks would be tied
    with pytest.raises(WeightsFileError, match=r"index\.json: weight_map lists 1 tensor that no weights file holds: "
                                               rf"'lm_head\.weight' \(in {SHARDS[0]}\)"):
        load_weights_and_config(llama)


def test_a_split_checkpoint_with_its_index_loads(llama: Path) -> None:
    names = _split(llama)
    with load_weights_and_config(llama) as loaded:
        assert loaded.num_tensors == len(names)


# -- the output head -------------------------------------------------------------------------------

def test_untied_config_without_lm_head_is_refused(llama: Path) -> None:
    """tie_word_embeddings false and no lm_head.weight used to load with the embedding as the head
    (transformers leaves such a head random; mlx-lm refuses the checkpoint)."""
    weights = load_file(str(llama / "model.safetensors"))
    del weights["lm_head.weight"]
    save_file(weights, str(llama / "model.safetensors"))
    assert json.loads((llama / "config.json").read_text())["tie_word_embeddings"] is False
    with pytest.raises(nn.WeightsError, match=r"missing tensor in checkpoint: lm_head\.weight \(.*config\.json sets "
                                              "tie_word_embeddings to false"):
        load_weights_and_config(llama)
    _edit_config(llama, tie_word_embeddings=True)
    with load_weights_and_config(llama) as loaded:
        assert loaded.model.lm_head is None


# -- quantization ----------------------------------------------------------------------------------

@pytest.mark.parametrize(("quant", "field"), [
    ({"bits": None, "group_size": None}, "quantization.bits: expected one of 2, 3, 4, 5, 6, 8, got None"),
    ({"bits": 4, "group_size": None}, "quantization.group_size: expected one of 32, 64, 128, got None"),
    ({"bits": 4, "group_size": 32, "model.layers.0.mlp.up_proj": {"bits": None}},
     "quantization.model.layers.0.mlp.up_proj.bits: expected one of"),
    ({"bits": 4, "group_size": 32, "model.layers.0.mlp.up_proj": {"bits": 4, "group_size": 32, "mode": "mxfp4"}},
     "quantization.model.layers.0.mlp.up_proj.mode: quantization mode 'mxfp4' is not supported"),
])
def test_quantization_entries_without_a_usable_value(tmp_path: Path, quant: dict[str, Any], field: str) -> None:
    """null bits or group_size used to raise a bare TypeError from int(None); a layer's own mode
    (MLX's mxfp4, ...) was ignored and its tensors unpacked as affine."""
    path = write_tiny_model(tmp_path / "q", "llama", quantize_bits=4, group_size=32)
    config = json.loads((path / "config.json").read_text())
    config.pop("quantization_config", None)
    config["quantization"] = quant
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError) as info:
        load_weights_and_config(path)
    assert str(info.value).startswith(f"{path / 'config.json'}: {field}"), str(info.value)


# -- mixture of experts ----------------------------------------------------------------------------

@settings(max_examples=12, deadline=None)
@given(count=st.integers(0, 64).filter(lambda n: n != 4))
def test_num_experts_must_match_the_checkpoint(moe_source: Path, tmp_path_factory: pytest.TempPathFactory,
                                               count: int) -> None:
    """num_experts 0 used to fail with MLX's "[stack] No arrays provided for stacking"; other
    counts as a missing or unexpected tensor, after the model was built."""
    path = Path(shutil.copytree(moe_source, tmp_path_factory.mktemp("e") / "m"))
    _edit_config(path, num_experts=count, num_experts_per_tok=1)
    with pytest.raises(ConfigError, match=rf"config\.json: num_experts: {count}, but the checkpoint's tensors hold "
                                          r"4 experts \(mlp\.experts\.0 \.\. mlp\.experts\.3\)"):
        load_weights_and_config(path)


def test_a_huge_num_experts_is_refused_before_anything_is_built(moe: Path) -> None:
    """2**31 - 1 experts (in range for a size) used to build a name for each before any tensor was
    looked at: over 100 GB, a MemoryError at best (limited to 6 GB here)."""
    _edit_config(moe, num_experts=2**31 - 1)
    kind, message = run_case(f"""
import resource
resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))
from pymlxc.backends.metal.loader import load_weights_and_config
try:
    load_weights_and_config({str(moe)!r}).free()
    report(["loaded", ""])
except Exception as exc:
    report([type(exc).__name__, str(exc)])
""", timeout=120)
    assert kind == "ConfigError"
    assert message.startswith(f"{moe / 'config.json'}: num_experts: 2147483647, but the checkpoint's tensors hold 4")


@pytest.mark.parametrize("shape", [[64, 32], [32, 32], [-32, -64]])
def test_an_expert_of_another_shape_is_named(moe: Path, shape: list[int]) -> None:
    """An expert whose tensor differs from its siblings used to fail with MLX's "[stack] All arrays
    must have the same shape", naming neither tensor nor file; MLX's reader takes a negative shape
    whose product fits the bytes ([-32, -64] for 32 x 64)."""
    tensor = "model.layers.0.mlp.experts.2.up_proj.weight"  # (32, 64)
    file = moe / "model.safetensors"
    if shape == [32, 32]:
        weights = load_file(str(file))
        weights[tensor] = np.ascontiguousarray(weights[tensor][:, :32])
        save_file(weights, str(file))
    else:
        _set_shape(file, tensor, shape)
    with pytest.raises(WeightsFileError) as info:
        load_weights_and_config(moe)
    message = str(info.value)
    assert f"tensor {tensor!r} in {file}" in message, message
    assert str(tuple(shape)) in message, message


def test_a_negative_dimension_is_refused_in_any_tensor(llama: Path) -> None:
    _set_shape(llama / "model.safetensors", "model.norm.weight", [-8, -8])  # 64 values, as stored
    with pytest.raises(WeightsFileError, match=r"tensor 'model\.norm\.weight' in .*model\.safetensors has a negative "
                                               r"dimension: shape \(-8, -8\)"):
        load_weights_and_config(llama)


# -- config floats that divide ---------------------------------------------------------------------

@pytest.mark.parametrize(("arch", "field"), [
    ("gemma4_text", "final_logit_softcapping"), ("gemma4_text", "rms_norm_eps"),
    ("gemma3_text", "rms_norm_eps"), ("gemma3_text", "attn_logit_softcapping"),
])
def test_a_zero_that_would_divide_is_refused(tmp_path: Path, arch: str, field: str) -> None:
    """rms_norm_eps 0 (an RMSNorm of a zero row: 0 / 0) and gemma4's final_logit_softcapping 0
    (logits / 0) used to load and give NaN logits; a softcap of 0 is no softcap only where null is."""
    path = write_tiny_model(tmp_path / arch, arch)
    _edit_config(path, **{field: 0})
    with pytest.raises(ConfigError, match=rf"config\.json: {field}: expected a number above 0, got 0"):
        load_weights_and_config(path)
    _edit_config(path, **{field: None})  # null: the default (eps), or no softcap
    with load_weights_and_config(path):
        pass


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_gptq_and_awq_checkpoints_are_refused_by_their_config(llama: Path, method: str) -> None:
    """A GPTQ/AWQ quantization_config has bits (4) and group_size too, so it passed as MLX's and the
    load failed later on the tensors it could not place (qweight, qzeros, scales)."""
    weights = load_file(str(llama / "model.safetensors"))
    layer = "model.layers.0.self_attn.q_proj"
    out_dim, in_dim = weights.pop(f"{layer}.weight").shape
    weights.update({f"{layer}.qweight": np.zeros((in_dim // 8, out_dim), np.int32),
                    f"{layer}.qzeros": np.zeros((1, out_dim // 8), np.int32),
                    f"{layer}.scales": np.ones((1, out_dim), np.float16)})
    save_file(weights, str(llama / "model.safetensors"))
    _edit_config(llama, quantization_config={"quant_method": method, "bits": 4, "group_size": 64, "sym": True})
    with pytest.raises(ConfigError) as info:
        load_weights_and_config(llama)
    assert str(info.value) == (
        f"{llama / 'config.json'}: quantization_config.quant_method: {method!r} checkpoints are not supported: "
        "only MLX-quantized checkpoints (mlx-lm's 'quantization' entry: affine 'bits' and 'group_size') and "
        "unquantized float16/bfloat16/float32 ones load; convert this one with mlx_lm.convert from its unquantized "
        "original")


@pytest.mark.parametrize("keys", [("quantization", "quantization_config"), ("quantization_config",),
                                  ("quantization",)])
def test_mlx_quantization_loads_under_either_key(tmp_path: Path, keys: tuple[str, ...]) -> None:
    """mlx-lm writes its entry as `quantization` and again as `quantization_config` (no quant_method)."""
    path = write_tiny_model(tmp_path / "q", "llama", quantize_bits=4, group_size=32)
    config = json.loads((path / "config.json").read_text())
    entry = config.pop("quantization", None) or config.pop("quantization_config")
    config.pop("quantization_config", None)
    config.update(dict.fromkeys(keys, entry))
    (path / "config.json").write_text(json.dumps(config))
    with load_weights_and_config(path) as loaded:
        assert (loaded.quant_bits, loaded.quant_group) == (4, 32)


# -- tokenizer files -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def mistral_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("src") / "mistral", "mistral")  # has add_bos_token


def _edit_json(file: Path, **changes: Any) -> None:
    data = json.loads(file.read_text()) if file.exists() else {}
    file.write_text(json.dumps({**data, **changes}))


@pytest.mark.parametrize(("file", "field", "value", "want"), [
    # were ignored: config.json's own eos id alone ended generation, or none did
    ("config.json", "eos_token_id", "2", "a token id or a list of token ids"),
    ("config.json", "eos_token_id", [2, None], "a token id or a list of token ids"),
    ("config.json", "eos_token_id", True, "a token id or a list of token ids"),
    ("config.json", "bos_token_id", -1, "a token id or a list of token ids"),
    ("generation_config.json", "eos_token_id", "2", "a token id or a list of token ids"),
    # transformers refuses it; it used to be ignored (tokenizer_config.json's bos_token won)
    ("special_tokens_map.json", "bos_token", 5, "a token (a string or an object with a string 'content')"),
    ("special_tokens_map.json", "eos_token", {"content": None}, "a token (a string or an object"),
    # used to load without a template (chat then failed naming nothing); transformers fails rendering it
    ("tokenizer_config.json", "chat_template", 5, "a string or a list of {'name', 'template'} strings"),
    ("tokenizer_config.json", "chat_template", ["a", "b"], "a string or a list of {'name', 'template'} strings"),
    ("tokenizer_config.json", "chat_template", [{"name": "default", "template": 5}], "a string or a list of"),
    ("chat_template.json", "chat_template", {"default": "D"}, "a string or a list of"),
])
def test_a_tokenizer_field_of_the_wrong_type_is_named(mistral_source: Path, tmp_path: Path, file: str, field: str,
                                                      value: Any, want: str) -> None:
    path = Path(shutil.copytree(mistral_source, tmp_path / "m"))
    _edit_json(path / file, **{field: value})
    with pytest.raises(TokenizerLoadError) as info:
        Tokenizer(path)
    assert str(info.value).startswith(f"{path / file}: {field}: expected {want}"), str(info.value)


@pytest.mark.parametrize("value", ["false", "true", 0, 1])
def test_add_bos_token_must_be_a_bool_where_it_is_used(mistral_source: Path, tmp_path: Path, value: Any) -> None:
    """Without a post-processor the flags build one: "false" (truthy) used to add a BOS. With one,
    they are ignored, as in transformers 5, whatever they hold."""
    path = Path(shutil.copytree(mistral_source, tmp_path / "m"))
    _edit_json(path / "tokenizer_config.json", add_bos_token=value)
    assert Tokenizer(path).encode("hi")[0] == 1  # the post-processor adds <s>
    _edit_json(path / "tokenizer.json", post_processor=None)
    with pytest.raises(TokenizerLoadError) as info:
        Tokenizer(path)
    assert str(info.value) == (f"{path / 'tokenizer_config.json'}: add_bos_token: expected true or false, "
                               f"got {value!r}")


def test_tolerated_tokenizer_fields_load_as_transformers_has_them(mistral_source: Path, tmp_path: Path) -> None:
    """null ids are unset; tokenizer_config.json's non-token bos_token is ignored (transformers 5
    too), special_tokens_map.json's then gives it."""
    path = Path(shutil.copytree(mistral_source, tmp_path / "m"))
    _edit_json(path / "config.json", eos_token_id=None, bos_token_id=None)
    _edit_json(path / "generation_config.json", eos_token_id=[2])
    _edit_json(path / "tokenizer_config.json", bos_token=5)
    _edit_json(path / "special_tokens_map.json", bos_token="<s>")
    tok = Tokenizer(path)
    assert (tok.bos_token, tok.bos_token_id, tok.eos_token_ids) == ("<s>", 1, frozenset({2}))


@pytest.mark.parametrize("name", ["generation_config.json", "special_tokens_map.json", "chat_template.jinja"])
def test_a_tokenizer_file_that_is_a_directory_is_named(mistral_source: Path, tmp_path: Path, name: str) -> None:
    path = Path(shutil.copytree(mistral_source, tmp_path / "m"))
    if (path / name).exists():
        (path / name).unlink()
    (path / name).mkdir()
    with pytest.raises(UnsafeFileError, match=f"{path / name} is a directory, not a regular file"):
        Tokenizer(path)


def test_a_huge_tokenizer_file_is_refused_unread(mistral_source: Path, tmp_path: Path) -> None:
    path = Path(shutil.copytree(mistral_source, tmp_path / "m"))
    with (path / "generation_config.json").open("r+b") as f:
        f.truncate(JSON_LIMIT + 1)  # sparse: nothing written, nothing read
    with pytest.raises(UnsafeFileError, match=rf"generation_config\.json is {JSON_LIMIT + 1} bytes, more than"):
        Tokenizer(path)

"""The loader's errors name what is wrong (file, tensor, shapes, supported types), and `free()`
gives every byte of the weights back."""
from __future__ import annotations

import gc
import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import pymlxc.core as mx
from pymlxc.backends.metal import nn
from pymlxc.backends.metal.loader import ConfigError, WeightsFileError, load_weights_and_config
from pymlxc.backends.metal.models import UnsupportedModelError, get_model_module, infer_model_type, qwen2, qwen3
from pymlxc.testing import write_tiny_model


@pytest.fixture()
def tiny(tmp_path: Path) -> Path:
    return write_tiny_model(tmp_path / "m", "llama")


def _edit_config(path: Path, **changes: object) -> None:
    config = json.loads((path / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            config.pop(k, None)
        else:
            config[k] = v
    (path / "config.json").write_text(json.dumps(config))


def _edit_weights(path: Path, fn) -> None:  # noqa: ANN001
    file = path / "model.safetensors"
    weights = load_file(str(file))
    fn(weights)
    save_file(weights, str(file))


def test_missing_directory_and_config(tmp_path: Path, tiny: Path) -> None:
    with pytest.raises(FileNotFoundError, match="model directory"):
        load_weights_and_config(tmp_path / "nowhere")
    (tiny / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_weights_and_config(tiny)


def test_a_folder_without_a_model_is_named_by_its_config_not_its_tokenizer(tmp_path: Path, tiny: Path) -> None:
    """load_model of an empty folder (or one holding only a tokenizer) said "tokenizer file not
    found": the folder is no model directory, and the error says so by config.json."""
    import pymlxc

    empty = tmp_path / "empty"
    empty.mkdir()
    (tiny / "config.json").unlink()
    for folder in (empty, tiny):
        with pytest.raises(FileNotFoundError, match=r"config\.json not found in "):
            pymlxc.load_model(str(folder), backend="metal")
    with pytest.raises(FileNotFoundError, match="model directory"):
        pymlxc.load_model(str(tmp_path / "nowhere"), backend="metal")


def test_malformed_config(tiny: Path) -> None:
    (tiny / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"config\.json: not valid JSON"):
        load_weights_and_config(tiny)
    (tiny / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="expected a JSON object"):
        load_weights_and_config(tiny)


def test_config_missing_required_field(tiny: Path) -> None:
    _edit_config(tiny, hidden_size=None)
    with pytest.raises(ConfigError, match=r"config\.json.*hidden_size"):
        load_weights_and_config(tiny)


def test_unknown_model_type_lists_supported(tiny: Path) -> None:
    _edit_config(tiny, model_type="falcon_mamba")
    with pytest.raises(UnsupportedModelError, match="falcon_mamba") as info:
        load_weights_and_config(tiny)
    for name in ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "gemma3_text"):
        assert name in str(info.value)


def test_missing_tensor_is_named(tiny: Path) -> None:
    _edit_weights(tiny, lambda w: w.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(nn.WeightsError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_weights_and_config(tiny)


def test_unexpected_tensor_is_named(tiny: Path) -> None:
    _edit_weights(tiny, lambda w: w.__setitem__("model.layers.0.mlp.extra.weight", np.zeros(3, np.float32)))
    with pytest.raises(nn.WeightsError, match=r"model\.layers\.0\.mlp\.extra\.weight"):
        load_weights_and_config(tiny)


def test_wrong_shape_names_tensor_and_both_shapes(tiny: Path) -> None:
    _edit_weights(tiny, lambda w: w.__setitem__("model.layers.0.self_attn.k_proj.weight", np.zeros((8, 64), np.float32)))
    with pytest.raises(nn.WeightsError, match=r"self_attn\.k_proj\.weight.*\(8, 64\).*\(32, 64\)"):
        load_weights_and_config(tiny)


@pytest.mark.parametrize("cut", [10, 200, 5000])
def test_truncated_safetensors_names_file(tiny: Path, cut: int) -> None:
    file = tiny / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) - cut] if cut > 100 else data[:cut])
    with pytest.raises(WeightsFileError, match=r"model\.safetensors"):
        load_weights_and_config(tiny)


def test_no_weight_files(tiny: Path) -> None:
    (tiny / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"\*\.safetensors"):
        load_weights_and_config(tiny)


def test_shards_from_index_and_other_layouts_ignored(tiny: Path) -> None:
    """Sharded checkpoints load through their index; a second copy of the weights in another
    layout (Mistral's consolidated.safetensors) is not read; a listed shard that is gone is named."""
    weights = load_file(str(tiny / "model.safetensors"))
    (tiny / "model.safetensors").unlink()
    names = sorted(weights)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for file, keys in shards.items():
        save_file({k: weights[k] for k in keys}, str(tiny / file))
    index = {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (tiny / "model.safetensors.index.json").write_text(json.dumps(index))
    save_file({"tok_embeddings.weight": np.zeros((2, 2), np.float32)}, str(tiny / "consolidated.safetensors"))
    with load_weights_and_config(tiny) as loaded:
        assert loaded.num_tensors == len(names)
    (tiny / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(WeightsFileError, match=r"model-00002-of-00002\.safetensors"):
        load_weights_and_config(tiny)


@pytest.mark.parametrize("change", ["group 16", "packed narrower"])
def test_a_quantized_layer_whose_shapes_fit_no_format_is_named(tmp_path: Path, change: str) -> None:
    """A layer's bits and group size are read from its packed weight and scales: scales of 16-value
    groups (which MLX cannot unpack; it failed at the first product) or a packed row that is not a
    whole number of bits per input are refused at load, naming the tensor."""
    path = write_tiny_model(tmp_path / "q", "llama", seed=3, quantize_bits=4, group_size=32)
    layer = "model.layers.0.self_attn.o_proj"

    def edit(w: dict[str, np.ndarray]) -> None:
        if change == "group 16":
            for part in ("scales", "biases"):
                w[f"{layer}.{part}"] = np.repeat(w[f"{layer}.{part}"], 2, axis=1)
        else:
            w[f"{layer}.weight"] = np.ascontiguousarray(w[f"{layer}.weight"][:, :-1])

    _edit_weights(path, edit)
    with pytest.raises(nn.WeightsError, match=f"tensor {layer}.weight: cannot read its quantization"):
        load_weights_and_config(path)


def test_unsupported_quantization_method(tiny: Path) -> None:
    _edit_config(tiny, quantization_config={"quant_method": "gptq", "desc_act": False})
    with pytest.raises(ConfigError, match="gptq"):
        load_weights_and_config(tiny)


def test_qwen2_and_qwen3_told_apart_without_model_type(tmp_path: Path) -> None:
    for arch, module in (("qwen2", qwen2), ("qwen3", qwen3)):
        path = write_tiny_model(tmp_path / arch, arch)
        _edit_config(path, model_type=None, architectures=None)
        with load_weights_and_config(path) as loaded:
            assert loaded.model_type == arch
            assert isinstance(loaded.model, module.Model)
    assert infer_model_type({}, ["model.layers.0.self_attn.q_norm.weight"]) == "qwen3"
    assert get_model_module(None, ["model.layers.0.self_attn.q_proj.bias"]) is qwen2
    with pytest.raises(UnsupportedModelError, match="supported model types"):
        get_model_module(None, ["model.layers.0.mlp.up_proj.weight"])


def test_prefixed_names_resolve(tiny: Path) -> None:
    """Checkpoints that wrap the text model (`language_model.`) or drop `model.` still load."""
    def rename(w: dict) -> None:
        for k in list(w):
            if k.startswith("model.layers.0."):
                w["language_model." + k] = w.pop(k)
            elif k == "model.norm.weight":
                w["norm.weight"] = w.pop(k)
    _edit_weights(tiny, rename)
    with load_weights_and_config(tiny) as loaded:
        assert loaded.num_tensors == 21


def test_progress_reports_bytes(tiny: Path) -> None:
    calls: list[tuple[int, int]] = []
    with load_weights_and_config(tiny, progress=lambda d, t: calls.append((d, t))) as loaded:
        assert calls[0] == (0, loaded.nbytes) and calls[-1] == (loaded.nbytes, loaded.nbytes)
        assert all(a[0] <= b[0] for a, b in zip(calls, calls[1:]))


def test_tied_head_when_lm_head_absent(tiny: Path) -> None:
    """A config that does not say tie_word_embeddings (one that says false and lacks the head is
    refused: tests/reliability/test_checkpoint_loading.py)."""
    _edit_weights(tiny, lambda w: w.pop("lm_head.weight"))
    _edit_config(tiny, tie_word_embeddings=None)
    with load_weights_and_config(tiny) as loaded:
        assert loaded.model.lm_head is None
        assert "lm_head.weight" not in loaded.model.parameters()
        out = loaded.model(mx.array([[20, 21, 22]], mx.int32))
        assert out.shape == (1, 3, 512)


@pytest.mark.parametrize("arch,bits", [("llama", None), ("gemma3", 4)])
def test_free_returns_memory(tmp_path: Path, arch: str, bits: int | None) -> None:
    path = write_tiny_model(tmp_path / "m", arch, quantize_bits=bits)
    gc.collect()
    mx.clear_cache()
    before = mx.get_active_memory()
    loaded = load_weights_and_config(path)
    cache = loaded.model.make_cache(64)
    mx.eval(loaded.model(mx.array([[20, 21, 22, 23]], mx.int32), cache))
    assert mx.get_active_memory() > before + loaded.nbytes // 2
    for c in cache:
        c.free()
    loaded.free()
    loaded.free()  # idempotent
    mx.clear_cache()
    assert mx.get_active_memory() == before
    with pytest.raises(mx.FreedArrayError):
        loaded.model(mx.array([[20]], mx.int32))


@pytest.mark.parametrize("name", ["/etc/passwd", "../outside.safetensors", "sub/../../outside.safetensors",
                                  "", "C:/weights.safetensors", "sub//x.safetensors"])
def test_index_may_not_name_files_outside_the_directory(tiny: Path, name: str) -> None:
    """A weight_map naming an absolute path or one with `..` used to be opened."""
    weights = load_file(str(tiny / "model.safetensors"))
    save_file(weights, str(tiny.parent / "outside.safetensors"))  # there, loadable: it must not be read
    index = {"weight_map": {k: "model.safetensors" for k in weights}}
    index["weight_map"]["model.norm.weight"] = name
    (tiny / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(WeightsFileError, match=r"index\.json: weight_map names .*not a file inside the model"):
        load_weights_and_config(tiny)


def test_index_in_a_subdirectory_and_through_links_loads(tiny: Path, tmp_path: Path) -> None:
    """Links the directory holds are followed (the Hugging Face cache links every file to a blob)."""
    blob = tmp_path / "blobs" / "abc123"
    blob.parent.mkdir()
    (tiny / "model.safetensors").rename(blob)
    (tiny / "shards").mkdir()
    (tiny / "shards" / "model.safetensors").symlink_to(blob)
    names = load_file(str(blob))
    index = {"weight_map": dict.fromkeys(names, "shards/model.safetensors")}
    (tiny / "model.safetensors.index.json").write_text(json.dumps(index))
    with load_weights_and_config(tiny) as loaded:
        assert loaded.num_tensors == len(names)


@pytest.mark.parametrize("index", ["[1]", '{"weight_map": [1]}', '{"weight_map": {"a": 3}}', "{"])
def test_malformed_index_names_the_file(tiny: Path, index: str) -> None:
    (tiny / "model.safetensors.index.json").write_text(index)
    with pytest.raises(WeightsFileError, match=r"model\.safetensors\.index\.json"):
        load_weights_and_config(tiny)

"""config.json is checked before anything is built from it: each field's type and range, the RoPE
entries, the fields that must agree with each other and with the checkpoint's tensors. Errors are
`ConfigError`s naming the file and the field. Also: the checkpoint's dtypes and declared
quantization, the tokenizer's ids against the embedding, and text the tokenizer cannot take."""
from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import load_file, save_file

import pymlxc
from pymlxc.backends.metal import check_vocab
from pymlxc.backends.metal.config_check import MAX_DIM, check_params
from pymlxc.backends.metal.loader import ConfigError, WeightsFileError, load_weights_and_config
from pymlxc.backends.metal.models import MODEL_TYPES, gemma3, llama
from pymlxc.backends.metal.tokenizer import Tokenizer, TokenizerLoadError
from pymlxc.testing import write_tiny_model


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("src") / "m", "llama")


@pytest.fixture()
def tiny(source: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(source, tmp_path / "m"))


def _edit_config(path: Path, **changes: Any) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def _config_error(path: Path, field: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_weights_and_config(path)
    message = str(info.value)
    assert message.startswith(str(path / "config.json")), message
    assert field in message, message
    return message


# -- item 12: layer_types ---------------------------------------------------------------------------

@pytest.mark.parametrize("types", [["full_attention"], ["full_attention"] * 3, []])
def test_layer_types_of_the_wrong_length(tiny: Path, types: list[str]) -> None:
    """A shorter list used to drop layers silently (zip), while info() still counted them all."""
    _edit_config(tiny, layer_types=types, sliding_window=8)
    assert f"{len(types)} entries for num_hidden_layers 2" in _config_error(tiny, "layer_types")


def test_unknown_layer_type(tiny: Path) -> None:
    _edit_config(tiny, layer_types=["full_attention", "linear_attention"])
    assert "linear_attention" in _config_error(tiny, "layer_types")


def test_layer_types_of_the_right_length_load(tiny: Path) -> None:
    _edit_config(tiny, layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    with load_weights_and_config(tiny) as loaded:
        assert loaded.model.layer_windows() == [8, None]


# -- item 18: types and ranges ----------------------------------------------------------------------

SIZE_FIELDS = ["hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads", "vocab_size",
               "head_dim", "num_key_value_heads", "max_position_embeddings"]


@pytest.mark.parametrize("field", SIZE_FIELDS)
@pytest.mark.parametrize("value", [10**12, -1, 0, 2.5, "64", True, [64]])
def test_sizes_out_of_range_or_of_the_wrong_type(tiny: Path, field: str, value: Any) -> None:
    _edit_config(tiny, **{field: value})
    _config_error(tiny, field)


@pytest.mark.parametrize(("field", "value"), [
    ("rms_norm_eps", "x"), ("rms_norm_eps", -1e-5), ("rms_norm_eps", float("inf")), ("rope_theta", 0),
    ("rope_theta", "1e4"), ("attention_bias", "false"), ("tie_word_embeddings", 1), ("model_type", 3),
    ("sliding_window", -4), ("layer_types", "full_attention"),
])
def test_other_fields_of_the_wrong_type(tiny: Path, field: str, value: Any) -> None:
    _edit_config(tiny, **{field: value})
    _config_error(tiny, field)


def test_integral_floats_are_taken(tiny: Path) -> None:
    """4096.0 is 4096: some exporters write sizes as floats."""
    _edit_config(tiny, hidden_size=64.0, max_position_embeddings=4096.0)
    with load_weights_and_config(tiny) as loaded:
        assert loaded.model.args.hidden_size == 64 and isinstance(loaded.model.args.hidden_size, int)


def test_null_means_the_default_where_the_field_has_one() -> None:
    """transformers writes null for unset fields: a field with a default takes it, a required one is named."""
    assert gemma3.ModelArgs.from_dict({"sliding_window_pattern": None}).sliding_window_pattern == 6
    with pytest.raises(ConfigError, match="hidden_size: expected an integer, got None"):
        llama.ModelArgs.from_dict({**LLAMA, "hidden_size": None})


@pytest.mark.parametrize(("scaling", "field"), [
    ({"rope_type": "llama3"}, "rope_scaling.factor"),
    ({"type": "linear"}, "rope_scaling.factor"),
    ({"rope_type": "linear", "factor": "2"}, "rope_scaling.factor"),
    ({"rope_type": "linear", "factor": 0}, "rope_scaling.factor"),
    ({"rope_type": "llama3", "factor": 8, "low_freq_factor": 2, "high_freq_factor": 2}, "low_freq_factor"),
    ({"rope_type": 3, "factor": 2}, "rope_scaling.rope_type"),
    ([8.0], "rope_scaling"),
    ("linear", "rope_scaling"),
])
def test_rope_scaling(tiny: Path, scaling: Any, field: str) -> None:
    _edit_config(tiny, rope_scaling=scaling)
    _config_error(tiny, field)


def test_rope_parameters_nested_and_flat(tiny: Path) -> None:
    _edit_config(tiny, rope_parameters={"rope_theta": "x"})
    _config_error(tiny, "rope_parameters.rope_theta")
    _edit_config(tiny, rope_parameters={"full_attention": [1]})
    _config_error(tiny, "rope_parameters.full_attention")


def test_deep_nesting(tiny: Path) -> None:
    (tiny / "config.json").write_text('{"model_type": "llama", "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    assert "nested too deeply" in _config_error(tiny, "not valid JSON")


def test_heads_must_divide(tiny: Path) -> None:
    _edit_config(tiny, num_key_value_heads=3)
    _config_error(tiny, "num_key_value_heads")


def test_sizes_that_multiply_past_mlx_shapes(tiny: Path) -> None:
    """Each field in range, their product (heads * head_dim) past 32 bits: used to be OverflowError."""
    _edit_config(tiny, head_dim=MAX_DIM)
    _config_error(tiny, "cannot build a llama model")


def test_text_config_fields_are_named_with_their_prefix(tmp_path: Path) -> None:
    path = write_tiny_model(tmp_path / "g", "gemma3")
    config = json.loads((path / "config.json").read_text())
    config["text_config"]["num_hidden_layers"] = -2
    (path / "config.json").write_text(json.dumps(config))
    _config_error(path, "text_config.num_hidden_layers")
    config["text_config"] = [1]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"config\.json"):
        load_weights_and_config(path)


# -- item 18: agreement with the checkpoint ---------------------------------------------------------

@pytest.mark.parametrize("layers", [1, 3, 10**5])
def test_num_hidden_layers_must_match_the_checkpoint(tiny: Path, layers: int) -> None:
    """10**5 layers used to be allocated (3 GB) before the checkpoint's 2 layers were noticed."""
    _edit_config(tiny, num_hidden_layers=layers)
    assert "the checkpoint's tensors hold 2 layers" in _config_error(tiny, "num_hidden_layers")


def test_checkpoint_without_layers(tiny: Path) -> None:
    file = tiny / "model.safetensors"
    save_file({k: v for k, v in load_file(str(file)).items() if ".layers." not in k}, str(file))
    _edit_config(tiny, num_hidden_layers=10**5)
    assert "no layer tensors" in _config_error(tiny, "num_hidden_layers")


@pytest.mark.parametrize(("field", "value"), [("vocab_size", 513), ("hidden_size", 128)])
def test_embedding_must_match_the_checkpoint(tiny: Path, field: str, value: int) -> None:
    _edit_config(tiny, **{field: value}, head_dim=16)
    assert "model.embed_tokens.weight" in _config_error(tiny, field)


def test_float_weight_stored_as_integers(tiny: Path) -> None:
    file = tiny / "model.safetensors"
    weights = load_file(str(file))
    weights["model.norm.weight"] = weights["model.norm.weight"].view(np.int32)
    save_file(weights, str(file))
    with pytest.raises(WeightsFileError, match=r"'model\.norm\.weight' in .*model\.safetensors is stored as int32"):
        load_weights_and_config(tiny)


@pytest.mark.parametrize(("quant", "field"), [
    ({"bits": 1000, "group_size": 64}, "quantization.bits"),
    ({"bits": 4, "group_size": 7}, "quantization.group_size"),
    ({"bits": True, "group_size": 64}, "quantization.bits"),
    ({"bits": 4, "group_size": 64, "model.layers.0.mlp.up_proj": {"bits": 9}}, "quantization.model.layers.0"),
    ({"bits": 4, "group_size": 64}, "not quantized"),  # valid values, but a dense checkpoint
])
def test_quantization_of_a_dense_checkpoint(tiny: Path, quant: dict[str, Any], field: str) -> None:
    """bits=1000 on a dense model used to load and be reported by info()."""
    _edit_config(tiny, quantization=quant)
    _config_error(tiny, field)


def test_quantized_checkpoint_reports_its_bits(tmp_path: Path) -> None:
    path = write_tiny_model(tmp_path / "q", "llama", quantize_bits=4)
    with load_weights_and_config(path) as loaded:
        assert (loaded.quant_bits, loaded.quant_group) == (4, 32)


# -- the shared validator on every architecture ------------------------------------------------------

def test_every_architecture_takes_its_tiny_config(tmp_path: Path) -> None:
    for arch in sorted(set(MODEL_TYPES) - {"mistral"}):
        path = write_tiny_model(tmp_path / arch, arch)
        config = json.loads((path / "config.json").read_text())
        MODEL_TYPES[arch].ModelArgs.from_dict(config)  # valid: no error
        bad = dict(config)
        target = bad["text_config"] if isinstance(bad.get("text_config"), dict) else bad
        target["rms_norm_eps"] = "x"
        with pytest.raises(ConfigError, match="rms_norm_eps"):
            MODEL_TYPES[arch].ModelArgs.from_dict(bad)


LLAMA = {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128, "num_attention_heads": 4,
         "vocab_size": 512}


@settings(max_examples=200, deadline=None)
@given(field=st.sampled_from([*sorted(LLAMA), "head_dim", "num_key_value_heads", "rms_norm_eps", "rope_theta",
                              "sliding_window", "rope_scaling", "layer_types", "attention_bias"]),
       value=st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40), st.floats(), st.text(max_size=4),
                       st.lists(st.integers(0, 3), max_size=3),
                       st.dictionaries(st.sampled_from(["factor", "rope_type", "type", "low_freq_factor"]),
                                       st.one_of(st.floats(), st.text(max_size=6), st.integers()), max_size=3)))
def test_any_value_is_taken_or_refused_by_name(field: str, value: Any) -> None:
    """Whatever a field holds, from_dict either gives arguments whose values have the declared types
    and ranges, or raises a ConfigError that names the field; nothing else escapes."""
    try:
        args = llama.ModelArgs.from_dict({**LLAMA, field: value})
    except ConfigError as exc:
        assert field in str(exc) or "head" in str(exc)  # heads that do not divide name both fields
        return
    for name in SIZE_FIELDS:
        v = getattr(args, name)
        assert v is None or (type(v) is int and 1 <= v <= MAX_DIM)
    assert isinstance(args.rms_norm_eps, float) and args.rms_norm_eps >= 0
    assert args.layer_types is None or len(args.layer_types) == args.num_hidden_layers


def test_check_params_keeps_unknown_keys_out() -> None:
    kwargs = check_params(gemma3.ModelArgs, {"hidden_size": 64, "torch_dtype": "float32", "foo": [1]})
    assert kwargs == {"hidden_size": 64}


# -- the tokenizer: its ids against the embedding (item 2), and text it cannot take ------------------

def _add_tokens(path: Path, vocab: dict[str, int] | None = None, added: dict[str, int] | None = None) -> None:
    data = json.loads((path / "tokenizer.json").read_text())
    data["model"]["vocab"].update(vocab or {})
    for text, i in (added or {}).items():
        data["added_tokens"].append({"id": i, "content": text, "single_word": False, "lstrip": False,
                                     "rstrip": False, "normalized": False, "special": True})
    (path / "tokenizer.json").write_text(json.dumps(data))


def test_added_tokens_past_the_embedding_warn(tiny: Path) -> None:
    _add_tokens(tiny, added={"<pad>": 512, "<extra>": 513})
    with pytest.warns(UserWarning, match=r"2 added tokens past the model's 512 embedding rows: '<pad>' \(512\)"):
        model = pymlxc.load_model(str(tiny))
    with model:
        assert model.info().vocab_size == 512


def test_base_vocabulary_past_the_embedding_is_an_error(tiny: Path) -> None:
    _add_tokens(tiny, vocab={"zzq": 600})
    with pytest.raises(TokenizerLoadError, match=r"tokenizer\.json: the tokenizer's vocabulary has ids up to 600, "
                                                  r"but the model embeds only 512"):
        pymlxc.load_model(str(tiny))


def test_tokenizer_within_the_embedding_is_quiet(tiny: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_vocab(Tokenizer(tiny), llama.ModelArgs.from_dict(LLAMA), "t")


def test_lone_surrogate_in_text(tiny: Path) -> None:
    """Used to raise TypeError: TextInputSequence must be str."""
    tokenizer = Tokenizer(tiny)
    with pytest.raises(ValueError, match=r"not valid Unicode: surrogates not allowed at index 3"):
        tokenizer.encode("abc\ud800def")
    assert tokenizer.decode(tokenizer.encode("abc def", add_special_tokens=False)) == "abc def"


@settings(max_examples=50, deadline=None)
@given(value=st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.binary(max_size=4),
                       st.lists(st.text(max_size=3), max_size=2),
                       st.dictionaries(st.text(max_size=2), st.text(max_size=2), max_size=2)))
def test_text_that_is_no_str_is_named(source: Path, value: Any) -> None:
    """Used to raise tokenizers' TypeError "TextInputSequence must be str", naming neither the
    argument nor what it takes (`Tokenizer.encode`, and `encode` of a loaded model through it)."""
    with pytest.raises(TypeError, match=f"^text must be a str, not {type(value).__name__}$"):
        Tokenizer(source).encode(value)

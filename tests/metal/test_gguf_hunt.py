"""GGUF files that loaded silently wrong or failed without naming the file: integer keys holding a
float NaN or infinity (a bare ValueError or OverflowError from int()), a tensor offset near 2^64
that the reader's uint64 sum wraps back into the metadata (loaded as weights), and a Gemma 2 file
with an output head of its own (dropped, the logits computed with the token embedding)."""
from __future__ import annotations

import struct
import warnings
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as VT
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pymlxc.backends.metal.formats.gguf import GGUFError, describe_gguf, read_gguf
from pymlxc.backends.metal.loader import load_gguf_model, load_weights_and_config
from pymlxc.testing import write_tiny_model

from .gguf_export import export_gguf
from .test_gguf_hostile import Tensors, rewrite


@pytest.fixture(autouse=True)
def _quiet() -> None:
    warnings.simplefilter("ignore", DeprecationWarning)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hunt")
    out = {}
    for arch in ("llama", "gemma2"):
        (root / arch).mkdir()
        out[arch] = export_gguf(write_tiny_model(root / f"{arch}-src", arch, seed=5), root / arch / f"{arch}.gguf",
                                Q.F32)
    return out


# ---------------------------------------------------------------------- integer keys as floats

@pytest.mark.parametrize("key", ["llama.context_length", "llama.block_count", "llama.attention.head_count_kv"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_an_integer_key_holding_nan_or_infinity_is_refused_by_name(key: str, value: float, files: dict[str, Path],
                                                                   tmp_path: Path) -> None:
    """Was a bare ValueError ("cannot convert float NaN to integer") or OverflowError, naming
    neither the file nor the key."""
    path = rewrite(files["llama"], tmp_path / "m.gguf", {key: value})
    with pytest.raises(GGUFError, match=rf"{key} must be a non-negative integer, got -?(nan|inf)") as info:
        load_gguf_model(path)
    assert str(path) in str(info.value)


def test_a_per_layer_list_of_nan_is_refused_by_name(files: dict[str, Path], tmp_path: Path) -> None:
    path = rewrite(files["llama"], tmp_path / "m.gguf", {"llama.block_count": [float("nan")]})
    with pytest.raises(GGUFError, match=r"llama\.block_count must be a non-negative integer, got nan"):
        load_gguf_model(path)


# ---------------------------------------------------------------------- tensor offsets

def _offset_position(reader: gguf.GGUFReader, index: int) -> int:
    t = reader.tensors[index]  # its info: name, n_dims, dims, type, then the offset
    return t.field.offset + 8 + len(t.name.encode()) + 4 + 8 * len(t.shape) + 4


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(back=st.integers(min_value=1, max_value=400), which=st.sampled_from(["blk.0.attn_norm.weight",
                                                                            "output_norm.weight"]))
def test_a_tensor_offset_that_wraps_past_2_64_is_refused(back: int, which: str, files: dict[str, Path],
                                                         tmp_path_factory: pytest.TempPathFactory) -> None:
    """An offset of 2^64 - 32 k: the reader's start + offset wraps in uint64 to k * 32 bytes before
    the data section, inside the metadata and tensor infos, which then loaded as that tensor's
    values (or, where that range met another tensor's, was called an overlap of the two)."""
    src = files["llama"]
    reader = gguf.GGUFReader(src)
    index = next(i for i, t in enumerate(reader.tensors) if t.name == which)
    back = min(back, int(reader.data_offset) // 32)  # keep the wrapped start inside the file
    data = bytearray(src.read_bytes())
    struct.pack_into("<Q", data, _offset_position(reader, index), (1 << 64) - 32 * back)
    path = tmp_path_factory.mktemp("wrap") / "m.gguf"
    path.write_bytes(bytes(data))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # numpy's overflow warning is no answer either
        for load in (read_gguf, describe_gguf):
            with pytest.raises(GGUFError, match=rf"truncated or corrupt: tensor '{which}' needs bytes") as info:
                load(path)
            assert str(path) in str(info.value)


# ---------------------------------------------------------------------- tied output heads

def test_a_gemma2_output_head_of_its_own_is_refused(files: dict[str, Path], tmp_path: Path) -> None:
    """Gemma 2's model ties its head to the embedding: the file's output.weight was dropped and the
    logits silently computed with token_embd.weight."""
    src = files["gemma2"]

    def with_head(ts: Tensors) -> Tensors:
        _name, data, shape, qtype = next(t for t in ts if t[0] == "token_embd.weight")
        head = np.random.default_rng(0).standard_normal(np.asarray(data).shape).astype(np.float32)
        return [*ts, ("output.weight", head, shape, qtype)]

    path = rewrite(src, tmp_path / "m.gguf", tensors=with_head)
    with (pytest.raises(GGUFError, match=r"tensor output\.weight has no place in a gemma2 model") as info,
          load_weights_and_config(path)):
        pass
    assert str(path) in str(info.value)
    with load_weights_and_config(src):  # the converter's file, tied, loads
        pass


def test_float_typed_integer_keys_still_load(files: dict[str, Path], tmp_path: Path) -> None:
    """A whole number in a FLOAT32 key is read as that integer, as before."""
    path = rewrite(files["llama"], tmp_path / "m.gguf", {"llama.context_length": (256.0, VT.FLOAT32)})
    with load_weights_and_config(path) as loaded:
        assert loaded.config["max_position_embeddings"] == 256

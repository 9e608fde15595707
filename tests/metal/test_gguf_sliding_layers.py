"""gguf_config._sliding_layers, the sliding-window pattern Gemma 3 and Gemma 4 GGUF files share:
a per-layer list or a period (default when absent), read from a real GGUF file."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pymlxc.backends.metal.formats.gguf_config import GGUFError, _sliding_layers

KEY = "gemma3.attention.sliding_window_pattern"


def _reader(path: Path, pattern: int | list[bool] | None) -> gguf.GGUFReader:
    w = gguf.GGUFWriter(str(path), "gemma3")
    if isinstance(pattern, list):
        w.add_array(KEY, pattern)
    elif pattern is not None:
        w.add_uint32(KEY, pattern)
    w.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    for step in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        step()
    return gguf.GGUFReader(str(path))


@settings(max_examples=20, deadline=None)
@given(layers=st.integers(1, 24), period=st.one_of(st.none(), st.integers(0, 8)), default=st.integers(1, 8))
def test_period_makes_every_last_layer_global(tmp_path_factory: pytest.TempPathFactory, layers: int,
                                              period: int | None, default: int) -> None:
    reader = _reader(tmp_path_factory.mktemp("g") / "m.gguf", period)
    used = period if period else default  # absent or 0: the default period
    sliding, got_period = _sliding_layers(reader, KEY, layers, default)
    assert got_period == used
    assert [i for i in range(layers) if not sliding[i]] == list(range(used - 1, layers, used))


def test_list_gives_each_layer_and_no_period(tmp_path: Path) -> None:
    pattern = [True, True, False, True, False]
    assert _sliding_layers(_reader(tmp_path / "m.gguf", pattern), KEY, 5, 6) == (pattern, None)
    with pytest.raises(GGUFError, match=rf"{KEY} has 5 entries for 4 layers"):
        _sliding_layers(_reader(tmp_path / "n.gguf", pattern), KEY, 4, 6)


@pytest.mark.parametrize("value,kind", [(True, gguf.GGUFValueType.BOOL), ("6", gguf.GGUFValueType.STRING),
                                        (6.0, gguf.GGUFValueType.FLOAT32), ([1, 0, 1, 1], None)])
def test_a_pattern_of_another_type_is_refused(tmp_path: Path, value: object, kind: gguf.GGUFValueType | None) -> None:
    """Was read as a default period (a string, a float), as period 1 (true: every layer global) or
    as booleans (a list of integers)."""
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "gemma3")
    if kind is None:
        w.add_array(KEY, value)  # type: ignore[arg-type]
    else:
        w.add_key_value(KEY, value, kind)
    w.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    for step in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        step()
    with pytest.raises(GGUFError, match=rf"{KEY} must be (a period|one boolean per layer)"):
        _sliding_layers(gguf.GGUFReader(str(tmp_path / "m.gguf")), KEY, 4, 6)

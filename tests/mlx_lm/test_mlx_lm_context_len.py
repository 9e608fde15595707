"""The `context_len` load option bounds the mlx_lm backend's KV caches as it bounds the metal backend's.

mlx-lm applies `max_kv_size` only to models without their own `make_cache`; llama, gemma 4 and
qwen3-next have one, so through the library their caches kept every token whatever context_len said.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

import pymlxc
from pymlxc.backends.mlx_lm import MlxLmBackend
from pymlxc.options import LoadConfig
from pymlxc.testing import write_tiny_model

pytest.importorskip("mlx_lm")

CONTEXT = 16
PROMPT = "The baker counted the coins"  # shorter than CONTEXT: both backends prefill it alike
TOKENS = 32  # well past CONTEXT: the caches rotate while decoding


def _ids(model: pymlxc.TextModel, prompt: str = PROMPT) -> list[int]:
    out = [t.id for t in model.generate(prompt, max_tokens=TOKENS)]
    assert model.err() is None, model.err()
    return out


# llama: every layer full attention; gemma4_text: sliding-window layers (their window fits), full
# attention ones and a KV-shared tail; qwen3_next: recurrent layers between attention ones.
@pytest.mark.parametrize("arch", ["llama", "gemma4_text", "qwen3_next"])
def test_context_len_bounds_generation_as_the_metal_backend_does(tmp_path: Path, arch: str) -> None:
    path = str(write_tiny_model(tmp_path / arch, arch, seed=0))
    backend = MlxLmBackend(sys.executable, response_timeout=60.0, load_timeout=120.0)
    with backend.load(path, LoadConfig(context_len=CONTEXT)) as bounded:
        assert len(bounded.encode(PROMPT)) < CONTEXT
        ours = _ids(bounded)
        unbounded = backend.load(path, LoadConfig())  # the default context_len: far past these tokens
        with unbounded:
            assert ours != _ids(unbounded)
    with pymlxc.load_model(path, backend="metal", context_len=CONTEXT) as metal:
        assert ours == _ids(metal)

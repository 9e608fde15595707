"""Checkpoints whose layers differ in bit width (mlx-lm's mixed recipes: 6-bit value and down
projections among 4-bit ones, some layers left dense), through the public API in child processes.
The compiled prefill once multiplied one block's packed weights as another's: an illegal memory
access that ended the process on an H100, wrong tokens on a CPU. Here a crash or a hang fails one
test, and the compiled path must give the uncompiled loop's tokens, alone and in a batch."""
from __future__ import annotations

from pathlib import Path

import pytest

from pymlxc.testing import shapes

from .subproc import run_case

GENERATE = """
import pymlxc
with pymlxc.load_model({path!r}, backend="metal") as m:
    prompts = ["one two three four five six seven eight nine ten", "a b c"]
    alone = [[t.id for t in m.generate(p, max_tokens=12, temperature=0.0)] for p in prompts]
    batch = [[t.id for t in r.tokens] for r in m.batch_generate(prompts, max_tokens=12, temperature=0.0)]
report({{"alone": alone, "batch": batch}})
"""


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    bits = {f"model.layers.{i}.{m}": 6 for i in (0, 2) for m in ("self_attn.v_proj", "mlp.down_proj")}
    bits["model.layers.1.mlp.gate_proj"] = 8
    bits["model.layers.3.mlp.up_proj"] = 0  # dense, as mlx-lm's predicates leave some layers
    path = shapes.write_random_model(tmp_path_factory.mktemp("mixed") / "m", "llama-3.2-1b-narrow", bits=4,
                                     layers=4, module_bits=bits)
    shapes.write_byte_tokenizer(path, shapes.shape_config("llama-3.2-1b-narrow"))
    return path


def test_a_mixed_checkpoint_generates_the_uncompiled_tokens(mixed: Path) -> None:
    # 600 s: a GPU machine's first run compiles this shape's kernels and runs their checks.
    compiled = run_case(GENERATE.format(path=str(mixed)), timeout=600, env={"PYMLXC_COMPILE": "1"})
    plain = run_case(GENERATE.format(path=str(mixed)), timeout=600, env={"PYMLXC_COMPILE": "0"})
    assert all(len(ids) == 12 for ids in plain["alone"])
    assert compiled["alone"] == plain["alone"]
    assert compiled["batch"] == plain["batch"] == plain["alone"]

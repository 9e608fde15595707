"""compare_mlx_lm.py's --shape-json: shapes outside the built-in set, checked, and named in the
command that reproduces a result."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import compare_mlx_lm  # noqa: E402

from pymlxc.testing.shapes import SHAPES, shape_config  # noqa: E402


def test_the_repo_shapes_register_and_reproduce() -> None:
    path = ROOT / "benchmarks" / "shapes_cpu.json"
    args = compare_mlx_lm.parse_args(["--shape-json", str(path), "--shapes", "llama-h512-i128-v400", "--cpu"])
    config = shape_config("llama-h512-i128-v400")
    assert (config["hidden_size"], config["intermediate_size"], config["vocab_size"]) == (512, 128, 400)
    assert config["rope_scaling"]["rope_type"] == "llama3" and config["tie_word_embeddings"] is False
    assert args.shapes == ["llama-h512-i128-v400"]
    settings = {"prompt_lengths": [33], "max_tokens": 128, "runs": 5, "cpu": True, "shape_json": [str(path)]}
    command = compare_mlx_lm.reproduce_command(settings, {"shape": "llama-h512-i128-v400", "quant": "f32"})
    assert command.startswith("python benchmarks/compare_mlx_lm.py --shapes llama-h512-i128-v400 ")
    assert command.endswith(f"--shape-json {path}")
    # The command parses back to the same case.
    again = compare_mlx_lm.parse_args(command.split()[2:])
    assert again.shapes == ["llama-h512-i128-v400"] and again.prompt_lengths == [33] and again.cpu


@pytest.mark.parametrize("content, message", [
    ("not json", "shape-json"),
    ('["a list"]', "expected an object"),
    ('{"s": {"base": "no-such-shape"}}', "unknown base"),
    ('{"s": {"model_type": "llama"}}', "lacks hidden_size"),
])
def test_bad_shape_files_name_the_problem(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "shapes.json"
    path.write_text(content)
    with pytest.raises(SystemExit, match=message):
        compare_mlx_lm.add_shapes_from_json([path])
    assert "s" not in SHAPES


def test_missing_shape_file(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"missing\.json"):
        compare_mlx_lm.add_shapes_from_json([tmp_path / "missing.json"])
    json.dumps(SHAPES)  # the registry stays plain data

""".ci/typecheck: the list of checked paths is read strictly, and mypy's tree maps back to the sources."""
from __future__ import annotations

import importlib.machinery
import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _script() -> ModuleType:
    loader = importlib.machinery.SourceFileLoader("ci_typecheck", str(ROOT / ".ci" / "typecheck"))
    spec = importlib.util.spec_from_loader("ci_typecheck", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def test_the_committed_list_names_existing_paths_mypy_can_map() -> None:
    script = _script()
    sections = script.read_paths()
    assert sections["ruff"] and sections["mypy"]
    for path in sections["mypy"]:  # tree_path refuses (SystemExit) a path outside the three packages
        assert script.source_path(script.tree_path(path)) == path


@pytest.mark.parametrize("text, message", [
    ("pymlxc/cli.py\n", r"typed-paths:1: pymlxc/cli.py is outside a \[ruff\] or \[mypy\] section"),
    ("[ruff]\npymlxc/nothing.py\n[mypy]\npymlxc/cli.py\n", r"typed-paths:2: no such path: pymlxc/nothing\.py"),
    ("[lint]\npymlxc/cli.py\n", r"typed-paths:1: unknown section \[lint\]"),
    ("[ruff]\npymlxc/cli.py\n", r"typed-paths: the \[mypy\] section lists no path"),
])
def test_a_bad_list_is_refused_by_line(tmp_path: Path, text: str, message: str) -> None:
    listing = tmp_path / "typed-paths"
    listing.write_text(text)
    with pytest.raises(SystemExit, match=message):
        _script().read_paths(listing)


def test_tree_paths_map_back_to_the_source() -> None:
    script = _script()
    for source in ("backends/mlx_lm/backend.py", "bridge/engine.py", "pymlxc/hub.py"):
        message = f"{script.tree_path(source)}:3: error: something  [misc]"
        assert script.source_path(message) == f"{source}:3: error: something  [misc]"
    with pytest.raises(SystemExit, match="mypy checks only"):
        script.tree_path("tests/test_hub.py")


def test_a_lint_regression_fails_the_script(tmp_path: Path) -> None:
    """A list naming a file with an unused import: the script exits 1 and ruff names the file and rule."""
    probe = ROOT / "build" / "typecheck-probe"
    probe.mkdir(parents=True, exist_ok=True)
    (probe / "bad.py").write_text("import os\n")
    listing = tmp_path / "typed-paths"
    listing.write_text("[ruff]\nbuild/typecheck-probe/bad.py\n[mypy]\npymlxc/types.py\n")
    done = subprocess.run([sys.executable, str(ROOT / ".ci" / "typecheck"), str(listing)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "F401" in done.stdout and "bad.py" in done.stdout
    assert "Success: no issues found in 1 source file" in done.stdout  # mypy ran on the one path

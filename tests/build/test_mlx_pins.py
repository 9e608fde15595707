"""MLX is pinned to one exact release in every requirement of pyproject.toml (build isolation builds
libmlxc against the build environment's MLX, and the loader refuses any other release at run time)."""
from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import build_mlxc

PYPROJECT = """\
[build-system]
requires = ["setuptools>=70.1", {build}]

[project]
name = "x"
dependencies = ["numpy>=1.24", {run}, "mlx-lm>=0.32.2"]

[project.optional-dependencies]
cpu = [{extra}]
"""

versions = st.tuples(*[st.integers(0, 99)] * 3).map(lambda v: ".".join(map(str, v)))


def _write(tmp_path: Path, build: str, run: str, extra: str) -> Path:
    path = tmp_path / "pyproject.toml"
    path.write_text(PYPROJECT.format(build=f'"{build}"', run=f'"{run}"', extra=f'"{extra}"'))
    return path


def test_the_project_pins_one_release_everywhere_and_runs_with_it() -> None:
    pins = build_mlxc.mlx_pins()
    where = " ".join(pins)
    assert "[build-system] requires" in where and "[project] dependencies" in where
    assert "optional-dependencies] cpu" in where and "optional-dependencies] cuda13" in where
    assert build_mlxc.pinned_mlx_version() == importlib.metadata.version("mlx")


@given(version=versions)
def test_exact_pins_with_extras_and_markers_are_read(tmp_path_factory: pytest.TempPathFactory, version: str) -> None:
    path = _write(tmp_path_factory.mktemp("p"), f"mlx[cpu]=={version}; sys_platform == 'linux'",
                  f"mlx=={version}", f"mlx[cuda13] == {version}")
    assert build_mlxc.pinned_mlx_version(path) == version
    assert len(build_mlxc.mlx_pins(path)) == 3, "mlx-lm is another package, not a pin of mlx"


@given(version=versions, op=st.sampled_from([">=", "~=", "<=", "!=", ">", "<", "==="]))
def test_a_range_is_refused_naming_where(tmp_path_factory: pytest.TempPathFactory, version: str, op: str) -> None:
    path = _write(tmp_path_factory.mktemp("p"), f"mlx=={version}", f"mlx{op}{version}", f"mlx=={version}")
    with pytest.raises(build_mlxc.BuildError, match=r"\[project\] dependencies.*pinned exactly"):
        build_mlxc.mlx_pins(path)


def test_disagreeing_pins_are_listed(tmp_path: Path) -> None:
    path = _write(tmp_path, "mlx==0.32.4", "mlx==0.32.3", "mlx[cpu]==0.32.4")
    with pytest.raises(build_mlxc.BuildError, match=r"one MLX release.*0\.32\.3.*") as info:
        build_mlxc.pinned_mlx_version(path)
    assert "[build-system] requires: mlx==0.32.4 -> 0.32.4" in str(info.value)


def test_no_pin_at_all_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "pyproject.toml"
    path.write_text('[project]\nname = "x"\ndependencies = ["numpy"]\n')
    with pytest.raises(build_mlxc.BuildError, match="found: none"):
        build_mlxc.pinned_mlx_version(path)


def test_an_unreadable_pyproject_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "pyproject.toml"
    path.write_text("[project\n")
    with pytest.raises(build_mlxc.BuildError, match="cannot read the MLX pins from .*pyproject.toml"):
        build_mlxc.mlx_pins(path)


def test_building_against_another_mlx_says_which_to_install(tmp_path: Path) -> None:
    with pytest.raises(build_mlxc.BuildError) as info:
        build_mlxc.check_mlx_version("0.31.2", "0.32.4", tmp_path)
    message = str(info.value)
    assert "MLX 0.31.2 is installed" in message and "mlx[cpu]==0.32.4" in message and "mlx[cuda13]==0.32.4" in message
    build_mlxc.check_mlx_version("0.32.4", "0.32.4", tmp_path)  # the pinned release passes

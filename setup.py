"""setuptools hook: `pip install` builds libmlxc and the cffi declarations with build_mlxc.py."""
from __future__ import annotations

import sys
from pathlib import Path

from setuptools import Distribution, find_packages, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_py import build_py

sys.path.insert(0, str(Path(__file__).resolve().parent))
import build_mlxc  # noqa: E402


class BuildPyWithMlxc(build_py):
    def run(self) -> None:
        try:
            if getattr(self, "editable_mode", False):
                # Editable installs import from the source tree, so the library goes there (kept
                # when its stamp already matches this MLX).
                build_mlxc.build(output=build_mlxc.DEFAULT_OUTPUT)
                super().run()
            else:
                # A wheel gets a library built now against the build environment's MLX; built after
                # the package data is copied, so a source tree's own pymlxc/_lib never stands in.
                super().run()
                build_mlxc.build(output=Path(self.build_lib) / "pymlxc" / "_lib", force=True)
        except build_mlxc.BuildError as exc:
            raise SystemExit(f"build_mlxc: error: {exc}") from exc


class BinaryDistribution(Distribution):
    """Carries a native library (libmlxc), so the wheel is a platform wheel with its files at the
    root (platlib), not a pure one."""

    def has_ext_modules(self) -> bool:
        return True


class PlatformWheel(bdist_wheel):
    """Tagged for this platform only: cffi's ABI mode ties the wheel to no Python version or ABI,
    hence py3-none-<platform>."""

    def get_tag(self) -> tuple[str, str, str]:
        return ("py3", "none", super().get_tag()[2])


def _packages() -> tuple[list[str], dict[str, str]]:
    """`pymlxc` plus the repo's backends/ and bridge/ folders, installed as pymlxc.backends/.bridge."""
    packages = ["pymlxc"] + [f"pymlxc.{p}" for p in find_packages("pymlxc")]
    package_dir = {"pymlxc": "pymlxc"}
    for folder in ("backends", "bridge"):
        packages.append(f"pymlxc.{folder}")
        package_dir[f"pymlxc.{folder}"] = folder
        for sub in find_packages(folder):
            packages.append(f"pymlxc.{folder}.{sub}")
            package_dir[f"pymlxc.{folder}.{sub}"] = f"{folder}/{sub.replace('.', '/')}"
    return packages, package_dir


PACKAGES, PACKAGE_DIR = _packages()
setup(distclass=BinaryDistribution, cmdclass={"build_py": BuildPyWithMlxc, "bdist_wheel": PlatformWheel}, packages=PACKAGES, package_dir=PACKAGE_DIR)

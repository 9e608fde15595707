"""setuptools hook: `pip install` builds libmlxc and the cffi declarations with build_mlxc.py."""
from __future__ import annotations

import sys
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

sys.path.insert(0, str(Path(__file__).resolve().parent))
import build_mlxc  # noqa: E402


class BuildPyWithMlxc(build_py):
    def run(self) -> None:
        # Editable installs import from the source tree, so the library goes there; a regular
        # install puts it in the wheel being built.
        if getattr(self, "editable_mode", False):
            target = build_mlxc.DEFAULT_OUTPUT
        else:
            target = Path(self.build_lib) / "pymlxc" / "_lib"
        try:
            build_mlxc.build(output=target)
        except build_mlxc.BuildError as exc:
            raise SystemExit(f"build_mlxc: error: {exc}") from exc
        super().run()


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
setup(cmdclass={"build_py": BuildPyWithMlxc}, packages=PACKAGES, package_dir=PACKAGE_DIR)

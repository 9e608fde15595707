"""The builder's source handling, compat edits and error messages (no full rebuild: that is what
installing already proved)."""
from __future__ import annotations

import json
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

import build_mlxc

PIN = build_mlxc.load_pin()


@pytest.fixture(scope="module")
def cached_tarball() -> Path:
    path = build_mlxc.cached_archive(PIN)
    if not path.is_file():
        pytest.fail(f"the install step must have cached mlx-c at {path}")
    return path


def test_pin_names_upstream_commit_and_digest() -> None:
    assert PIN["upstream"].startswith("https://github.com/ml-explore/mlx-c")
    assert len(PIN["commit"]) == 40 and PIN["commit"] in PIN["archive_url"]
    assert len(PIN["tree_sha256"]) == 64


def test_tarball_source_is_verified_and_cached(cached_tarball: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    work = tmp_path / "work"
    tree, origin = build_mlxc.obtain_source(PIN, cached_tarball, work)
    assert (tree / "mlx" / "c" / "array.h").is_file() and "tarball" in origin
    assert build_mlxc.cached_archive(PIN).is_file(), "a used source is stored in the cache"
    # The cache alone is now enough (no --source, no network).
    tree2, origin2 = build_mlxc.obtain_source(PIN, None, tmp_path / "work2")
    assert origin2.startswith("cache") and build_mlxc.tree_digest(tree2) == PIN["tree_sha256"]


def test_directory_and_git_sources(cached_tarball: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    tree, _ = build_mlxc.obtain_source(PIN, cached_tarball, tmp_path / "w1")
    copy = tmp_path / "copy"
    shutil.copytree(tree, copy)
    _, origin = build_mlxc.obtain_source(PIN, copy, tmp_path / "w2")
    assert origin.startswith("directory")
    if shutil.which("git") is None:
        return
    repo = tmp_path / "repo"
    shutil.copytree(tree, repo)
    run = lambda *a: subprocess.run(["git", *a], cwd=repo, check=True, capture_output=True)  # noqa: E731
    run("init", "-q")
    run("add", "-A")
    run("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()
    pin = dict(PIN, commit=head)  # same tree, another commit id: the digest still has to match
    _, origin = build_mlxc.obtain_source(pin, repo, tmp_path / "w3")
    assert origin.startswith("git directory")


def test_tampered_source_is_refused(cached_tarball: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    tree, _ = build_mlxc.obtain_source(PIN, cached_tarball, tmp_path / "w1")
    bad = tmp_path / "bad"
    shutil.copytree(tree, bad)
    (bad / "mlx" / "c" / "ops.cpp").write_text("// changed\n")
    with pytest.raises(build_mlxc.BuildError, match="does not match the pin"):
        build_mlxc.obtain_source(PIN, bad, tmp_path / "w2")


def test_unsafe_tarball_paths_are_refused(tmp_path: Path) -> None:
    evil = tmp_path / "evil.tar.gz"
    payload = tmp_path / "x.txt"
    payload.write_text("x")
    with tarfile.open(evil, "w:gz") as tar:
        tar.add(payload, arcname="../escape.txt")
    with pytest.raises(build_mlxc.BuildError, match="unsafe path"):
        build_mlxc.obtain_source(PIN, evil, tmp_path / "w")


def test_compat_edits_apply_once_for_mlx_032(cached_tarball: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    tree, _ = build_mlxc.obtain_source(PIN, cached_tarball, tmp_path / "w")
    assert build_mlxc.apply_compat_edits(tree, "0.31.2") == []
    applied = build_mlxc.apply_compat_edits(tree, "0.32.4")
    assert len(applied) == 4
    assert "force_fused" in (tree / "mlx/c/fast.cpp").read_text()
    with pytest.raises(build_mlxc.BuildError, match="no longer applies"):
        build_mlxc.apply_compat_edits(tree, "0.32.4")  # already edited: the pattern is gone


def test_missing_tool_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(build_mlxc.shutil, "which", lambda name: None)
    with pytest.raises(build_mlxc.BuildError, match="apt install cmake"):
        build_mlxc._require_tool("cmake", "apt install cmake, brew install cmake, or pip install cmake")


def test_generated_declarations_cover_the_api() -> None:
    from pymlxc.core import _loader

    signatures = _loader.SIGNATURES
    for name in ("mlx_add", "mlx_fast_scaled_dot_product_attention", "mlx_gather_qmm", "mlx_load_safetensors",
                 "mlx_value_and_grad", "mlx_detail_compile", "mlx_set_error_handler"):
        assert name in signatures
    assert "mask_arr" in signatures["mlx_fast_scaled_dot_product_attention"]["nullable"]
    stamp = build_mlxc.read_stamp(_loader._lib_dir())
    assert stamp is not None and stamp["mlx_c_commit"] == PIN["commit"]


def test_stamp_mismatch_names_the_rebuild_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pymlxc.core import _loader

    from pymlxc import settings

    (tmp_path / "stamp.json").write_text(json.dumps({"mlx_version": "0.0.1", "mlx_prefix": "/x", "library": "libmlxc.so"}))
    # PYMLXC_LIB_DIR is read once, at import, into the settings: the override stands for it here.
    with settings.override(lib_dir=tmp_path), pytest.raises(_loader.LibraryNotBuiltError, match="build_mlxc.py --force"):
        _loader._read_stamp(_loader._lib_dir())
    with pytest.raises(_loader.LibraryNotBuiltError, match="has not been built"):
        _loader._read_stamp(tmp_path / "missing")

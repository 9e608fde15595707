"""The builder's download path (no --source, nothing cached) against a local HTTP server that serves
the pinned mlx-c archive, made in the fixture from a local copy of mlx-c (no network)."""
from __future__ import annotations

import functools
import http.server
import io
import shutil
import subprocess
import tarfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

import build_mlxc

PIN = build_mlxc.load_pin()
MIRROR = Path("/work/.mirror/ml-explore+mlx-c/repo")


def _archive_bytes(tmp: Path) -> bytes:
    """The pinned commit as GitHub's archive lays it out (one top folder mlx-c-<commit>/), from the
    git mirror when there is one, else from the tree the install step cached."""
    prefix = f"mlx-c-{PIN['commit']}/"
    if shutil.which("git") and (MIRROR / "objects").is_dir():
        result = subprocess.run(["git", "--git-dir", str(MIRROR), "archive", "--format=tar.gz",
                                 f"--prefix={prefix}", PIN["commit"]], capture_output=True)
        if result.returncode == 0:
            return result.stdout
    cached = build_mlxc.cached_archive(PIN)
    if not cached.is_file():
        pytest.fail(f"no local mlx-c: neither the git mirror {MIRROR} nor the install step's cache {cached}")
    return cached.read_bytes()


class _Server:
    """A threaded HTTP server over one folder that records the paths it was asked for."""

    def __init__(self, root: Path) -> None:
        self.requests: list[str] = []
        server = self

        class Handler(http.server.SimpleHTTPRequestHandler):
            def do_GET(self) -> None:
                server.requests.append(self.path)
                super().do_GET()

            def log_message(self, *args: object) -> None:  # keep pytest's output clean
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(root)))
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/{name}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[_Server, Path]]:
    root = tmp_path_factory.mktemp("www")
    data = _archive_bytes(root)
    (root / f"{PIN['commit']}.tar.gz").write_bytes(data)
    # The same archive with one source file changed: its tree digest no longer matches the pin.
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as src, \
            tarfile.open(root / "tampered.tar.gz", "w:gz") as dst:
        for member in src.getmembers():
            payload = src.extractfile(member) if member.isfile() else None
            if member.name.endswith("mlx/c/ops.cpp"):
                body = b"// changed\n"
                member.size = len(body)
                payload = io.BytesIO(body)
            dst.addfile(member, payload)
    server = _Server(root)
    yield server, root
    server.close()


@pytest.fixture()
def empty_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    for var in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    assert not build_mlxc.cached_archive(PIN).exists()
    return tmp_path


def test_download_is_verified_cached_and_not_repeated(served: tuple[_Server, Path], empty_cache: Path) -> None:
    server, _ = served
    pin = dict(PIN, archive_url=server.url(f"{PIN['commit']}.tar.gz"))
    before = len(server.requests)
    tree, origin = build_mlxc.obtain_source(pin, None, empty_cache / "w1")
    assert origin == f"download {pin['archive_url']}"
    assert build_mlxc.tree_digest(tree) == PIN["tree_sha256"]
    assert (tree / "mlx" / "c" / "array.h").is_file()
    assert server.requests[before:] == [f"/{PIN['commit']}.tar.gz"]
    assert build_mlxc.cached_archive(PIN).is_file()
    # The second build takes the cached copy: no second request.
    _, origin2 = build_mlxc.obtain_source(pin, None, empty_cache / "w2")
    assert origin2.startswith("cache ") and len(server.requests) == before + 1


def test_failed_download_names_the_url_and_the_way_out(served: tuple[_Server, Path], empty_cache: Path) -> None:
    server, _ = served
    pin = dict(PIN, archive_url=server.url("missing.tar.gz"))
    with pytest.raises(build_mlxc.BuildError) as info:
        build_mlxc.obtain_source(pin, None, empty_cache / "w")
    message = str(info.value)
    assert pin["archive_url"] in message and "404" in message and "--source PATH" in message
    assert not build_mlxc.cached_archive(PIN).exists(), "nothing is cached from a failed download"


def test_downloaded_archive_that_differs_is_refused_and_not_cached(served: tuple[_Server, Path], empty_cache: Path) -> None:
    server, _ = served
    pin = dict(PIN, archive_url=server.url("tampered.tar.gz"))
    with pytest.raises(build_mlxc.BuildError, match="does not match the pin"):
        build_mlxc.obtain_source(pin, None, empty_cache / "w")
    assert not build_mlxc.cached_archive(PIN).exists(), "a source that failed its digest is not cached"

"""Models by name (pymlxc/hub.py): repo ids resolved from a hub cache built here in huggingface_hub's
layout (offline), and downloads through huggingface_hub from a local HTTP server that answers the
Hub endpoints it calls. No network."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
from hypothesis import given
from hypothesis import strategies as st

import pymlxc
from pymlxc import hub
from pymlxc.discover import discover_hub
from pymlxc.hub import HubModelNotFoundError, HubReferenceError, ModelReference, QuantizationError
from pymlxc.testing import write_tiny_model

ROOT = Path(__file__).resolve().parents[1]
REPO, GGUF_REPO = "tiny-org/tiny-llama", "tiny-org/tiny-llama-GGUF"
MAIN, V2, GGUF_COMMIT = "a" * 40, "b" * 40, "c" * 40
PROMPT = "Once upon a time"


# ---------------------------------------------------------------------- a hub cache, as huggingface_hub lays it out

def add_snapshot(cache: Path, repo_id: str, commit: str, files: Mapping[str, Path | bytes],
                 refs: tuple[str, ...] = ("main",)) -> Path:
    """models--org--name/{blobs/<sha256>, snapshots/<commit>/<file> -> ../../blobs/<sha256>, refs/<ref>}."""
    storage = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = storage / "snapshots" / commit
    for name, source in files.items():
        data = source.read_bytes() if isinstance(source, Path) else source
        blob = storage / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (storage / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (storage / "refs" / ref).write_text(commit)
    return snapshot


def dir_files(folder: Path) -> dict[str, Path]:
    return {p.name: p for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from pymlxc.testing_gguf import QType, export_gguf

    root = tmp_path_factory.mktemp("hub-src")
    main = write_tiny_model(root / "main", "llama", seed=1)
    v2 = write_tiny_model(root / "v2", "llama", seed=2, vocab_size=384)  # told apart by info().vocab_size
    return {"main": main, "v2": v2,
            "Q8_0": export_gguf(main, root / "tiny-llama-Q8_0.gguf", QType.Q8_0),
            "F32": export_gguf(main, root / "tiny-llama-F32.gguf", QType.F32)}


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory, models: dict[str, Path]) -> Path:
    cache = tmp_path_factory.mktemp("hf") / "hub"
    add_snapshot(cache, REPO, MAIN, {**dir_files(models["main"]), "README.md": b"# tiny\n"})
    add_snapshot(cache, REPO, V2, dir_files(models["v2"]), refs=("v2",))
    add_snapshot(cache, GGUF_REPO, GGUF_COMMIT, {
        "tiny-llama-Q8_0.gguf": models["Q8_0"], "tiny-llama-F32.gguf": models["F32"],
        "mmproj-tiny-F16.gguf": b"not a model", "config.json": models["main"] / "config.json"})
    return cache


@pytest.fixture
def offline(cache: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def greedy(path: str, **options: object) -> tuple[str, dict[str, object]]:
    with pymlxc.load_model(path, backend="metal", **options) as model:
        text = "".join(t.text for t in model.generate(PROMPT, max_tokens=6))
        return text, model.info().to_dict()


@pytest.fixture(scope="module")
def expected(models: dict[str, Path]) -> dict[str, tuple[str, dict[str, object]]]:
    return {name: greedy(str(path)) for name, path in models.items()}


# ---------------------------------------------------------------------- loading from the cache (offline)

def test_repo_id_loads_the_default_branch(offline: Path, expected: dict) -> None:
    assert hub.resolve(REPO) == offline / f"models--tiny-org--tiny-llama/snapshots/{MAIN}"
    assert greedy(REPO) == expected["main"]


@pytest.mark.parametrize("reference", [f"{REPO}@v2", f"{REPO}@{V2}"])
def test_revision_picks_a_tag_or_commit(offline: Path, expected: dict, reference: str) -> None:
    text, info = greedy(reference)
    assert (text, info) == expected["v2"] and info["vocab_size"] == 384
    assert expected["main"][1]["vocab_size"] == 512  # so the two snapshots cannot be confused


@pytest.mark.parametrize("pattern", ["Q8_0", "q8_0", "F32"])
def test_gguf_pattern_picks_one_quantization(offline: Path, expected: dict, pattern: str) -> None:
    path = hub.resolve(f"{GGUF_REPO}:{pattern}")
    assert path.name == f"tiny-llama-{pattern.upper()}.gguf" and path.parent.name == GGUF_COMMIT
    assert greedy(f"{GGUF_REPO}:{pattern}") == expected[pattern.upper()]


def test_gguf_pattern_with_revision_in_either_order(offline: Path) -> None:
    want = hub.resolve(f"{GGUF_REPO}:Q8_0")
    assert hub.resolve(f"{GGUF_REPO}@main:Q8_0") == want == hub.resolve(f"{GGUF_REPO}:Q8_0@{GGUF_COMMIT}")


def test_gguf_repo_needs_a_pattern_among_several(offline: Path) -> None:
    with pytest.raises(QuantizationError, match=r"several GGUF files.*F32, Q8_0") as err:
        hub.resolve(GGUF_REPO)
    assert f"'{GGUF_REPO}:QUANT'" in str(err.value) and "mmproj" not in str(err.value)


@pytest.mark.parametrize("pattern", ["Q5_K_M", "tiny"])
def test_gguf_pattern_without_one_match_lists_the_quantizations(offline: Path, pattern: str) -> None:
    with pytest.raises(QuantizationError, match=r"quantizations: F32, Q8_0 \(files: tiny-llama-F32.gguf, "
                                                r"tiny-llama-Q8_0.gguf\)") as err:
        hub.resolve(f"{GGUF_REPO}:{pattern}")
    assert GGUF_REPO in str(err.value)


def test_gguf_shards_of_one_quantization_are_one_match(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "hub"
    parts = {f"Q4_K_M/m-Q4_K_M-0000{i}-of-00003.gguf": b"part" for i in (1, 2, 3)}
    add_snapshot(cache, "o/split", MAIN, {**parts, "m-Q8_0.gguf": b"x"})
    add_snapshot(cache, "o/gap", MAIN, {k: v for k, v in parts.items() if "00002" not in k})
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert hub.resolve("o/split:q4_k_m").name == "m-Q4_K_M-00001-of-00003.gguf"  # the loader reads split.count
    with pytest.raises(HubModelNotFoundError, match="lacks parts 2"):
        hub.resolve("o/gap:Q4_K_M")
    with pytest.raises(QuantizationError, match=r"several quantizations.*Q4_K_M.*m-Q8_0.gguf"):
        hub.resolve("o/split:gguf")


def test_mlx_lm_worker_gets_the_resolved_directory(offline: Path, models: dict[str, Path]) -> None:
    from pymlxc.backends.mlx_lm import MlxLmBackend
    from pymlxc.options import LoadConfig

    backend = MlxLmBackend(sys.executable)
    if not backend.available():
        pytest.fail(f"mlx-lm (a test dependency) is unavailable: {backend.unavailable_reason()}")
    # mlx-lm cannot read 'org/name@v2' itself (offline, and '@' is not its syntax): loading the v2
    # snapshot shows the worker was handed the resolved directory.
    with pymlxc.load_model(str(models["v2"]), backend="metal") as native:
        want = [t.id for t in native.generate(PROMPT, max_tokens=6)]
    with backend.load(f"{REPO}@v2", LoadConfig()) as model:
        assert model.info().to_dict()["vocab_size"] == 384
        assert [t.id for t in model.generate(PROMPT, max_tokens=6)] == want
        assert model.err() is None


def test_cli_generate_takes_a_repo_id(offline: Path, expected: dict) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    run = subprocess.run([sys.executable, "-m", "pymlxc.cli", "generate", REPO, PROMPT, "--max-tokens", "6",
                          "--backend", "metal", "--quiet"], capture_output=True, text=True, timeout=300, env=env,
                         cwd=ROOT)
    assert run.returncode == 0, run.stderr
    assert run.stdout == expected["main"][0] + "\n"
    bad = subprocess.run([sys.executable, "-m", "pymlxc.cli", "info", "tiny-org/absent", "--backend", "metal"],
                         capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert bad.returncode == 1 and "'tiny-org/absent' is not in the Hugging Face cache" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_cli_discover_lists_the_cache(offline: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    run = subprocess.run([sys.executable, "-m", "pymlxc.cli", "discover", "--json"], capture_output=True, text=True,
                         timeout=300, env=env, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    refs = [json.loads(line)["reference"] for line in run.stdout.splitlines()]
    assert refs == [REPO, f"{REPO}@{V2}", f"{GGUF_REPO}:F32", f"{GGUF_REPO}:Q8_0"]


def test_discover_hub_names_each_model_by_reference(offline: Path) -> None:
    found = {m.reference: m for m in discover_hub()}
    assert set(found) == {REPO, f"{REPO}@{V2}", f"{GGUF_REPO}:F32", f"{GGUF_REPO}:Q8_0"}
    assert found[REPO].format == "safetensors" and found[REPO].model_type == "llama"
    assert found[f"{GGUF_REPO}:Q8_0"].quant_bits == 8 and found[f"{GGUF_REPO}:Q8_0"].path.name.endswith("Q8_0.gguf")
    for reference, model in found.items():  # every listed reference resolves to what was listed
        assert hub.resolve(reference) == model.path


# ---------------------------------------------------------------------- what is missing, and bad references

def test_missing_repo_and_revision_name_them(offline: Path) -> None:
    with pytest.raises(HubModelNotFoundError, match=r"'tiny-org/absent' is not in the Hugging Face cache .*"
                                                    r"HF_HUB_OFFLINE"):
        pymlxc.load_model("tiny-org/absent", backend="metal")
    with pytest.raises(HubModelNotFoundError, match=r"revision 'v9' of 'tiny-org/tiny-llama' is not in the"):
        hub.resolve(f"{REPO}@v9")
    with pytest.raises(HubModelNotFoundError, match=r"revision 'd{40}' \(commit d{40}\) is not in"):
        hub.resolve(f"{REPO}@{'d' * 40}")


def test_missing_files_are_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, models: dict[str, Path]) -> None:
    cache = tmp_path / "hub"
    files = dir_files(models["main"])
    index = json.dumps({"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                                                        "b": "model-00002-of-00002.safetensors"}}).encode()
    add_snapshot(cache, "o/no-config", MAIN, {k: v for k, v in files.items() if k != "config.json"})
    add_snapshot(cache, "o/shard", MAIN, {**{k: v for k, v in files.items() if k != "model.safetensors"},
                                          "model.safetensors.index.json": index,
                                          "model-00001-of-00002.safetensors": files["model.safetensors"]})
    gone = add_snapshot(cache, "o/blob-gone", MAIN, files)
    (gone / "model.safetensors").resolve().unlink()  # an interrupted download: the link dangles
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HubModelNotFoundError, match=r"'o/no-config' at revision 'main'.*config.json missing"):
        hub.resolve("o/no-config")
    with pytest.raises(HubModelNotFoundError, match=r"'o/shard' at revision 'main'.* lacks "
                                                    r"model-00002-of-00002.safetensors"):
        hub.resolve("o/shard")
    with pytest.raises(HubModelNotFoundError, match=r"'o/blob-gone'.*\*.safetensors weights missing"):
        hub.resolve("o/blob-gone")


@pytest.mark.parametrize("reference, message", [
    ("org/na me", "nor a valid Hugging Face repo id"),
    ("org/a--b", "Cannot have -- or .."),
    ("org/name.git", "cannot end by '.git'"),
    ("org/name@", "not a valid revision"),
    ("org/name@../../x", "not a valid revision"),
    ("org/name@v1@v2", "not a valid revision"),
    ("org/name:Q4 K", "not a valid quantization pattern"),
    ("org/name:", "not a valid quantization pattern"),
    ("org/name@a:Q8_0@b", "two revisions"),
    ("", "empty"),
    (" ", "empty"),
])
def test_bad_references_fail_before_any_network_use(reference: str, message: str, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with Hub({}) as server:  # any request would be recorded
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
        with pytest.raises(HubReferenceError, match=message):
            pymlxc.load_model(reference, backend="metal")
        assert server.requests == []


def test_an_existing_directory_wins_over_a_repo_id(offline: Path, tmp_path: Path, models: dict[str, Path],
                                                   expected: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    shutil.copytree(models["v2"], tmp_path / REPO)
    assert hub.resolve(REPO) == Path(REPO)
    assert greedy(REPO) == expected["v2"]
    assert hub.resolve("no/such/dir") == Path("no/such/dir")  # not repo-shaped: the backend says it is missing
    with pytest.raises(FileNotFoundError):
        pymlxc.load_model("./tiny-org/absent", backend="metal")


_name = st.from_regex(r"[A-Za-z0-9]([A-Za-z0-9_]{0,10}[A-Za-z0-9])?", fullmatch=True)
_revision = st.one_of(st.none(), st.from_regex(r"[A-Za-z0-9_]{1,8}(/[A-Za-z0-9_]{1,8}){0,2}", fullmatch=True),
                      st.from_regex(r"[0-9a-f]{40}", fullmatch=True))
_pattern = st.one_of(st.none(), st.from_regex(r"[A-Za-z0-9_]{1,12}", fullmatch=True))


@given(_name, _name, _revision, _pattern)
def test_references_round_trip(org: str, name: str, revision: str | None, pattern: str | None) -> None:
    ref = ModelReference(f"{org}/{name}", revision, pattern)
    assert hub.parse_reference(str(ref)) == ref
    if revision and pattern:
        assert hub.parse_reference(f"{org}/{name}:{pattern}@{revision}") == ref


@given(st.text(max_size=40))
def test_any_text_parses_or_raises_a_reference_error(text: str) -> None:
    try:
        ref = hub.parse_reference(text)
    except HubReferenceError as exc:
        assert repr(text) in str(exc) or "repo id" in str(exc)
    else:
        assert ref.repo_id.count("/") == 1 and str(ref).startswith(ref.repo_id)


QUANTS = ("Q4_0", "Q4_K", "Q4_K_M", "Q4_K_S", "Q8_0", "F16", "BF16", "IQ2_XXS", "IQ2_XS", "Q6_K")


@given(st.lists(st.sampled_from(QUANTS), min_size=1, unique=True), st.data())
def test_a_stated_quantization_picks_exactly_its_files(quants: list[str], data: st.DataObject) -> None:
    shards = {q: data.draw(st.integers(1, 3), label=q) for q in quants}
    files = ["README.md", "mmproj-F16.gguf"] + [
        f"m-{q}.gguf" if n == 1 else f"{q}/m-{q}-{i:05d}-of-{n:05d}.gguf" for q, n in shards.items()
        for i in range(1, n + 1)]
    want = data.draw(st.sampled_from(quants))
    pattern = data.draw(st.sampled_from([want, want.lower()]))
    choice = hub.choose_files(ModelReference("o/m", None, pattern), files, "here")
    assert [hub.quant_label(hub.gguf_group(f)) for f in choice.gguf] == [want] * shards[want]
    assert choice.files == choice.gguf  # no companions in this listing, and never the projector


# ---------------------------------------------------------------------- downloading, from a local Hub

class Hub:
    """A Hub on 127.0.0.1 that answers what huggingface_hub asks while downloading: the revision
    endpoint (repo info), the tree listing and resolve (HEAD, GET). Records each request."""

    def __init__(self, repos: Mapping[str, tuple[str, Mapping[str, bytes]]]) -> None:
        self.repos = repos  # repo id -> (commit, files)
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Authorization)
        hub_self = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_HEAD(self) -> None:
                hub_self.answer(self, body=False)

            def do_GET(self) -> None:
                hub_self.answer(self, body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Hub:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def answer(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlsplit(h.path).path)
        self.requests.append((h.command, path, h.headers.get("Authorization")))
        parts = path.strip("/").split("/")
        status, headers, data = 404, {"X-Error-Code": "RepoNotFound"}, b'{"error": "Repository not found"}'
        if (parts[:2] == ["api", "models"] and len(parts) in (4, 6)) or (len(parts) > 6 and parts[4] == "tree"):
            repo = "/".join(parts[2:4])
            if repo in self.repos:
                commit, files = self.repos[repo]
                if len(parts) == 4 or parts[4] == "revision":  # repo info, of the default branch or a revision
                    status, headers, data = 200, {}, json.dumps(
                        {"id": repo, "sha": commit, "siblings": [{"rfilename": f} for f in files]}).encode()
                elif parts[4] == "tree":
                    status, headers, data = 200, {}, json.dumps(
                        [{"type": "file", "path": f, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
                         for f, b in files.items()]).encode()
        elif len(parts) >= 5 and parts[2] == "resolve":
            repo, name = "/".join(parts[:2]), "/".join(parts[4:])
            if repo in self.repos:
                commit, files = self.repos[repo]
                if name in files:
                    data = files[name]
                    status, headers = 200, {"X-Repo-Commit": commit, "ETag": f'"{hashlib.sha256(data).hexdigest()}"'}
                else:
                    status, headers = 404, {"X-Error-Code": "EntryNotFound"}
        h.send_response(status)
        for key, value in {**headers, "Content-Length": str(len(data)), "Content-Type": "application/json"}.items():
            h.send_header(key, value)
        h.end_headers()
        if body:
            h.wfile.write(data)


@pytest.fixture
def online(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    from huggingface_hub import constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # as read at its import from the outer environment
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    return tmp_path / "hub"


def test_download_fetches_only_the_model_files(online: Path, models: dict[str, Path], expected: dict,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    files = {k: v.read_bytes() for k, v in dir_files(models["main"]).items()}
    extra = {"README.md": b"# tiny", "original/consolidated.safetensors": b"x", "adapter_model.safetensors": b"x",
             "weights.pth": b"x"}
    with Hub({"srv-org/tiny": (MAIN, {**files, **extra})}) as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        path = hub.resolve("srv-org/tiny", progress=False)
        fetched = {p for m, p, _ in server.requests if m == "GET" and "/resolve/" in p}
        assert all(auth == "Bearer hf_test_token" for _, _, auth in server.requests)
    assert path == online / f"models--srv-org--tiny/snapshots/{MAIN}"
    assert sorted(p.name for p in path.iterdir()) == sorted(files)
    assert fetched == {f"/srv-org/tiny/resolve/{MAIN}/{f}" for f in files}
    assert (online / "models--srv-org--tiny/refs/main").read_text() == MAIN
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # what was downloaded is found offline by the same name
    assert greedy("srv-org/tiny") == expected["main"]


def test_download_progress_is_huggingface_hubs_bar(online: Path, models: dict[str, Path], tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  capfd: pytest.CaptureFixture[str]) -> None:
    files = {k: v.read_bytes() for k, v in dir_files(models["main"]).items()}
    with Hub({"srv-org/tiny": (MAIN, files)}) as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        hub.resolve("srv-org/tiny", progress=False)
        assert capfd.readouterr().err == ""
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "second"))
        hub.resolve("srv-org/tiny", progress=True)
        assert f"Fetching {len(files)} files" in capfd.readouterr().err


def test_download_of_one_gguf_quantization(online: Path, models: dict[str, Path], monkeypatch: pytest.MonkeyPatch,
                                           expected: dict) -> None:
    repo = {"m-Q8_0.gguf": models["Q8_0"].read_bytes(), "m-F32.gguf": models["F32"].read_bytes(),
            "config.json": (models["main"] / "config.json").read_bytes(), "README.md": b"#"}
    with Hub({"srv-org/tiny-GGUF": (GGUF_COMMIT, repo)}) as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        path = hub.resolve("srv-org/tiny-GGUF:Q8_0", progress=False)
        fetched = sorted(p.rsplit("/", 1)[1] for m, p, _ in server.requests if m == "GET" and "/resolve/" in p)
        with pytest.raises(QuantizationError, match=r"quantizations: F32, Q8_0"):
            hub.resolve("srv-org/tiny-GGUF:Q4_K_M", progress=False)
    assert fetched == ["config.json", "m-Q8_0.gguf"]
    assert path.name == "m-Q8_0.gguf" and path.read_bytes() == repo["m-Q8_0.gguf"]
    assert greedy(str(path)) == expected["Q8_0"]


def test_download_errors_name_the_repo_and_revision(online: Path, models: dict[str, Path],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    with Hub({"srv-org/readme-only": (MAIN, {"README.md": b"#"})}) as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        with pytest.raises(HubModelNotFoundError, match=r"no repo 'srv-org/absent' on http://127.0.0.1"):
            hub.resolve("srv-org/absent", progress=False)
        with pytest.raises(HubModelNotFoundError, match=r"'srv-org/readme-only' at revision 'main' on .* not a "
                                                        r"model.*\(files: README.md\)"):
            hub.resolve("srv-org/readme-only", progress=False)


def test_unreachable_hub_falls_back_to_the_cache(online: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with Hub({}) as server:
        url = server.url  # closed on exit: connections are refused from here on
    monkeypatch.setenv("HF_ENDPOINT", url)
    with pytest.raises(HubModelNotFoundError, match=r"'srv-org/x' is not in the Hugging Face cache .*could not be "
                                                    r"reached"):
        hub.resolve("srv-org/x", progress=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    assert hub.resolve(REPO, progress=False) == cache / f"models--tiny-org--tiny-llama/snapshots/{MAIN}"


def test_cache_location_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    assert hub.hub_cache_dir() == Path.home() / ".cache/huggingface/hub"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hub.hub_cache_dir() == tmp_path / "xdg/huggingface/hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hub.hub_cache_dir() == tmp_path / "home/hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    assert hub.hub_cache_dir() == tmp_path / "cache"

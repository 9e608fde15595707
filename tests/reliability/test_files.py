"""Special files where a model's files should be: FIFOs, devices, links to them, oversized files.
Each is refused with an error naming the path (`load_model`) or skipped (`discover`), without
blocking and without reading what it does not need. Cases that could hang or exhaust memory run
in a child process (`run_case`)."""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pymlxc.files import (
    FileFormatError,
    UnsafeFileError,
    check_regular_file,
    read_bytes,
    read_json,
    write_replacing,
)
from pymlxc.testing import write_tiny_model

from .subproc import run_case

pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs (POSIX)")

LOAD = """
import resource
import pymlxc
def peak_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024  # KiB on Linux
try:
    with pymlxc.load_model({path!r}) as m:
        report(["loaded", m.info().num_layers, peak_mib()])
except Exception as exc:
    report([type(exc).__name__, str(exc), peak_mib()])
"""

DISCOVER = """
import pymlxc
from pymlxc.discover import discover
report(sorted(str(m.path) for m in discover({path!r})))
"""


@pytest.fixture(scope="module")
def tiny_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("src") / "m", "llama")


@pytest.fixture()
def model(tiny_source: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_source, tmp_path / "m"))


def _replace_with_fifo(file: Path) -> None:
    file.unlink()
    os.mkfifo(file)


def _replace_with_link(file: Path, target: str) -> None:
    file.unlink()
    file.symlink_to(target)


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json", "config.json", "chat_template.jinja",
                                  "model.safetensors"])
def test_fifo_in_model_directory_is_refused(model: Path, name: str) -> None:
    file = model / name
    if not file.exists():
        file.write_text("")
    _replace_with_fifo(file)
    kind, message, _ = run_case(LOAD.format(path=str(model)), timeout=120)
    assert kind == "UnsafeFileError"
    assert str(file) in message and "FIFO" in message


@pytest.mark.parametrize("name", ["tokenizer.json", "config.json", "model.safetensors"])
def test_link_to_dev_zero_is_refused_unread(model: Path, name: str) -> None:
    _replace_with_link(model / name, "/dev/zero")
    kind, message, peak_mib = run_case(LOAD.format(path=str(model)), timeout=120)
    assert kind == "UnsafeFileError"
    assert "character device" in message and str(model / name) in message
    assert peak_mib < 1500  # nothing read from the device (it used to read about 2 GB)


def test_gguf_fifo_is_refused(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "m.gguf")
    kind, message, _ = run_case(LOAD.format(path=str(tmp_path / "m.gguf")), timeout=120)
    assert (kind, message) == ("UnsafeFileError", f"GGUF file {tmp_path / 'm.gguf'} is a FIFO (named pipe), "
                                                  "not a regular file")


def test_link_to_a_regular_file_still_loads(model: Path, tmp_path: Path) -> None:
    """Links are followed (the Hugging Face cache is made of them): only what they lead to counts."""
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    for name in ("tokenizer.json", "config.json", "model.safetensors"):
        shutil.move(model / name, blobs / name)
        (model / name).symlink_to(blobs / name)
    assert run_case(LOAD.format(path=str(model)), timeout=120)[:2] == ["loaded", 2]


def test_missing_directory_is_named_as_such(tmp_path: Path) -> None:
    kind, message, _ = run_case(LOAD.format(path=str(tmp_path / "nowhere")), timeout=120)
    assert kind == "FileNotFoundError"
    assert "model directory not found" in message and "tokenizer" not in message


@pytest.mark.parametrize("kind", ["fifo", "device", "file"])
def test_a_model_path_that_is_no_directory_is_named_as_what_it_is(tmp_path: Path, kind: str) -> None:
    """A FIFO, a device or a stray file given as the model used to be reported "not found"."""
    path = tmp_path / "model"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "device":
        path.symlink_to("/dev/zero")
    else:
        path.write_text("not a model")
    what = {"fifo": "FIFO (named pipe)", "device": "character device", "file": "regular file"}[kind]
    kind_name, message, _ = run_case(LOAD.format(path=str(path)), timeout=120)
    assert (kind_name, message) == ("NotADirectoryError", f"model directory {path} is a {what}, not a directory")


def test_discover_skips_fifo_and_device_configs(tiny_source: Path, tmp_path: Path) -> None:
    good = Path(shutil.copytree(tiny_source, tmp_path / "a_good"))
    fifo = Path(shutil.copytree(tiny_source, tmp_path / "b_fifo"))
    _replace_with_fifo(fifo / "config.json")
    zero = Path(shutil.copytree(tiny_source, tmp_path / "c_zero"))
    _replace_with_link(zero / "config.json", "/dev/zero")
    gguf = tmp_path / "d_gguf"
    gguf.mkdir()
    os.mkfifo(gguf / "model.gguf")
    assert run_case(DISCOVER.format(path=str(tmp_path)), timeout=120) == [str(good)]


def test_discover_skips_an_oversized_config(tiny_source: Path, tmp_path: Path) -> None:
    good = Path(shutil.copytree(tiny_source, tmp_path / "a_good"))
    big = Path(shutil.copytree(tiny_source, tmp_path / "b_big"))
    with open(big / "config.json", "r+b") as f:  # sparse: no disk used, but 4 GiB long
        f.truncate(4 << 30)
    assert run_case(DISCOVER.format(path=str(tmp_path)), timeout=120) == [str(good)]


# -- pymlxc.files itself ----------------------------------------------------------------------------

def test_read_bytes_refuses_special_and_oversized_files(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(UnsafeFileError, match=r"pipe is a FIFO"):
        read_bytes(fifo)  # would block forever if opened blocking
    with pytest.raises(UnsafeFileError, match="is a directory"):
        read_bytes(tmp_path)
    with pytest.raises(UnsafeFileError, match="character device"):
        check_regular_file("/dev/null")
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(1001)
    with pytest.raises(UnsafeFileError, match=r"big\.json is 1001 bytes, more than the 1000"):
        read_bytes(big, max_bytes=1000)
    assert len(read_bytes(big, max_bytes=1001)) == 1001
    with pytest.raises(FileNotFoundError, match="config file not found"):
        read_json(tmp_path / "absent.json", what="config file")


def test_read_json_errors_name_the_file(tmp_path: Path) -> None:
    file = tmp_path / "c.json"
    for content, match in ((b"[" * 100_000, "nested too deeply"), (b"\xff\xfe", "not UTF-8"),
                           (b"{", "not valid JSON"), (b"[1]", "expected a JSON object")):
        file.write_bytes(content)
        with pytest.raises(FileFormatError, match=match) as info:
            read_json(file)
        assert str(file) in str(info.value)
    file.write_bytes(b"[1]")
    assert read_json(file, expect_object=False) == [1]


@settings(max_examples=40, deadline=None)
@given(data=st.binary(max_size=3000), limit=st.integers(0, 3000))
def test_read_bytes_returns_the_file_or_refuses_it(tmp_path_factory: pytest.TempPathFactory, data: bytes,
                                                    limit: int) -> None:
    file = tmp_path_factory.mktemp("b") / "f"
    file.write_bytes(data)
    if len(data) <= limit:
        assert read_bytes(file, max_bytes=limit) == data
    else:
        with pytest.raises(UnsafeFileError, match="more than"):
            read_bytes(file, max_bytes=limit)


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
                           max_leaves=20)


@settings(max_examples=40, deadline=None)
@given(value=st.dictionaries(st.text(), json_values, max_size=5))
def test_read_json_round_trips(tmp_path_factory: pytest.TempPathFactory, value: dict) -> None:
    file = tmp_path_factory.mktemp("j") / "f.json"
    file.write_text(json.dumps(value), encoding="utf-8")
    assert read_json(file) == value


def _read_each(imports: str, calls: list[tuple[str, Path]]) -> object:
    """In a child (a FIFO read would block it): each `fn(path)` of `calls` (a function that
    `imports` brings in, by name) -> "read" or [its exception's type, message]."""
    pairs = ", ".join(f"({fn}, {str(path)!r})" for fn, path in calls)
    return run_case(f"""
{imports}
out = []
for fn, arg in ({pairs},):
    try:
        fn(arg)
        out.append("read")
    except Exception as exc:
        out.append([type(exc).__name__, str(exc)])
report(out)
""", timeout=120)


def _fifo_refused(what: str, path: Path) -> list[str]:
    return ["UnsafeFileError", f"{what} {path} is a FIFO (named pipe), not a regular file"]


def test_adapter_and_safetensors_readers_refuse_fifos(tmp_path: Path) -> None:
    """Adapters and prompt caches are read through the same door: `pymlxc.core.load_safetensors`
    (which MLX opens by name) and `pymlxc.files` for their JSON."""
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapters.safetensors").write_bytes(b"")
    os.mkfifo(adapter / "adapter_config.json")
    os.mkfifo(tmp_path / "cache.safetensors")
    result = _read_each("import pymlxc.core as mx\nfrom pymlxc.training.adapters import read_adapter",
                        [("read_adapter", adapter), ("mx.load_safetensors", tmp_path / "cache.safetensors")])
    assert result == [_fifo_refused("adapter config", adapter / "adapter_config.json"),
                      _fifo_refused("file", tmp_path / "cache.safetensors")]


def test_training_readers_refuse_fifos(tmp_path: Path) -> None:
    """A training set or a resume state that is a FIFO is refused by name instead of blocking."""
    data = tmp_path / "data"
    data.mkdir()
    os.mkfifo(data / "train.jsonl")
    os.mkfifo(tmp_path / "state.json")
    result = _read_each("from pymlxc.files import read_json\nfrom pymlxc.training.data import read_jsonl",
                        [("read_jsonl", data / "train.jsonl"), ("read_json", tmp_path / "state.json")])
    assert result == [_fifo_refused("dataset file", data / "train.jsonl"),
                      _fifo_refused("file", tmp_path / "state.json")]


# -- writing where a library opens the name itself -----------------------------------------------

def test_write_replacing_writes_exactly_there_or_refuses(tmp_path: Path) -> None:
    """`write_replacing` hands the writer a temporary name and moves the result to the path asked
    for; a FIFO, device or directory at the path is refused before anything is written (MLX's
    savers would block on a FIFO, and append ".safetensors" to any other name)."""
    target = tmp_path / "out.bin"
    assert write_replacing(target, lambda tmp: Path(tmp).write_bytes(b"one"), suffix=".safetensors") == target
    assert target.read_bytes() == b"one" and os.listdir(tmp_path) == ["out.bin"]
    link = tmp_path / "link"
    link.symlink_to(target)
    write_replacing(link, lambda tmp: Path(tmp).write_bytes(b"two"))
    assert link.is_symlink() and target.read_bytes() == b"two"  # the link's file, the link kept
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "dir").mkdir()
    for name, kind in (("fifo", "FIFO (named pipe)"), ("dir", "directory")):
        with pytest.raises(UnsafeFileError, match=re.escape(f"out file {tmp_path / name} is a {kind}")):
            write_replacing(tmp_path / name, lambda tmp: pytest.fail("written"), what="out file")
    with pytest.raises(FileNotFoundError, match="no directory"):
        write_replacing(tmp_path / "missing" / "x", lambda tmp: pytest.fail("written"))

    def failing(tmp: str) -> None:
        Path(tmp).write_bytes(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_replacing(target, failing)
    assert target.read_bytes() == b"two"  # the old file stays whole
    assert sorted(os.listdir(tmp_path)) == ["dir", "fifo", "link", "out.bin"]  # no temporary left


def test_save_fused_refuses_a_fifo_where_its_files_go(tiny_source: Path, tmp_path: Path) -> None:
    """The fused model's weights and config used to be opened for writing by name: a FIFO there
    blocked `save_fused` (and `pymlxc fuse`) forever."""
    out = tmp_path / "fused"
    out.mkdir()
    os.mkfifo(out / "model.safetensors")
    result = run_case(f"""
import pymlxc
with pymlxc.load_model({str(tiny_source)!r}, backend="metal") as m:
    m.apply_lora()
    try:
        m.save_fused({str(out)!r}, {str(tiny_source)!r})
        report(["saved", ""])
    except Exception as exc:
        report([type(exc).__name__, str(exc)])
""", timeout=120)
    assert result == ["UnsafeFileError", f"fused weights file {out / 'model.safetensors'} is a FIFO (named pipe), "
                      "not a regular file"]

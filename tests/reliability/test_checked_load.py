"""`pymlxc.safetensors_check.checked_load`, the door through which adapters, training checkpoints and
prompt caches are read: every failure is the caller's error class naming the file (and the tensor
at fault), and whatever loads has the shapes its checked header says."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

import pymlxc.core as mx
from pymlxc import safetensors_check
from pymlxc.safetensors_check import checked_load

from .hostile_safetensors import CASE_IDS, F32, write_case, write_safetensors
from .subproc import run_case


class Refused(ValueError):
    """The error class a test reader passes."""


@pytest.mark.parametrize("case", CASE_IDS)
def test_a_hostile_file_raises_the_callers_error(tmp_path: Path, case: str) -> None:
    expected = write_case(tmp_path / "w.safetensors", case, "test file")
    with pytest.raises(Refused) as info:
        checked_load(tmp_path / "w.safetensors", Refused, "test file")
    assert str(info.value).startswith(expected), str(info.value)


def test_a_valid_file_loads_with_its_metadata(tmp_path: Path) -> None:
    header = {"__metadata__": {"format": "mlx"}, "t": {**F32, "data_offsets": [16, 32]},
              "e": {"dtype": "I64", "shape": [3, 0], "data_offsets": [0, 0]}}
    arrays, metadata = checked_load(write_safetensors(tmp_path / "w.safetensors", header), Refused, "test file")
    assert {k: v.shape for k, v in arrays.items()} == {"t": (2, 2), "e": (3, 0)}
    assert metadata == {"format": "mlx"}
    mx.eval(*arrays.values())


@pytest.mark.parametrize(("read", "message"), [
    ({"t": mx.zeros((4,))}, "tensor 't' in {file}: MLX read shape (4,), not the checked header's"),
    ({"t": mx.zeros((2, 2)), "u": mx.zeros((2,))}, "tensor 'u' in {file}: MLX read shape (2,), not the checked"),
    ({}, "tensor 't' in {file}: in the checked header but not read by MLX"),
])
def test_a_file_changed_between_check_and_read_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          read: dict[str, Any], message: str) -> None:
    """MLX opens the file by name after its header was checked: what it read is compared with the
    checked header (a file replaced in between is not taken on the old header's word)."""
    file = write_safetensors(tmp_path / "w.safetensors", {"t": F32})
    monkeypatch.setattr(safetensors_check.mx, "load_safetensors", lambda _: (read, {}))
    with pytest.raises(Refused) as info:
        checked_load(file, Refused, "test file")
    assert str(info.value).startswith(message.format(file=file)), str(info.value)


def test_mlx_refusing_a_checked_file_is_the_callers_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    file = write_safetensors(tmp_path / "w.safetensors", {"t": F32})

    def refuse(_: object) -> Any:
        raise mx.MLXError("bad file")

    monkeypatch.setattr(safetensors_check.mx, "load_safetensors", refuse)
    with pytest.raises(Refused, match=f"^cannot read test file {file}: bad file$"):
        checked_load(file, Refused, "test file")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs (POSIX)")
def test_special_files_are_the_callers_error_unread(tmp_path: Path) -> None:
    """A FIFO would block MLX's open forever and /dev/zero never ends: in a child, so that a
    regression hangs one test, each is refused by name, as are a directory and no file at all."""
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "dir").mkdir()
    (tmp_path / "zero").symlink_to("/dev/zero")
    paths = [str(tmp_path / n) for n in ("fifo", "dir", "zero", "missing")]
    got = run_case(f"""
from pymlxc.safetensors_check import checked_load
out = []
for path in {paths!r}:
    try:
        checked_load(path, ValueError, "test file")
        out.append("read")
    except Exception as exc:
        out.append([type(exc).__name__, str(exc)])
report(out)
""", timeout=120)
    assert got == [["ValueError", f"test file {tmp_path / 'fifo'} is a FIFO (named pipe), not a regular file"],
                   ["ValueError", f"test file {tmp_path / 'dir'} is a directory, not a regular file"],
                   ["ValueError", f"test file {tmp_path / 'zero'} is a character device, not a regular file"],
                   ["ValueError", f"test file not found: {tmp_path / 'missing'}"]]

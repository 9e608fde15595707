"""pymlxc.ptx_cache: MLX's compiled-code folder named in the user cache, keyed on GPUs, driver and MLX."""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from pymlxc import ptx_cache, settings

DRIVER = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.159.04  Tue Oct 14 2025\nGCC version: 13.2\n"


def fake_proc(root: Path, driver: str | None = DRIVER, models: tuple[str, ...] = ("NVIDIA H100 80GB HBM3",)) -> Path:
    proc = root / "proc"
    (proc / "gpus").mkdir(parents=True)
    if driver is not None:
        (proc / "version").write_text(driver)
    for i, model in enumerate(models):
        gpu = proc / "gpus" / f"0000:00:0{i}.0"
        gpu.mkdir()
        (gpu / "information").write_text(f"Model: \t\t {model}\nIRQ:             40\nBus Type:        PCIe\n")
    return proc


def chosen(cache: Path | str) -> settings.Settings:
    return dataclasses.replace(settings.current(), cache_dir=str(cache))


def test_names_a_folder_of_the_user_cache_keyed_on_device_driver_and_mlx(tmp_path: Path) -> None:
    env: dict[str, str] = {}
    folder = ptx_cache.configure(env, proc=fake_proc(tmp_path), chosen=chosen(tmp_path / "cache"))
    assert folder is not None and folder.is_dir()
    assert env == {"MLX_PTX_CACHE_DIR": str(folder)}
    assert folder.parent == tmp_path / "cache" / "mlx-ptx"
    # The same machine names the same folder; another driver or another GPU model another one.
    assert ptx_cache.configure({}, proc=tmp_path / "proc", chosen=chosen(tmp_path / "cache")) == folder
    other_driver = fake_proc(tmp_path / "b", driver=DRIVER.replace("580.159.04", "590.10.01"))
    other_gpu = fake_proc(tmp_path / "c", models=("NVIDIA H200",))
    folders = {ptx_cache.configure({}, proc=p, chosen=chosen(tmp_path / "cache")) for p in (other_driver, other_gpu)}
    assert folder not in folders and len(folders) == 2


def test_device_key_reads_the_driver_and_every_gpu(tmp_path: Path) -> None:
    key = ptx_cache.device_key(fake_proc(tmp_path, models=("NVIDIA H100 80GB HBM3", "NVIDIA H100 80GB HBM3")))
    assert key == {"driver": DRIVER.splitlines()[0], "gpus": ["NVIDIA H100 80GB HBM3"] * 2}


@pytest.mark.parametrize("case", ["user's own folder", "no driver", "cache off", "folder cannot be made"])
def test_leaves_mlx_alone(tmp_path: Path, case: str) -> None:
    env = {"MLX_PTX_CACHE_DIR": "/somewhere/else"} if case == "user's own folder" else {}
    before = dict(env)
    proc = fake_proc(tmp_path, driver=None if case == "no driver" else DRIVER)
    cache: Path | str = tmp_path / "cache"
    if case == "cache off":
        cache = "off"
    elif case == "folder cannot be made":
        (tmp_path / "cache").write_text("a file where the folder would go")
    assert ptx_cache.configure(env, proc=proc, chosen=chosen(cache)) is None
    assert env == before


def test_a_driver_file_that_is_not_a_regular_file_is_no_driver(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path, driver=None)
    (proc / "version").mkdir()
    assert ptx_cache.device_key(proc) is None


def test_this_process_names_no_folder_without_an_nvidia_driver() -> None:
    if Path("/proc/driver/nvidia/version").is_file():
        pytest.skip("this machine has an NVIDIA driver")
    assert ptx_cache.configure({}) is None
    assert os.environ.get("MLX_PTX_CACHE_DIR") is None or "pymlxc" not in os.environ["MLX_PTX_CACHE_DIR"]

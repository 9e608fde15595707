"""The persistent start-up caches: user_cache's entries (corrupt, stale, foreign, concurrent,
unwritable), the kernels' check verdicts kept across processes, and the binding's cffi
declarations loaded from the cache."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pymlxc import settings as pymlxc_settings
from pymlxc import user_cache
from pymlxc.backends.metal.kernels.check import CheckedOnce
from pymlxc.core import _loader

ROOT = Path(__file__).resolve().parents[2]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**53, 2**53) | st.text(max_size=20)
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)


# ---------------------------------------------------------------------- the store

def test_directory_follows_the_setting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert user_cache.directory(pymlxc_settings.Settings(cache_dir="off")) is None
    assert user_cache.directory(pymlxc_settings.Settings(cache_dir=str(tmp_path))) == tmp_path
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert user_cache.directory(pymlxc_settings.Settings()) == tmp_path / "xdg" / "pymlxc"
    assert pymlxc_settings.Settings.from_env({"PYMLXC_CACHE_DIR": "off"}).cache_dir == "off"
    with pymlxc_settings.override(cache_dir=str(tmp_path / "o")):
        assert user_cache.Store("k").folder == tmp_path / "o" / "k"
    with pytest.raises(ValueError, match="plain folder name"):
        user_cache.Store("../up")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=json_values, value=json_values, flip=st.integers(min_value=0))
def test_round_trip_and_any_flipped_byte(tmp_path: Path, key: Any, value: Any, flip: int) -> None:
    """What was put comes back; after any one byte of the file changes, the entry reads as the
    same value or as a miss, never as something else."""
    store = user_cache.Store("prop", root=tmp_path / str(abs(hash((repr(key), repr(value), flip)))))
    assert store.put(key, value)
    assert user_cache.canonical(store.get(key)) == user_cache.canonical(value)
    path = store.path_for(key)
    raw = bytearray(path.read_bytes())
    raw[flip % len(raw)] ^= 1 << (flip % 7)
    path.write_bytes(bytes(raw))
    got = store.get(key)
    assert got is None or user_cache.canonical(got) == user_cache.canonical(value)


def test_corrupt_entries_are_misses_and_rebuilt(tmp_path: Path) -> None:
    store = user_cache.Store("c", root=tmp_path)
    key = {"a": 1}
    store.put(key, {"v": 2})
    path = store.path_for(key)
    good = path.read_text()
    for bad in ("", "not json", good[: len(good) // 2], good.replace('"v":2', '"v":3'), "[1, 2]", "null"):
        path.write_text(bad)
        assert store.get(key) is None, bad
    assert store.put(key, {"v": 2}) and store.get(key) == {"v": 2}  # rebuilt in place
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".tmp-")]  # no temporary left


def test_stale_and_foreign_entries_are_misses(tmp_path: Path) -> None:
    store = user_cache.Store("s", root=tmp_path)
    store.put({"mlx": "0.32.3"}, True)
    other = store.path_for({"mlx": "0.32.4"})
    # Another key's entry copied under this key's name (a hash collision or a foreign file).
    other.write_bytes(store.path_for({"mlx": "0.32.3"}).read_bytes())
    assert store.get({"mlx": "0.32.4"}) is None
    # An entry of another file format version, with its checksum right.
    entry = json.loads(other.read_text())
    entry.update(format=user_cache.FORMAT + 1, key={"mlx": "0.32.4"})
    entry["checksum"] = user_cache.digest(user_cache.canonical({"key": entry["key"], "value": entry["value"]}))
    other.write_text(json.dumps(entry))
    assert store.get({"mlx": "0.32.4"}) is None
    entry["format"] = user_cache.FORMAT
    other.write_text(json.dumps(entry))
    assert store.get({"mlx": "0.32.4"}) is True  # the same file with this version is read


def test_unwritable_cache_is_no_cache(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("a file where the cache folder would go")
    for root in (blocker, blocker / "below"):
        store = user_cache.Store("x", root=root)
        assert store.put({"k": 1}, 1) is False
        assert store.get({"k": 1}) is None
        store.clear()
    if os.geteuid() != 0:  # root writes through permissions
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        assert user_cache.Store("x", root=ro).put({"k": 1}, 1) is False
    assert user_cache.Store("x", root=None).put({"k": 1}, 1) is False
    assert user_cache.Store("x", root=tmp_path).put({"k": {1, 2}}, 1) is False  # not JSON: not kept


WRITER = """
import sys
from pathlib import Path
from pymlxc import user_cache
store = user_cache.Store("race", root=Path(sys.argv[1]))
me = int(sys.argv[2])
seen = set()
for i in range(300):
    assert store.put({"shared": True}, {"writer": me, "payload": "x" * (1000 * me)})
    got = store.get({"shared": True})
    assert got is not None, "a whole entry is always there once one was written"
    assert got["payload"] == "x" * (1000 * got["writer"]), got
    seen.add(got["writer"])
print(sorted(seen))
"""


def test_concurrent_writers_leave_one_whole_entry(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), str(n)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for n in (1, 2)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    got = user_cache.Store("race", root=tmp_path).get({"shared": True})
    assert got["writer"] in (1, 2) and got["payload"] == "x" * (1000 * got["writer"])
    assert [p.name for p in (tmp_path / "race").iterdir()] == [user_cache.Store("race", root=tmp_path)
                                                               .path_for({"shared": True}).name]


# ---------------------------------------------------------------------- kernel verdicts

def _counting(result: str | None) -> tuple[list[int], Any]:
    calls: list[int] = []

    def compare() -> str | None:
        calls.append(1)
        return result

    return calls, compare


def test_passing_verdict_is_kept_across_processes(tmp_path: Path) -> None:
    store = user_cache.Store("checks", root=tmp_path)
    first = CheckedOnce("the test kernel", source=__file__, store=store)
    calls, compare = _counting(None)
    assert first.verdict((64, "float32"), compare) and first.verdict((64, "float32"), compare)
    assert len(calls) == 1
    # A new process: a new object over the same cache; the check does not run again.
    again = CheckedOnce("the test kernel", source=__file__, store=store)
    assert again.verdict((64, "float32"), compare) and len(calls) == 1 and again.checks_run == 0
    assert again.verdict((128, "float32"), compare) and len(calls) == 2  # another shape: its own check
    # The same kernel from edited source: checked again.
    edited = tmp_path / "edited_kernel.py"
    edited.write_text(Path(__file__).read_text() + "\n# edited\n")
    assert CheckedOnce("the test kernel", source=str(edited), store=store).verdict((64, "float32"), compare)
    assert len(calls) == 3
    # A kernel whose check lives in another file: an edit of either file checks again.
    check_file = tmp_path / "its_check.py"
    check_file.write_text("def compare(): pass\n")
    pair = (__file__, str(check_file))
    assert CheckedOnce("the test kernel", source=pair, store=store).verdict((64, "float32"), compare)
    assert CheckedOnce("the test kernel", source=pair, store=store).verdict((64, "float32"), compare)
    assert len(calls) == 4
    check_file.write_text("def compare(): return None\n")
    assert CheckedOnce("the test kernel", source=pair, store=store).verdict((64, "float32"), compare)
    assert len(calls) == 5
    # forget(): memory and cache both, the next asker checks again.
    again.forget()
    assert CheckedOnce("the test kernel", source=__file__, store=store).verdict((64, "float32"), compare)
    assert len(calls) == 6


def test_failing_or_raising_verdicts_are_not_kept(tmp_path: Path) -> None:
    store = user_cache.Store("checks", root=tmp_path)
    calls, compare = _counting("differs by 0.5")
    for _ in range(2):
        checks = CheckedOnce("the test kernel", source=__file__, store=store)
        with pytest.warns(RuntimeWarning, match="the test kernel is not used: differs by 0.5"):
            assert not checks.verdict(("k",), compare)
    assert len(calls) == 2 and list(store.entries()) == []

    def boom() -> str | None:
        raise RuntimeError("no stream on this thread")

    with pytest.warns(RuntimeWarning, match="cannot run here"):
        assert not CheckedOnce("k", source=__file__, store=store).verdict(("k",), boom)
    assert list(store.entries()) == []


def test_a_changed_environment_checks_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pymlxc.backends.metal.kernels import check

    store = user_cache.Store("checks", root=tmp_path)
    calls, compare = _counting(None)
    CheckedOnce("k", source=__file__, store=store).verdict(1, compare)
    real = check.environment()
    monkeypatch.setattr(check, "_environment", dict(real, driver="another driver"))
    CheckedOnce("k", source=__file__, store=store).verdict(1, compare)
    monkeypatch.setattr(check, "_environment", dict(real, mlx={"mlx": "0.0.0"}))
    CheckedOnce("k", source=__file__, store=store).verdict(1, compare)
    monkeypatch.setattr(check, "_environment", real)
    CheckedOnce("k", source=__file__, store=store).verdict(1, compare)
    assert len(calls) == 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert CheckedOnce("k", source=__file__, store=None).verdict(1, compare)  # no cache: checks
    assert len(calls) == 4


def test_environment_names_the_device_and_mlx() -> None:
    from pymlxc.backends.metal.kernels.check import environment

    env = environment()
    assert env["mlx"]["mlx"] and env["mlx_c"] and env["device"].startswith("Device(")
    user_cache.canonical(env)  # plain data: it goes into the key


# ---------------------------------------------------------------------- the binding's declarations

CDEF = "typedef struct { void *ctx; } thing; int thing_count(thing t, const char *name);"


def test_declared_ffi_is_kept_and_rebuilt(tmp_path: Path) -> None:
    store = user_cache.Store("cffi", root=tmp_path)
    first = _loader.declared_ffi(CDEF, "test", store=store)
    assert first.sizeof("thing") == first.sizeof("void *")
    [path] = store.entries()
    written = path.read_bytes()
    again = _loader.declared_ffi(CDEF, "test", store=store)  # from the entry
    assert again.sizeof("thing") == first.sizeof("thing") and path.read_bytes() == written
    assert again.typeof("int(*)(thing, const char *)") is not None
    path.write_bytes(written[:100])  # corrupt: parsed again, entry rewritten
    assert _loader.declared_ffi(CDEF, "test", store=store).sizeof("thing") == first.sizeof("thing")
    assert path.read_bytes() == written
    # A checksum-valid entry whose code defines no FFI: parsed again, replaced.
    key = json.loads(written)["key"]
    store.put(key, {"source": "ffi = 42\n"})
    assert _loader.declared_ffi(CDEF, "test", store=store).sizeof("thing") == first.sizeof("thing")
    assert store.get(key)["source"] != "ffi = 42\n"
    # Other declarations: another entry, never the first one's types.
    other = _loader.declared_ffi(CDEF + " typedef struct { int a, b; } pair;", "test", store=store)
    assert other.sizeof("pair") == 8 and len(list(store.entries())) == 2


def test_declared_ffi_without_cache(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    for root in (None, tmp_path / "f" / "x"):  # off, and a folder that cannot be made
        ffi = _loader.declared_ffi(CDEF, "test", store=user_cache.Store("cffi", root=root))
        assert ffi.sizeof("thing") == ffi.sizeof("void *")


IMPORT = "import pymlxc.core as mx; print(mx.sum(mx.array([1.0, 2.0]) * 3).item())"


def _run(env_cache: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYMLXC_CACHE_DIR=env_cache, PYTHONWARNINGS="error")
    return subprocess.run([sys.executable, "-c", IMPORT], env=env, capture_output=True, text=True, timeout=300,
                          cwd=ROOT)


def test_binding_imports_from_a_fresh_warm_corrupt_or_unwritable_cache(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    fresh = _run(str(cache))
    assert fresh.returncode == 0 and fresh.stdout.strip() == "9.0", fresh.stderr
    entries = sorted((cache / "cffi").iterdir())
    assert len(entries) == 2  # the declarations and their fast view
    stamps = [p.stat().st_mtime_ns for p in entries]
    warm = _run(str(cache))
    assert warm.returncode == 0 and warm.stdout.strip() == "9.0", warm.stderr
    assert [p.stat().st_mtime_ns for p in entries] == stamps  # read, not rewritten
    for p in entries:
        p.write_text(textwrap.dedent("""{"format": 1, "key": "garbage"}"""))
    healed = _run(str(cache))
    assert healed.returncode == 0 and healed.stdout.strip() == "9.0", healed.stderr
    assert all(json.loads(p.read_text())["value"]["source"] for p in entries)
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    unwritable = _run(str(blocker / "cache"))
    assert unwritable.returncode == 0 and unwritable.stdout.strip() == "9.0" and not unwritable.stderr
    off = _run("off")
    assert off.returncode == 0 and off.stdout.strip() == "9.0" and not off.stderr


def test_cuda_kernel_names_carry_their_source() -> None:
    """MLX's on-disk PTX cache is keyed on the name it is given: pymlxc's names include the source."""
    from pymlxc.core.cuda_kernel import mlx_kernel_name

    body = "out[0] = inp[0];"
    a = mlx_kernel_name("copy_one", body)
    assert a.startswith("copy_one_") and a.isidentifier() and a == mlx_kernel_name("copy_one", body)
    assert len({a, mlx_kernel_name("copy_one", body + " // edited"),
                mlx_kernel_name("copy_one", body, header="#define X 1"),
                mlx_kernel_name("copy_one", "", header=body)}) == 4

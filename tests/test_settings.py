"""pymlxc/settings.py: every PYMLXC_* switch parsed strictly, read once, carried by LoadConfig, and
docs/settings.md generated from it."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pymlxc import settings
from pymlxc.options import LoadConfig
from pymlxc.settings import Settings, SettingsError
from tests.reliability.subproc import run_case

ROOT = Path(__file__).resolve().parents[1]
FIELDS = {f.name: f for f in dataclasses.fields(Settings)}
TRI_STATE = [n for n, f in FIELDS.items() if f.metadata["kind"] == "auto|0|1"]


def test_the_page_is_generated_from_the_settings() -> None:
    assert (ROOT / "docs" / "settings.md").read_text(encoding="utf-8") == settings.markdown(), \
        "docs/settings.md is stale: regenerate it as pymlxc/settings.py's docstring says"
    for name in FIELDS:
        assert f"`{settings.variable(name)}`" in settings.markdown()


def test_every_variable_the_package_names_is_a_setting() -> None:
    """No PYMLXC_ name in the package that the settings do not define (a switch read elsewhere)."""
    names: set[str] = set()
    for folder in ("pymlxc", "backends", "bridge"):
        for path in (ROOT / folder).rglob("*.py"):
            names |= set(re.findall(r"PYMLXC_[A-Z0-9_]*[A-Z0-9]", path.read_text(encoding="utf-8")))
    known = {settings.variable(n) for n in FIELDS}
    assert names - known == set()


def test_an_empty_environment_gives_the_defaults() -> None:
    assert Settings.from_env({}) == Settings()
    assert Settings.from_env({"PYMLXC_DECODE": "  ", "OTHER": "x"}) == Settings()
    assert Settings().compile is True and Settings().decode == "auto" and Settings().lib_dir is None


def test_values_are_read_by_type() -> None:
    read = Settings.from_env({"PYMLXC_COMPILE": "off", "PYMLXC_DECODE": " Segmented ", "PYMLXC_FUSED_NORM": "yes",
                              "PYMLXC_LIB_DIR": "/opt/lib", "PYMLXC_MLX_LM_PYTHON": "/opt/py/bin/python",
                              "PYMLXC_EVAL_THREAD": "0", "PYMLXC_FUSE_PROJECTIONS": "false"})
    assert read == Settings(compile=False, decode="segmented", fused_norm="1", lib_dir=Path("/opt/lib"),
                            mlx_lm_python="/opt/py/bin/python", eval_thread="0", fuse_projections=False)


@pytest.mark.parametrize(("name", "bad"), [("decode", "fast"), ("compile", "2"), ("cuda_matvec", "sometimes"),
                                           ("eval_thread", "maybe"), ("fuse_projections", "auto")])
def test_a_bad_value_names_the_variable_and_the_values_it_takes(name: str, bad: str) -> None:
    variable = settings.variable(name)
    with pytest.raises(SettingsError, match=variable) as info:
        Settings.from_env({variable: bad})
    assert repr(bad) in str(info.value)
    kind = FIELDS[name].metadata["kind"]
    expected = ["1", "0"] if kind == "bool" else kind.split("|")
    assert all(v in str(info.value) for v in expected)


def test_explicit_settings_are_checked_too() -> None:
    with pytest.raises(SettingsError, match="decode"):
        Settings(decode="fast")
    with pytest.raises(SettingsError, match="compile"):
        Settings(compile="0")  # type: ignore[arg-type]
    assert Settings(lib_dir="/x").lib_dir == Path("/x")  # type: ignore[arg-type]


@given(st.sampled_from(TRI_STATE), st.sampled_from(["auto", "AUTO", "1", "0", "true", "False", "on", "no"]))
def test_the_levers_take_auto_and_the_boolean_words(name: str, raw: str) -> None:
    value = getattr(Settings.from_env({settings.variable(name): raw}), name)
    low = raw.lower()
    assert value == ("auto" if low == "auto" else "1" if low in ("1", "true", "on") else "0")


@given(st.text(min_size=1).filter(lambda s: s.strip() and s.strip().lower() not in ("auto", "graph", "segmented")))
def test_any_other_decode_value_is_refused(raw: str) -> None:
    with pytest.raises(SettingsError, match="PYMLXC_DECODE"):
        Settings.from_env({"PYMLXC_DECODE": raw})


def test_read_once_and_overridden_for_a_block(monkeypatch: pytest.MonkeyPatch) -> None:
    first = settings.current()
    monkeypatch.setenv("PYMLXC_DECODE", "graph" if first.decode != "graph" else "segmented")
    assert settings.current() is first  # the environment is not read again
    with settings.override(decode="graph", compile=False) as inside:
        assert settings.current() is inside and inside.decode == "graph" and not inside.compile
        assert LoadConfig().settings is inside  # a config made now carries them
    assert settings.current() is first
    with pytest.raises(TypeError), settings.override(no_such_switch=1):
        pass
    assert settings.current() is first


def test_load_config_carries_settings() -> None:
    mine = Settings(decode="graph")
    assert LoadConfig(settings=mine).settings is mine
    assert LoadConfig().settings is settings.current()
    with pytest.raises(TypeError, match="settings"):
        LoadConfig(settings={"decode": "graph"})  # type: ignore[arg-type]


def test_a_bad_environment_fails_at_import_naming_the_variable() -> None:
    """The first read (when pymlxc loads) refuses a bad value: nothing silently ignores it."""
    got = run_case("""
        try:
            import pymlxc.core
            report("imported")
        except Exception as exc:
            report(f"{type(exc).__name__}: {exc}")
    """, env={"PYMLXC_DECODE": "fastest"}, timeout=120)
    assert got.startswith("SettingsError: PYMLXC_DECODE must be one of auto, graph, segmented"), got

"""Options are checked when a call is made: a bad value raises TypeError/ValueError naming the
option, before any stream starts, the same on the metal and mlx_lm backends; good values pass.

The property test draws values of every kind for every option and checks the config against an
independent statement of what each option accepts.
"""
from __future__ import annotations

import math
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pymlxc
from pymlxc.options import GenerateConfig, LoadConfig, make_config
from pymlxc.testing import write_tiny_model

TINY = 1.1754943508222875e-38


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and (v == 0 or abs(v) >= TINY)


# What each option accepts, written apart from options.py.
ACCEPTS = {
    "max_tokens": lambda v: _is_int(v) and v >= 0,
    "top_k": lambda v: _is_int(v) and v >= 0,
    "temperature": lambda v: _is_real(v) and (v == 0 or 1e-6 <= v <= 1e6),
    "top_p": lambda v: _is_real(v) and 0 <= v <= 1,
    "min_p": lambda v: _is_real(v) and 0 <= v <= 1,
    "repeat_penalty": lambda v: _is_real(v) and 0.01 <= v <= 100,
    "seed": lambda v: v is None or (_is_int(v) and 0 <= v < 2**64),
    "timeout": lambda v: v is None or (_is_real(v) and 0 < v <= threading.TIMEOUT_MAX),
    "return_logits": lambda v: isinstance(v, bool),
    "stop_tokens": lambda v: isinstance(v, (list, tuple)) and all(_is_int(t) and t >= 0 for t in v),
    "cancel": lambda v: v is None or isinstance(v, threading.Event),
}

values = st.one_of(
    st.none(), st.booleans(), st.integers(-2**70, 2**70), st.sampled_from([0, 1, 2, 5, 100]),
    st.floats(allow_nan=True, allow_infinity=True), st.floats(0, 1),
    st.sampled_from([5e-324, 1e-300, 1e-40, 2.5, 1e300]),
    st.text(max_size=3), st.lists(st.integers(-3, 10), max_size=3), st.lists(st.booleans(), max_size=2),
    st.just(threading.Event()), st.just(object()),
)


@settings(max_examples=600, deadline=None)
@given(name=st.sampled_from(sorted(ACCEPTS)), value=values)
def test_every_option_takes_exactly_its_values_and_a_refusal_names_it(name: str, value: Any) -> None:
    if ACCEPTS[name](value):
        config = make_config(GenerateConfig, **{name: value})
        got = getattr(config, name)
        if name == "stop_tokens":
            assert got == tuple(value)
        elif name != "cancel":
            assert (got == value and type(got) is type(value)) or (isinstance(value, int) and got == float(value))
    else:
        with pytest.raises((TypeError, ValueError), match=name):
            make_config(GenerateConfig, **{name: value})


@pytest.mark.parametrize("name, value", [
    ("temperature", float("nan")), ("temperature", 5e-324), ("temperature", 1e-300), ("temperature", float("inf")),
    ("repeat_penalty", float("nan")), ("repeat_penalty", 1e-300), ("timeout", float("nan")), ("timeout", 0),
    ("max_tokens", 2.5), ("max_tokens", True), ("top_k", 2.5), ("seed", "x"), ("seed", -1), ("seed", 2**64),
    ("cancel", True), ("stop_tokens", [-1]), ("stop_tokens", [True]), ("stop_tokens", 5), ("stop_tokens", "12"),
    ("top_p", float("nan")), ("min_p", -0.0 - 1e-9), ("return_logits", 1),
])
def test_the_reported_bad_values_are_refused(name: str, value: Any) -> None:
    with pytest.raises((TypeError, ValueError), match=name):
        GenerateConfig(**{name: value})


def test_load_options_are_checked_too() -> None:
    for name, value in [("context_len", 2.5), ("context_len", 0), ("parallel_slots", True), ("gpu_layers", -2),
                        ("prompt_cache_bytes", float("nan")), ("backend", 3), ("adapter_path", 3)]:
        with pytest.raises((TypeError, ValueError), match=name):
            LoadConfig(**{name: value})
    assert LoadConfig(adapter_path=Path("/x")).adapter_path == "/x"


BAD_CALLS: list[dict[str, Any]] = [
    {"temperature": float("nan")}, {"repeat_penalty": 1e-300}, {"timeout": float("nan")}, {"max_tokens": 2.5},
    {"top_k": 2.5}, {"seed": "x"}, {"cancel": True}, {"stop_tokens": [-1]},
    {"stop_tokens": [5, 10**6]},  # past the vocabulary: used to be taken, and never stopped anything
]


def _check_calls(model: Any) -> None:
    """Every bad option raises at the call (before a stream exists), then the model still works."""
    good = [t.id for t in model.generate("Once upon a time", max_tokens=4)]
    assert model.err() is None and len(good) == 4
    for bad in BAD_CALLS:
        name = next(iter(bad))
        with pytest.raises((TypeError, ValueError), match=name):
            model.generate("Once upon a time", **bad)
        with pytest.raises((TypeError, ValueError), match=name):
            model.chat([{"role": "user", "content": "hi"}], **bad)
    assert [t.id for t in model.generate("Once upon a time", max_tokens=4)] == good


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("options") / "llama", "llama", seed=0)


def test_metal_refuses_bad_options_at_the_call(llama_dir: Path) -> None:
    with pymlxc.load_model(str(llama_dir), backend="metal") as model:
        _check_calls(model)
        for bad in BAD_CALLS:
            with pytest.raises((TypeError, ValueError), match=next(iter(bad))):
                model.batch_generate(["a", "b"], **bad)


def test_mlx_lm_refuses_the_same_options_and_keeps_its_worker(llama_dir: Path) -> None:
    from pymlxc.backends.mlx_lm import MlxLmBackend

    backend = MlxLmBackend(sys.executable, response_timeout=30.0, load_timeout=120.0)
    with backend.load(str(llama_dir), LoadConfig(context_len=1024)) as model:
        _check_calls(model)


@pytest.fixture(scope="module")
def metal_model(llama_dir: Path) -> Any:
    with pymlxc.load_model(str(llama_dir), backend="metal") as model:
        yield model


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(stops=st.lists(st.integers(0, 2000), min_size=1, max_size=4), call=st.sampled_from(["generate", "chat",
                                                                                              "batch_generate"]))
def test_stop_tokens_must_be_in_the_vocabulary(metal_model: Any, stops: list[int], call: str) -> None:
    """A stop id past the vocabulary used to be taken silently: no sampled token is ever that id,
    so the generation ran on to max_tokens. It is refused at the call, naming the option and the size."""
    vocab = metal_model.info().vocab_size
    calls = {"generate": lambda **o: list(metal_model.generate("Once upon a time", **o)),
             "chat": lambda **o: list(metal_model.chat([{"role": "user", "content": "hi"}], **o)),
             "batch_generate": lambda **o: metal_model.batch_generate(["a", "b"], **o)}
    outside = [i for i, t in enumerate(stops) if t >= vocab]
    if outside:
        i = outside[0]
        with pytest.raises(ValueError, match=rf"^stop_tokens\[{i}\] is {stops[i]}, outside the model's vocabulary "
                                             rf"of {vocab} tokens"):
            calls[call](max_tokens=2, stop_tokens=stops)
    else:
        calls[call](max_tokens=2, stop_tokens=stops)
        assert metal_model.err() is None

"""The public API on both backends: a process that leaves an mlx_lm model open exits cleanly, a stop
while chat renders its template ends the stream quietly, classify keeps its failure in err(), bool
flags are checked alike, and the mlx_lm backend refuses the `distributed` load option."""
from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pymlxc
from pymlxc.backends.mlx_lm import MlxLmBackend
from pymlxc.model import GenerationCancelled, TextModel
from pymlxc.options import LoadConfig
from pymlxc.testing import write_tiny_model
from tests.reliability.subproc import run_case

BACKENDS = ("metal", "mlx_lm")
MESSAGES = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("api-hunt") / "llama", "llama", seed=3)


def _backend() -> MlxLmBackend:
    return MlxLmBackend(sys.executable, response_timeout=30.0, load_timeout=120.0)


@pytest.fixture(scope="module")
def loaded(tiny: Path) -> Iterator[dict[str, TextModel]]:
    models: dict[str, TextModel] = {
        "metal": pymlxc.load_model(str(tiny), backend="metal", context_len=1024),
        "mlx_lm": _backend().load(str(tiny), LoadConfig(context_len=1024)),
    }
    yield models
    for m in models.values():
        m.close()


@pytest.fixture(params=BACKENDS)
def model(request: pytest.FixtureRequest, loaded: dict[str, TextModel]) -> TextModel:
    return loaded[request.param]


# ---------------------------------------------------------------- an mlx_lm model left open at exit

_LEFT_OPEN = """
import sys
from pymlxc.backends.mlx_lm import MlxLmBackend, textmodel
from pymlxc.options import LoadConfig
from pymlxc.testing import write_tiny_model
if {finalizer_only}:  # leave the model to __del__ during interpreter shutdown
    import atexit
    hook = getattr(textmodel, "_close_open_models", None)
    if hook is not None:
        atexit.unregister(hook)
path = write_tiny_model({folder!r}, "llama", seed=3)
model = MlxLmBackend(sys.executable, response_timeout=30.0, load_timeout=120.0).load(str(path), LoadConfig())
report([t.id for t in model.generate("hello", max_tokens=2)])
# No close(): the model is a module global when the interpreter exits.
"""


@pytest.mark.parametrize("finalizer_only", [False, True], ids=["atexit", "finalizer"])
def test_an_mlx_lm_model_left_open_does_not_abort_the_process_at_exit(tmp_path: Path, finalizer_only: bool) -> None:
    # Closing a worker's pipes under its daemon reader threads, frozen mid-read at interpreter
    # shutdown, aborted the process: "Fatal Python error: _enter_buffered_busy" (SIGABRT).
    tokens = run_case(_LEFT_OPEN.format(folder=str(tmp_path / "llama"), finalizer_only=finalizer_only), timeout=120)
    assert len(tokens) == 2


# ---------------------------------------------------------------- stops while chat renders

def test_a_cancel_before_chat_ends_the_stream_quietly(model: TextModel) -> None:
    # The metal backend raised GenerationCancelled from chat() itself (the template renders under
    # the call's guard); a stream's stop ends the iterator, its reason in err(), as on mlx_lm.
    cancel = threading.Event()
    cancel.set()
    stream = model.chat(MESSAGES, max_tokens=4, cancel=cancel)
    assert list(stream) == []
    assert isinstance(model.err(), GenerationCancelled)
    # The next call resets err().
    assert len(list(model.chat(MESSAGES, max_tokens=2))) == 2
    assert model.err() is None


def test_an_invalid_message_still_raises_at_the_chat_call_when_cancelled(model: TextModel) -> None:
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(TypeError, match="content must be strings"):
        model.chat([{"role": "user", "content": 5}], cancel=cancel)


# ---------------------------------------------------------------- classify's failures in err()

def test_a_failed_classify_is_kept_in_err(model: TextModel) -> None:
    # The metal backend raised but left err() at None; the mlx_lm backend kept the error.
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(GenerationCancelled):
        model.classify(["hello"], cancel=cancel)
    assert isinstance(model.err(), GenerationCancelled)
    assert len(model.classify(["hello"])) == 1
    assert model.err() is None


@pytest.mark.parametrize("call", ["stream", "classify", "batch"])
def test_err_keeps_no_traceback(model: TextModel, call: str) -> None:
    # TextModel: "What it keeps holds no traceback". The mlx_lm backend kept the very exception it
    # raised, whose traceback holds the failed call's frames until the thread's next call.
    cancel = threading.Event()
    cancel.set()
    if call == "stream":
        assert list(model.generate("hello", cancel=cancel)) == []
    elif call == "classify":
        with pytest.raises(GenerationCancelled):
            model.classify(["hello"], cancel=cancel)
    else:
        model.batch_generate(["hello"], cancel=cancel)
    kept = model.err()
    assert isinstance(kept, GenerationCancelled)
    chain: list[BaseException] = []
    while kept is not None and len(chain) < 10:
        chain.append(kept)
        kept = kept.__cause__ or kept.__context__
    assert all(e.__traceback__ is None for e in chain), [(e, e.__traceback__) for e in chain]


# ---------------------------------------------------------------- bool flags

NOT_BOOLS = st.one_of(st.none(), st.integers(-2, 2), st.floats(allow_nan=False), st.text(max_size=3),
                      st.lists(st.booleans(), max_size=2))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=NOT_BOOLS)
def test_bool_flags_refuse_other_types_alike(model: TextModel, value: Any) -> None:
    # The metal backend raised tokenizers' "'str' object is not an instance of 'bool'" for encode
    # and took any truthy include_queries; the mlx_lm worker answered a bad_field (a ValueError).
    encode: Any = getattr(model, "encode")  # noqa: B009 - not in the TextModel protocol
    inspect: Any = getattr(model, "inspect_attention")  # noqa: B009
    with pytest.raises(TypeError, match=r"^add_special_tokens must be a bool, not "):
        encode("hello", add_special_tokens=value)
    with pytest.raises(TypeError, match=r"^include_queries must be a bool, not "):
        inspect("hello", include_queries=value)


def test_bool_flags_still_work(loaded: dict[str, TextModel]) -> None:
    answers = []
    for m in loaded.values():
        encode: Any = getattr(m, "encode")  # noqa: B009
        inspect: Any = getattr(m, "inspect_attention")  # noqa: B009
        answers.append((encode("hello", add_special_tokens=False), encode("hello"),
                        inspect("hello", include_queries=True).queries is not None,
                        inspect("hello", include_queries=False).queries is None))
    assert answers[0] == answers[1]
    assert answers[0][2:] == (True, True)


# ---------------------------------------------------------------- load options

@pytest.mark.parametrize("mode", ["tensor", "pipeline"])
def test_the_mlx_lm_backend_refuses_distributed(tiny: Path, mode: str) -> None:
    # It loaded the whole model on every rank, silently, where the metal backend splits it.
    with pytest.raises(ValueError, match=rf"^distributed='{mode}' is not supported by the mlx_lm backend"):
        _backend().load(str(tiny), LoadConfig(distributed=mode))

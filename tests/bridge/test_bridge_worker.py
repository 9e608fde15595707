"""The worker process over its pipes: handshake, refusals, streaming, cancel, and staying alive."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from bridge_raw_worker import BRIDGE_DIR, RawWorker  # type: ignore[import-not-found]
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from pymlxc.bridge import protocol as P

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def idle_worker() -> Any:
    """A worker with no model: it still validates every line (and answers fast, without mlx-lm)."""
    worker = RawWorker("--max-line-bytes", "4096")
    yield worker
    worker.close()


def _is_quit(line: bytes) -> bool:
    try:
        return P.parse_request(P.decode(line)).cmd == "quit"
    except P.ProtocolError:
        return False


def test_hello_comes_first_with_the_protocol_version(idle_worker: RawWorker) -> None:
    assert idle_worker.hello["type"] == "hello"
    assert idle_worker.hello["protocol"] == P.PROTOCOL_VERSION
    assert idle_worker.hello["pid"] == idle_worker.proc.pid


@FUZZ
@given(st.binary(max_size=300).filter(lambda b: b"\n" not in b))
def test_any_byte_line_gets_one_terminal_reply_and_the_worker_lives(idle_worker: RawWorker, line: bytes) -> None:
    assume(not _is_quit(line))
    idle_worker.send_raw(line + b"\n")
    reply = idle_worker.read()
    assert reply["type"] in ("error", "result")
    assert idle_worker.proc.poll() is None


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=10,
)
near_requests = st.dictionaries(
    st.sampled_from(["cmd", "id", "prompt", "prompts", "max_tokens", "tokens", "text", "messages", "path"])
    | st.text(max_size=8),
    json_values | st.sampled_from(list(P.COMMANDS)),
    max_size=5,
)


@FUZZ
@given(json_values | near_requests)
def test_any_json_value_gets_one_terminal_reply_echoing_its_id(idle_worker: RawWorker, value: Any) -> None:
    line = json.dumps(value).encode()
    assume(not _is_quit(line))
    idle_worker.send_raw(line + b"\n")
    reply = idle_worker.read()
    assert reply["type"] in ("error", "result")
    if isinstance(value, dict) and P.request_id(value) is not None:
        assert reply["id"] == value["id"]
    assert idle_worker.proc.poll() is None


def test_an_oversized_line_is_refused_and_the_next_line_served(idle_worker: RawWorker) -> None:
    idle_worker.send_raw(b'{"cmd": "info", "pad": "' + b"x" * 20_000 + b'"}\n')
    reply = idle_worker.read()
    assert reply["type"] == "error" and reply["error"] == "line_too_long"
    assert idle_worker.request(cmd="encode", id=9, text="hi") == {
        "type": "error",
        "id": 9,
        "cmd": "encode",
        "error": "no_model",
        "message": "no model is loaded; send a load command first",
    }


def test_commands_needing_a_model_say_so_and_loading_a_missing_path_fails(idle_worker: RawWorker) -> None:
    for cmd, fields in [("generate", {"prompt": "x"}), ("info", {}), ("decode", {"tokens": [1]})]:
        assert idle_worker.request(cmd=cmd, id=cmd, **fields)["error"] == "no_model"
    reply = idle_worker.request(cmd="load", id="L", path="/nonexistent/model")
    assert reply["error"] == "load_failed" and "/nonexistent/model" in reply["message"]


def test_stdout_stays_protocol_only_when_python_and_c_print() -> None:
    # Whatever prints after the worker claims stdout, from Python or through fd 1, lands on stderr.
    code = (
        "import os, sys; sys.path.insert(0, sys.argv[1]);"
        "from bridge.channel import claim_stdout, LineWriter;"
        "w = LineWriter(claim_stdout()); print('python noise'); os.write(1, b'fd noise\\n');"
        "w.send({'type': 'hello', 'protocol': 1})"
    )
    done = subprocess.run([sys.executable, "-c", code, str(BRIDGE_DIR.parent)], capture_output=True, timeout=30)
    assert done.stdout == b'{"type":"hello","protocol":1}\n'
    assert b"python noise" in done.stderr and b"fd noise" in done.stderr


def test_quit_and_end_of_input_end_the_worker_cleanly(start_worker: Any) -> None:
    worker = start_worker()
    assert worker.request(cmd="quit", id="q") == {"type": "result", "id": "q", "cmd": "quit"}
    assert worker.proc.wait(timeout=10) == 0
    worker = start_worker()
    worker.proc.stdin.close()
    assert worker.proc.wait(timeout=10) == 0


# ---- with a model ----------------------------------------------------------------------------------


def _tokens(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [line for line in lines if line["type"] == "token"]


def test_generate_streams_token_lines_then_done_with_metrics(loaded_worker: RawWorker) -> None:
    loaded_worker.send(cmd="generate", id="g", prompt="The baker", max_tokens=6)
    lines = loaded_worker.until_terminal("g")
    done = lines[-1]
    assert done["type"] == "done" and done["finish_reason"] == "length"
    assert [line["type"] for line in lines if line["type"] != "progress"] == ["token"] * 6 + ["done"]
    assert done["generation_tokens"] == 6 and done["prompt_tokens"] > 0
    assert done["prompt_tps"] > 0 and done["generation_tps"] > 0 and done["peak_memory_bytes"] > 0
    text = "".join(t["token"] for t in _tokens(lines))
    decoded = loaded_worker.request(cmd="decode", id="d", tokens=[t["token_id"] for t in _tokens(lines)])
    assert decoded["text"].strip() == text.strip()  # mlx-lm's streaming detokenizer drops a leading space


def test_a_stop_token_ends_the_stream_without_being_sent(loaded_worker: RawWorker) -> None:
    loaded_worker.send(cmd="generate", id="a", prompt="The baker", max_tokens=5)
    free = [t["token_id"] for t in _tokens(loaded_worker.until_terminal("a"))]
    stop = free[2]
    loaded_worker.send(cmd="generate", id="b", prompt="The baker", max_tokens=5, stop_tokens=[stop])
    lines = loaded_worker.until_terminal("b")
    assert [t["token_id"] for t in _tokens(lines)] == free[: free.index(stop)]
    assert lines[-1]["finish_reason"] == "stop"


def test_cancel_stops_a_running_stream_and_queued_requests_only(loaded_worker: RawWorker) -> None:
    loaded_worker.send(cmd="generate", id="long", prompt="Once upon a time", max_tokens=100_000)
    loaded_worker.send(cmd="generate", id="queued", prompt="x", max_tokens=100_000)
    seen = [loaded_worker.read() for _ in range(4)]
    assert any(line["type"] == "token" for line in seen)
    loaded_worker.send(cmd="cancel", id="c")
    loaded_worker.send(cmd="generate", id="after", prompt="x", max_tokens=3)
    lines = loaded_worker.until_terminal("after")
    by_id = {(line["type"], line["id"]): line for line in lines}
    assert by_id[("result", "c")]["active"] is True
    assert by_id[("done", "long")]["finish_reason"] == "cancelled"
    assert by_id[("done", "queued")]["finish_reason"] == "cancelled"
    assert by_id[("done", "queued")]["generation_tokens"] == 0
    assert by_id[("done", "after")]["finish_reason"] == "length"
    streamed = [line for line in seen + lines if line["type"] == "token" and line["id"] == "long"]
    assert len(streamed) < 1000  # stopped at once, not after the whole budget


def test_cancel_when_idle_is_answered_and_harmless(loaded_worker: RawWorker) -> None:
    assert loaded_worker.request(cmd="cancel", id="c0") == {
        "type": "result",
        "id": "c0",
        "cmd": "cancel",
        "active": False,
    }
    assert loaded_worker.request(cmd="generate", id="g", prompt="x", max_tokens=2)["finish_reason"] == "length"


def test_chat_classify_batch_encode_and_info(loaded_worker: RawWorker, tiny_model: Path) -> None:
    chat = loaded_worker.request(cmd="chat", id="c", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert chat["type"] == "done" and chat["generation_tokens"] == 3
    classify = loaded_worker.request(cmd="classify", id="k", prompts=["a", "bb b"], return_logits=True)
    assert len(classify["results"]) == 2
    vocab = loaded_worker.request(cmd="info", id="i")["info"]["vocab_size"]
    for item in classify["results"]:
        assert len(item["logits"]) == vocab
        assert max(range(vocab), key=item["logits"].__getitem__) == item["token_id"]  # greedy
    batch = loaded_worker.request(cmd="batch_generate", id="b", prompts=["a", "bb b", "ccc"], max_tokens=4)
    assert [len(r["tokens"]) for r in batch["results"]] == [4, 4, 4]
    assert all(r["finish_reason"] == "length" and r["error"] is None for r in batch["results"])
    encoded = loaded_worker.request(cmd="encode", id="e", text="hello", add_special_tokens=False)["tokens"]
    assert loaded_worker.request(cmd="decode", id="d", tokens=encoded)["text"] == "hello"
    bad = loaded_worker.request(cmd="decode", id="d2", tokens=[vocab + 5])
    assert bad["error"] == "bad_field"
    info = loaded_worker.request(cmd="info", id="i2")
    assert info["model_type"] == "llama" and info["path"] == str(tiny_model)


sampling_values = st.fixed_dictionaries(
    {"max_tokens": st.integers(0, 4) | json_values},
    optional={
        "temperature": st.floats(0, 3) | json_values,
        "top_k": st.integers(0, 2000) | json_values,  # past the vocabulary of 512 too
        "top_p": st.floats(0, 1) | json_values,
        "min_p": st.floats(0, 1) | json_values,
        "repeat_penalty": st.floats(0.1, 3) | json_values,
        "stop_tokens": st.lists(st.integers(0, 600), max_size=3) | json_values,
        "seed": st.integers(0, 2**31) | json_values,
        "return_logits": st.booleans() | json_values,
    },
)


@FUZZ
@given(st.sampled_from(["generate", "chat", "classify", "batch_generate"]), sampling_values)
def test_sampling_fields_of_any_value_get_a_stream_or_an_error(
    loaded_worker: RawWorker, cmd: str, fields: dict[str, Any]
) -> None:
    body = {"generate": {"prompt": "ab"}, "chat": {"messages": [{"role": "user", "content": "ab"}]}}.get(
        cmd, {"prompts": ["ab", "c"]}
    )
    if type(fields.get("max_tokens")) is int:  # a valid count runs that many steps: keep the run short
        fields["max_tokens"] = min(fields["max_tokens"], 2 if cmd in ("classify", "batch_generate") else 4)
    loaded_worker.send(cmd=cmd, id="f", **body, **fields)
    last = loaded_worker.until_terminal("f")[-1]
    assert last["type"] in ("done", "result", "error")
    if last["type"] == "error":
        assert last["error"] == "bad_field" and last["message"]  # valid values never make mlx-lm fail
    assert loaded_worker.proc.poll() is None


def test_recover_repairs_the_random_state_a_failed_compiled_sampler_leaves() -> None:
    mx = pytest.importorskip("mlx.core")
    from mlx_lm.sample_utils import make_sampler

    from pymlxc.bridge.engine import Engine

    logprobs = mx.log(mx.softmax(mx.arange(8, dtype=mx.float32)[None], axis=-1))
    with pytest.raises(ValueError):
        make_sampler(0.5, top_k=100)(logprobs)  # raises inside mx.compile, with mx.random.state captured
    with pytest.raises(RuntimeError):
        mx.eval(make_sampler(0.5)(logprobs))  # ...which poisons every later sample
    Engine.recover(object.__new__(Engine))
    assert 0 <= make_sampler(0.5)(logprobs).item() < 8


# ---- reliability: what must neither kill the worker nor pass silently ----------------------------


@pytest.mark.parametrize("field, value, says", [
    ("temperature", 5e-324, "subnormal"),
    ("repeat_penalty", 1e-310, "subnormal"),
    ("temperature", 10**400, "finite"),  # float() of it overflows: that exception once ended the worker
    ("top_p", -(10**400), "finite"),
])
def test_numbers_a_sampler_cannot_use_are_refused_and_the_worker_lives(
    idle_worker: RawWorker, field: str, value: Any, says: str
) -> None:
    reply = idle_worker.request(cmd="generate", id="n", prompt="x", **{field: value})
    assert reply["type"] == "error" and reply["error"] == "bad_field"
    assert field in reply["message"] and says in reply["message"]
    assert idle_worker.request(cmd="cancel", id="alive")["type"] == "result"


def _edited_copy(model: Path, to: Path, name: str, edit: Callable[[dict[str, Any]], object]) -> Path:
    """A copy of `model` at `to` whose JSON file `name` went through `edit` (which changes it in place)."""
    shutil.copytree(model, to)
    data = json.loads((to / name).read_text())
    edit(data)
    (to / name).write_text(json.dumps(data))
    return to


def test_a_model_that_needs_custom_tokenizer_code_is_refused_at_once(
    start_worker: Any, tiny_model: Path, tmp_path: Path
) -> None:
    """transformers would ask "run the custom code? [y/N]" on stdin (the protocol pipe) and wait."""
    model = _edited_copy(tiny_model, tmp_path / "custom", "tokenizer_config.json", lambda config: config.update(
        tokenizer_class="CustomTokenizer", auto_map={"AutoTokenizer": ["tokenization_custom.CustomTokenizer", None]}
    ))
    (model / "tokenization_custom.py").write_text("raise SystemExit('the custom code ran')\n")
    worker = start_worker()
    start = time.monotonic()
    reply = worker.request(cmd="load", id="L", path=str(model))
    assert time.monotonic() - start < 20
    assert reply["error"] == "load_failed" and "custom tokenizer code" in reply["message"]
    assert "pymlxc never runs" in reply["message"] and "auto_map in tokenizer_config.json" in reply["message"]
    assert worker.request(cmd="load", id="L2", path=str(tiny_model))["type"] == "result"  # still serving


def test_a_library_reading_stdin_gets_end_of_input_not_the_protocol_pipe(start_worker: Any) -> None:
    """Runs the worker's main with a request after the line it would have stolen; input() sees EOF."""
    code = (
        f"import sys; sys.path.insert(0, {str(BRIDGE_DIR.parent)!r})\n"
        + "from bridge import worker\n"
        "seen = []\n"
        "def steal():\n"
        "    try:\n"
        "        seen.append(input())\n"
        "    except EOFError:\n"
        "        seen.append('EOF')\n"
        "def info(self, request, seq):\n"
        "    steal()\n"
        "    raise worker.P.CommandError('no_model', repr(seen))\n"
        "worker.Worker.info = info\n"
        "worker.main([])\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        input=b'{"cmd":"info","id":1}\n{"cmd":"cancel","id":2}\n{"cmd":"quit"}\n',
        capture_output=True,
        timeout=60,
    )
    replies = [json.loads(line) for line in proc.stdout.splitlines()]
    errors = [r for r in replies if r["type"] == "error"]
    assert len(errors) == 1 and errors[0]["message"] == "['EOF']", proc.stderr[-2000:]
    assert {r.get("cmd") for r in replies if r["type"] == "result"} == {"cancel", "quit"}  # no line went to input()


def test_ids_outside_the_embedding_are_refused_naming_the_id_and_its_rows(loaded_worker: RawWorker) -> None:
    for request in ({"cmd": "decode", "tokens": [3, 600]}, {"cmd": "inspect_attention", "tokens": [600, 1]}):
        reply = loaded_worker.request(id="t", **request)
        assert reply["error"] == "bad_field"
        assert "token id 600 is outside the vocabulary of 512 (the embedding's rows)" in reply["message"]


@pytest.mark.parametrize("kwargs, names", [
    ({"tools": 5}, "chat_template_kwargs.tools must be a list of objects (a tool's JSON schema each), not a number"),
    ({"tools": "x"}, "chat_template_kwargs.tools must be a list of objects (a tool's JSON schema each), not a string"),
    ({"documents": {"a": 1}}, "chat_template_kwargs.documents must be a list of objects (a document's fields each), "
                              "not an object"),
    ({"tools": [{"name": "f"}, 5]}, "chat_template_kwargs.tools item 1 must be an object (a tool's JSON schema), "
                                    "not a number"),
], ids=["tools 5", "tools str", "documents dict", "tools [{}, 5]"])
def test_tools_or_documents_of_the_wrong_type_are_bad_field_not_a_failed_template(
        loaded_worker: RawWorker, kwargs: dict[str, Any], names: str) -> None:
    # They reached apply_chat_template: `failed` with "TypeError: 'int' object is not iterable".
    messages = [{"role": "user", "content": "hi"}]
    reply = loaded_worker.request(cmd="chat", id="t", messages=messages, max_tokens=1, chat_template_kwargs=kwargs)
    assert reply["type"] == "error" and reply["error"] == "bad_field", reply
    assert reply["message"] == f"chat: {names}"
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    for fine in ({"tools": tools, "documents": [{"title": "t", "text": "x"}]}, {"tools": None, "documents": None}):
        reply = loaded_worker.request(cmd="chat", id="t", messages=messages, max_tokens=1, chat_template_kwargs=fine)
        assert reply["type"] == "done" and reply["generation_tokens"] == 1, reply


def test_a_tokenizer_larger_than_the_embedding_is_refused_at_load(
    start_worker: Any, tiny_model: Path, tmp_path: Path
) -> None:
    model = _edited_copy(tiny_model, tmp_path / "big-tokenizer", "tokenizer.json", lambda tokenizer: tokenizer[
        "added_tokens"].append({"id": 512, "content": "<|extra|>", "single_word": False, "lstrip": False,
                                "rstrip": False, "normalized": False, "special": True}))
    reply = start_worker().request(cmd="load", id="L", path=str(model))
    assert reply["error"] == "load_failed"
    assert "has 513 tokens but the model's embedding has 512 rows" in reply["message"]


def test_tokens_stream_as_sampled_and_join_with_the_tail_into_the_text(loaded_worker: RawWorker) -> None:
    loaded_worker.send(cmd="generate", id="s", prompt="The baker", max_tokens=12)
    lines = loaded_worker.until_terminal("s")
    tokens, done = _tokens(lines), lines[-1]
    assert len(tokens) == done["generation_tokens"] == 12 and done["tail"] == ""
    text = loaded_worker.request(cmd="decode", id="d", tokens=[t["token_id"] for t in tokens])["text"]
    assert "".join(t["token"] for t in tokens) + done["tail"] == (text[1:] if text.startswith(" ") else text)


def test_classify_logits_are_raw_logits_of_the_prompt_alone(loaded_worker: RawWorker) -> None:
    """Raw logits: not normalised (their log-sum-exp is not 0), and the same for a prompt batched
    with others as alone; log-probabilities differ from them by a constant per prompt."""
    both = loaded_worker.request(cmd="classify", id="k", prompts=["a", "bb b ccc"], return_logits=True)["results"]
    alone = loaded_worker.request(cmd="classify", id="k1", prompts=["bb b ccc"], return_logits=True)["results"]
    logits = np.array([r["logits"] for r in both])
    assert np.allclose(logits[1], alone[0]["logits"], atol=1e-4)
    lse = np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1)) + logits.max(1)
    assert np.all(np.abs(lse) > 1e-3)
    assert [r["token_id"] for r in both] == list(logits.argmax(1))


@pytest.mark.parametrize("value", ["0", "-1", "many", str(sys.maxsize), "99999999999999999999999"])
def test_a_max_line_bytes_below_one_or_past_ssize_t_is_refused_naming_the_option(value: str) -> None:
    """-1 once made the reader see end of input at once (the worker answered nothing and exited 0);
    0 refused every line; a limit past a C ssize_t killed the reader at the first line (OverflowError),
    after the hello had announced it, and the worker exited 0 without answering."""
    done = subprocess.run(
        [sys.executable, str(BRIDGE_DIR), "--max-line-bytes", value],
        input=b'{"cmd":"quit","id":"q"}\n', capture_output=True, timeout=60,
    )
    assert done.returncode == 2 and done.stdout == b""
    assert b"--max-line-bytes" in done.stderr and value.encode() in done.stderr


def test_the_largest_max_line_bytes_accepted_serves_requests() -> None:
    done = subprocess.run(
        [sys.executable, str(BRIDGE_DIR), "--max-line-bytes", str(sys.maxsize - 1)],
        input=b'{"cmd":"info","id":"i"}\n{"cmd":"quit","id":"q"}\n', capture_output=True, timeout=60,
    )
    replies = [json.loads(line) for line in done.stdout.splitlines()]
    assert [(r["type"], r.get("id")) for r in replies] == [("hello", None), ("error", "i"), ("result", "q")]
    assert done.returncode == 0 and replies[1]["error"] == "no_model"


def test_batches_count_every_prompt_token_as_generate_does(loaded_worker: RawWorker) -> None:
    """mlx-lm's BatchGenerator counts prefill tokens, leaving out each prompt's last: "ab" once
    counted one token in classify and two in generate."""
    prompts = ["ab", "The baker counted", "x"]
    alone = [loaded_worker.request(cmd="generate", id="g", prompt=p, max_tokens=0)["prompt_tokens"] for p in prompts]
    for cmd in ("classify", "batch_generate"):
        reply = loaded_worker.request(cmd=cmd, id=cmd, prompts=prompts, max_tokens=2)
        assert reply["type"] == "result" and reply["prompt_tokens"] == sum(alone), reply


def test_a_batch_that_runs_nothing_has_every_metric(loaded_worker: RawWorker) -> None:
    keys = set(loaded_worker.request(cmd="classify", id="k", prompts=["a"]))
    for request in ({"cmd": "classify", "prompts": []}, {"cmd": "batch_generate", "prompts": ["a"], "max_tokens": 0}):
        assert set(loaded_worker.request(id="e", **request)) == keys, request


@pytest.mark.parametrize("eos", ["x", [2, None], [True]])
def test_a_model_whose_eos_ids_are_not_integers_fails_to_load_and_leaves_no_model(
    start_worker: Any, tiny_model: Path, tmp_path: Path, eos: Any
) -> None:
    """generation_config.json's eos_token_id reaches mlx-lm unchecked ("x" became the id "x"): the load
    was answered `failed` while the model stayed loaded, and every later `info` failed too."""
    model = _edited_copy(tiny_model, tmp_path / "eos", "generation_config.json",
                         lambda config: config.update(eos_token_id=eos))
    worker = start_worker()
    reply = worker.request(cmd="load", id="L", path=str(model))
    assert reply["error"] == "load_failed" and "EOS token ids that are not integers" in reply["message"], reply
    assert worker.request(cmd="info", id="i")["error"] == "no_model"


def test_device_gpu_without_a_gpu_backend_is_refused_naming_it(start_worker: Any, tiny_model: Path) -> None:
    """It used to load on the CPU without a word."""
    mx = pytest.importorskip("mlx.core")
    if mx.is_available(mx.gpu):
        pytest.skip("this mlx has a GPU backend")
    worker = start_worker()
    reply = worker.request(cmd="load", id="L", path=str(tiny_model), device="gpu")
    assert reply["error"] == "load_failed" and "device 'gpu' is not available" in reply["message"], reply
    assert worker.request(cmd="load", id="L2", path=str(tiny_model), device="cpu")["type"] == "result"


def test_batch_pieces_of_padding_ids_join_into_the_decode(start_worker: Any, tmp_path: Path) -> None:
    """An embedding with rows past the tokenizer (padding, as Qwen's and Phi-3's): batch_generate's
    pieces showed mlx-lm's "!" for each padding id sampled, text that neither the decode nor mlx-lm's
    batch_generate text nor generate's stream has."""
    from pymlxc.testing import write_tiny_model

    model = write_tiny_model(tmp_path / "padded", "llama", seed=1, extra_config={"vocab_size": 1024})
    worker = start_worker()
    assert worker.request(cmd="load", id="L", path=str(model))["type"] == "result"
    reply = worker.request(cmd="batch_generate", id="b", prompts=["ab", "c", "The baker"], max_tokens=8)
    assert reply["type"] == "result", reply
    sampled = [t["token_id"] for r in reply["results"] for t in r["tokens"]]
    assert any(t >= 512 for t in sampled), sampled  # the random padding rows do get sampled
    for r in reply["results"]:
        text = worker.request(cmd="decode", id="d", tokens=[t["token_id"] for t in r["tokens"]])["text"]
        assert "".join(t["token"] for t in r["tokens"]) == text, r
        assert all(t["token"] == "" for t in r["tokens"] if t["token_id"] >= 512), r


_SPM_TOKENS = ["<unk>", "\u2581a", "b", "\u2581\u00e9t\u00e9", "<0x21>", "\u2581"]


class _SpmTokenizer:
    """Just what mlx-lm's SPMStreamingDetokenizer reads of a tokenizer, with ids past the table as padding."""

    def __len__(self) -> int:
        return len(_SPM_TOKENS)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [_SPM_TOKENS[i] for i in ids]


def _spm_decode(ids: list[int]) -> str:
    # As a full decode does: ids without a token (padding rows) have no text.
    pieces = [_SPM_TOKENS[i] for i in ids if i < len(_SPM_TOKENS)]
    return "".join("!" if p == "<0x21>" else p.replace("\u2581", " ") for p in pieces)


@FUZZ
@given(st.lists(st.integers(1, len(_SPM_TOKENS) + 3), max_size=8))
def test_batch_pieces_take_padding_ids_with_a_sentencepiece_detokenizer(ids: list[int]) -> None:
    """mlx-lm's SPMStreamingDetokenizer indexes its table with the id: a padding id sampled by
    batch_generate raised IndexError and failed the whole batch."""
    pytest.importorskip("mlx.core")
    from types import SimpleNamespace

    from mlx_lm.tokenizer_utils import SPMStreamingDetokenizer

    from pymlxc.bridge.detokenize import TokenBytes
    from pymlxc.bridge.engine import Engine

    engine = object.__new__(Engine)
    engine.tokenizer = SimpleNamespace(detokenizer=SPMStreamingDetokenizer(_SpmTokenizer()), decode=_spm_decode)
    engine.token_bytes = TokenBytes(engine.tokenizer.detokenizer, _spm_decode)  # as Engine.__init__ makes it
    pieces = engine._pieces(ids)
    assert [p["token_id"] for p in pieces] == ids
    assert "".join(p["token"] for p in pieces) == _spm_decode(ids)
    assert all(p["token"] == "" for p in pieces if p["token_id"] >= len(_SPM_TOKENS))


@st.composite
def _nested_with_a_surrogate(draw: st.DrawFn) -> Any:
    """A JSON value with a lone surrogate string somewhere inside, among other values."""
    value: Any = draw(st.sampled_from(["\ud800", "ok \udfff"]))
    for wrap in draw(st.lists(st.sampled_from(["list", "dict"]), max_size=6)):
        siblings = draw(st.lists(json_values, max_size=2))
        if wrap == "list":
            at = draw(st.integers(0, len(siblings)))
            value = [*siblings[:at], value, *siblings[at:]]
        else:
            value = {**{f"k{i}": s for i, s in enumerate(siblings)}, draw(st.text(max_size=6)): value}
    return value


@FUZZ
@given(st.sampled_from(["bos_token", "my_variable", "tools"]), _nested_with_a_surrogate())
def test_a_lone_surrogate_inside_chat_template_kwargs_is_bad_field_naming_where(
    idle_worker: RawWorker, name: str, value: Any
) -> None:
    """The template renders such a string into the prompt, which the tokenizer cannot encode: the chat
    failed with "TypeError: TextEncodeInput must be Union[...]", naming no field."""
    kwargs = {name: [{"schema": value}] if name == "tools" else value}
    messages = [{"role": "user", "content": "hi"}]
    reply = idle_worker.request(cmd="chat", id="c", messages=messages, chat_template_kwargs=kwargs)
    assert reply["type"] == "error" and reply["error"] == "bad_field", reply
    assert reply["message"].startswith(f"chat: chat_template_kwargs.{name}") and "lone surrogate" in reply["message"]
    assert idle_worker.proc.poll() is None


def test_a_lone_surrogate_the_template_renders_is_bad_field_not_failed(loaded_worker: RawWorker) -> None:
    messages = [{"role": "user", "content": "hi"}]
    reply = loaded_worker.request(cmd="chat", id="s", messages=messages, max_tokens=1,
                                  chat_template_kwargs={"bos_token": "<s\ud800>"})
    assert reply["type"] == "error" and reply["error"] == "bad_field", reply
    assert reply["message"] == ("chat: chat_template_kwargs.bos_token has a lone surrogate '\\ud800' at position 2: "
                                "not valid Unicode text")
    reply = loaded_worker.request(cmd="chat", id="s", messages=messages, max_tokens=1,
                                  chat_template_kwargs={"bos_token": "<s\U0001f600>"})  # a valid pair is fine
    assert reply["type"] == "done", reply

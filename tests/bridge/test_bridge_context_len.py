"""The load's `context_len` bounds the KV caches, for models with their own `make_cache` too (llama),
and a prompt past it is refused (`context_length_exceeded`).

mlx-lm's `max_kv_size` makes a RotatingKVCache(max_kv_size, keep=4) per layer only for models without
`make_cache`; llama has one in mlx-lm >= 0.32, so the worker used to keep every token of it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from bridge_raw_worker import RawWorker  # type: ignore[import-not-found]

from pymlxc.testing import write_tiny_model

mx = pytest.importorskip("mlx.core")
mlx_lm = pytest.importorskip("mlx_lm")
from mlx_lm.generate import BatchGenerator, generate_step  # noqa: E402
from mlx_lm.models.cache import (  # noqa: E402
    ArraysCache,
    CacheList,
    ChunkedKVCache,
    KVCache,
    RotatingKVCache,
    make_prompt_cache,
)

from pymlxc.bridge import engine as E  # noqa: E402

CONTEXT = 8
PROMPT = "The baker counted"  # fits the context; the generated tokens go past it
LONG = "The baker counted the coins"  # 11 tokens: past the context
BATCH = ["x", PROMPT]


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> tuple[Any, Any]:
    """mlx-lm in this process, on the workers' model."""
    return mlx_lm.load(str(tiny_model))


@pytest.fixture(scope="module")
def bounded_worker(tiny_model: Path) -> Any:
    worker = RawWorker()
    reply = worker.request(cmd="load", id="load", path=str(tiny_model), context_len=CONTEXT)
    assert reply["type"] == "result" and reply["context_len"] == CONTEXT, reply
    yield worker
    worker.close()


def _rotating(model: Any) -> list[Any]:
    """What max_kv_size=CONTEXT makes for a model without make_cache (mlx-lm's make_prompt_cache)."""
    return [RotatingKVCache(max_size=CONTEXT, keep=4) for _ in model.layers]


def _generated(worker: RawWorker, rid: str, max_tokens: int) -> list[int]:
    worker.send(cmd="generate", id=rid, prompt=PROMPT, max_tokens=max_tokens)
    lines = worker.until_terminal(rid)
    assert lines[-1]["type"] == "done", lines[-1]
    return [line["token_id"] for line in lines if line["type"] == "token"]


def test_llama_has_its_own_make_cache_which_max_kv_size_does_not_reach(reference: tuple[Any, Any]) -> None:
    # The cause, pinned: should mlx-lm start applying max_kv_size to own caches, this says so.
    model, _ = reference
    assert hasattr(model, "make_cache")
    assert all(type(c) is KVCache for c in make_prompt_cache(model, max_kv_size=CONTEXT))


def test_context_len_bounds_a_llama_generation_as_max_kv_size_means(
    bounded_worker: RawWorker, loaded_worker: RawWorker, reference: tuple[Any, Any]
) -> None:
    model, tokenizer = reference
    ids = tokenizer.encode(PROMPT)
    assert len(ids) <= CONTEXT
    expected = [int(t) for t, _ in generate_step(mx.array(ids), model, max_tokens=24, prompt_cache=_rotating(model))]
    unbounded = [int(t) for t, _ in generate_step(mx.array(ids), model, max_tokens=24)]
    assert expected != unbounded  # else this prompt could not tell a bound from none
    assert _generated(bounded_worker, "g", 24) == expected
    assert _generated(loaded_worker, "free", 24) == unbounded  # loaded without context_len: no bound


def _batch_reference(model: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """mlx-lm's BatchGenerator on caches bounded as max_kv_size bounds them."""
    gen = BatchGenerator(model, max_tokens=max_tokens)
    try:
        uids = gen.insert(prompts, caches=[_rotating(model) for _ in prompts])
        out: dict[int, list[int]] = {uid: [] for uid in uids}
        while responses := gen.next_generated():  # type: ignore[no-untyped-call]  # unannotated in mlx-lm
            for r in responses:
                out[r.uid].append(int(r.token))
    finally:
        gen.close()  # type: ignore[no-untyped-call]
    return [out[uid] for uid in uids]


def test_context_len_bounds_batch_rows_and_classify(
    bounded_worker: RawWorker, loaded_worker: RawWorker, reference: tuple[Any, Any]
) -> None:
    model, tokenizer = reference

    errors: dict[int, list[Any]] = {}

    def rows(worker: RawWorker) -> list[list[int]]:
        reply = worker.request(cmd="batch_generate", id="b", prompts=BATCH, max_tokens=20)
        assert reply["type"] == "result", reply
        errors[id(worker)] = [r["error"] for r in reply["results"]]
        return [[t["token_id"] for t in r["tokens"]] for r in reply["results"]]

    def classified(worker: RawWorker) -> int:
        reply = worker.request(cmd="classify", id="k", prompts=[PROMPT])
        assert reply["type"] == "result", reply
        return int(reply["results"][0]["token_id"])

    bounded = rows(bounded_worker)
    encoded = [tokenizer.encode(p) for p in BATCH]
    # Each row as mlx-lm's BatchGenerator runs it, up to where its prompt and tokens fill the context:
    # there it ends (protocol 5; they rotated on before), its error saying so.
    room = [CONTEXT - len(ids) for ids in encoded]
    assert bounded == [row[:n] for row, n in zip(_batch_reference(model, encoded, 20), room, strict=True)]
    cut = [n < 20 for n in room]
    assert any(cut) and [e is not None and e.startswith("ContextFull: ") for e in errors[id(bounded_worker)]] == cut
    assert bounded != rows(loaded_worker) and errors[id(loaded_worker)] == [None] * len(BATCH)
    # classify's prefill runs through bounded caches too (a prompt that fits: nothing is evicted).
    assert classified(bounded_worker) == _batch_reference(model, [tokenizer.encode(PROMPT)], 1)[0][0]


@pytest.mark.parametrize("request_fields, what", [
    ({"cmd": "generate", "prompt": LONG}, "the prompt"),
    ({"cmd": "generate", "prompt": LONG, "max_tokens": 0}, "the prompt"),  # how a client counts: the count comes back
    ({"cmd": "classify", "prompts": ["x", LONG]}, "prompts item 1"),
    ({"cmd": "batch_generate", "prompts": ["x", LONG, "y"]}, "prompts item 1"),
    ({"cmd": "inspect_attention", "prompt": LONG}, "the prompt"),
])
def test_a_prompt_past_the_context_is_refused_with_its_counts(bounded_worker: RawWorker,
                                                                request_fields: dict[str, Any], what: str) -> None:
    # What the library raises as ContextLengthError: past the context, what the model saw of the
    # prompt depended on how each backend cut its prefill into chunks.
    reply = bounded_worker.request(id="long", **request_fields)
    cmd = request_fields["cmd"]
    assert reply == {"type": "error", "id": "long", "cmd": cmd, "error": "context_length_exceeded",
                     "message": f"{cmd}: {what} has 11 tokens, more than the context length of {CONTEXT}",
                     "prompt_tokens": 11, "context_len": CONTEXT, "item": 1 if "item" in what else None}
    assert len(_generated(bounded_worker, "after", 2)) == 2  # and it serves on


def test_a_chat_past_the_context_is_refused(bounded_worker: RawWorker) -> None:
    reply = bounded_worker.request(cmd="chat", id="c", messages=[{"role": "user", "content": LONG}], max_tokens=0)
    assert reply["error"] == "context_length_exceeded" and reply["context_len"] == CONTEXT, reply
    assert reply["prompt_tokens"] > CONTEXT and reply["message"].startswith("chat: the prompt has")


# ---- which layers are bounded, and how: what the metal backend's make_layer_caches does ---------------


def test_the_sinks_are_the_metal_backends() -> None:
    from pymlxc.backends.metal.cache import CONTEXT_KEEP

    assert E.CONTEXT_KEEP == CONTEXT_KEEP


@pytest.mark.parametrize("context_len, keep", [(8, 4), (3, 2), (1, 0)])
def test_plain_kv_caches_rotate_at_context_len_keeping_the_first_tokens(context_len: int, keep: int) -> None:
    caches, left = E.bounded_caches([KVCache(), KVCache()], context_len)
    assert left == []
    assert [(type(c), c.max_size, c.keep) for c in caches] == [(RotatingKVCache, context_len, keep)] * 2


def test_without_context_len_the_models_caches_are_untouched() -> None:
    made = [KVCache(), RotatingKVCache(max_size=16)]
    caches, left = E.bounded_caches(made, None)
    assert caches == made and left == []


def test_windows_that_fit_and_recurrent_state_are_kept_longer_windows_bounded() -> None:
    window, fitting, state = RotatingKVCache(max_size=16), ChunkedKVCache(8), ArraysCache(size=2)
    caches, left = E.bounded_caches([window, KVCache(), state, fitting], 32)
    assert left == []
    assert caches[0] is window and caches[2] is state and caches[3] is fitting
    assert (type(caches[1]), caches[1].max_size, caches[1].keep) == (RotatingKVCache, 32, 4)
    # A window longer than the context is bounded by it, sinks and all, as a full-attention layer.
    caches, _ = E.bounded_caches([window], 8)
    assert (type(caches[0]), caches[0].max_size, caches[0].keep) == (RotatingKVCache, 8, 4)


def test_caches_mlx_lm_cannot_rotate_are_left_and_named() -> None:
    pair, chunked = CacheList(KVCache(), KVCache()), ChunkedKVCache(64)
    caches, left = E.bounded_caches([pair, chunked, KVCache()], 8)
    assert caches[0] is pair and caches[1] is chunked and type(caches[2]) is RotatingKVCache
    assert left == ["CacheList", "ChunkedKVCache"]


@pytest.mark.parametrize("arch, kinds", [
    ("gemma3_text", [(RotatingKVCache, 16, 0), (RotatingKVCache, 32, 4)]),  # its window of 16 fits in 32
    ("qwen3_next", [ArraysCache, (RotatingKVCache, 32, 4), ArraysCache, (RotatingKVCache, 32, 4)]),
])
def test_the_engine_bounds_the_attention_layers_of_mixed_models(
    tmp_path: Path, arch: str, kinds: list[Any]
) -> None:
    engine = E.Engine(str(write_tiny_model(tmp_path / arch, arch, seed=0)), None, 32, None)
    got = [type(c) if isinstance(c, ArraysCache) else (type(c), c.max_size, c.keep) for c in engine.make_cache()]
    assert got == kinds


def test_a_model_whose_caches_cannot_rotate_loads_with_a_warning(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Not refused: pymlxc's client always sends a context_len (its default), so these models must load.
    from mlx_lm.models import llama

    monkeypatch.setattr(llama.Model, "make_cache", lambda self: [CacheList(KVCache()) for _ in self.layers])
    engine = E.Engine(str(tiny_model), None, CONTEXT, None)
    assert all(type(c) is CacheList for c in engine.make_cache())
    assert capsys.readouterr().err == (
        f"warning: context_len={CONTEXT} does not bound the CacheList caches of llama models (mlx-lm has no "
        "rotating form of them): those layers keep every token\n"
    )

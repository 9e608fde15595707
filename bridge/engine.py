"""The mlx-lm side of the worker: one loaded model and what the protocol's commands ask of it.

Only this module imports mlx and mlx-lm, so the worker answers its handshake (and refuses bad lines)
without paying for that import. Arguments arrive already validated by `protocol.parse_request`.
"""
from __future__ import annotations

import base64
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx_lm
import numpy as np
from mlx.nn.layers.embedding import Embedding  # the defining modules: mlx.nn re-exports them implicitly
from mlx.nn.layers.quantized import QuantizedEmbedding
from mlx_lm.generate import BatchGenerator, generate_step
from mlx_lm.models.cache import ArraysCache, ChunkedKVCache, KVCache, RotatingKVCache, make_prompt_cache
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    categorical_sampling,
    greedy_sampler,
    make_logits_processors,
)

from .detokenize import TokenBytes
from .protocol import REPEAT_PENALTY_CONTEXT, CommandError, check_context, context_full_problem

Event = dict[str, Any]
# The device mlx chose at start: what `device` null or "default" returns to after a load asked for "cpu".
_START_DEVICE = mx.default_device()
# Tokens at the start of the context that a context-bounded cache never evicts (attention sinks):
# the metal backend's CONTEXT_KEEP (backends/metal/cache.py) and mlx-lm's keep for max_kv_size, so
# that both backends mean the same by `context_len`. Not imported: the worker runs without pymlxc.
CONTEXT_KEEP = 4


class _Stopped(Exception):
    """Raised from mlx-lm's prefill progress callback to abandon a cancelled prompt."""


@dataclass
class Hooks:
    """How a generation talks back to the worker while it runs."""

    cancelled: Callable[[], bool]
    progress: Callable[[int, int], None]


def _config_value(config: dict[str, Any], key: str) -> Any:
    # Multimodal and some newer configs keep the language model's sizes under text_config.
    if key in config:
        return config[key]
    return (config.get("text_config") or {}).get(key)


def _b64(a: Any) -> str:
    """[1, heads, L, D] -> base64 of its float32 little-endian bytes, C order [heads, L, D]."""
    return base64.b64encode(np.asarray(a[0].astype(mx.float32), dtype="<f4").tobytes()).decode("ascii")


# The function each mlx-lm model module imports and calls; patched by name on modules typed as ModuleType.
_SDPA = "scaled_dot_product_attention"
# Tokens a forward pass of `inspect_attention` takes at once (mlx-lm's prefill_step_size): the
# attention's scores grow with the chunk times the keys, not with the prompt's square.
INSPECT_STEP = 2048


class _recording_queries:
    """Within the block, mlx-lm's attention calls append their queries (after RoPE, before the scale)
    to `sink`: each loaded mlx-lm model module's `scaled_dot_product_attention` is wrapped, and put
    back afterwards. `sink=None` records nothing."""

    def __init__(self, sink: list[Any] | None) -> None:
        self.sink = sink
        self.patched: list[tuple[Any, Any]] = []

    def __enter__(self) -> None:
        if self.sink is None:
            return
        sink = self.sink
        for name, module in list(sys.modules.items()):
            original = (
                getattr(module, _SDPA, None) if name.startswith("mlx_lm.models.") else None
            )
            if original is None:
                continue

            def recording(queries: Any, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
                sink.append(queries)
                return _original(queries, *args, **kwargs)

            self.patched.append((module, original))
            setattr(module, _SDPA, recording)

    def __exit__(self, *exc: object) -> None:
        for module, original in self.patched:
            setattr(module, _SDPA, original)
        self.patched.clear()


def _embedding_rows(model: Any) -> int | None:
    """Rows of the model's token embedding: the ids it can look up (a gather past them reads out of bounds)."""
    found = [(name, m) for name, m in model.named_modules() if isinstance(m, (Embedding, QuantizedEmbedding))]
    found.sort(key=lambda item: (not item[0].endswith("embed_tokens"), len(item[0])))
    return int(found[0][1].weight.shape[0]) if found else None


def _first_logits_recorder(sink: list[Any], index: int) -> Callable[[Any, Any], Any]:
    """A logits processor (the last one of prompt `index`) that keeps the first logits it sees in `sink`."""

    def record(tokens: Any, logits: Any) -> Any:
        if sink[index] is None:  # BatchGenerator may compute a step past the last token: keep the first
            sink[index] = logits
        return logits

    return record


def bounded_caches(caches: list[Any], context_len: int | None) -> tuple[list[Any], list[str]]:
    """A model's fresh `caches` with each layer bounded by `context_len` as the metal backend's
    make_layer_caches bounds it, and the kinds of cache left as they were made. mlx-lm's own
    `max_kv_size` bounds only models without a `make_cache` (make_prompt_cache hands a model's own
    caches back untouched), so llama, gemma 3, qwen3-next... would otherwise keep every token.

    A full-attention layer (KVCache), or a sliding window longer than the context, gets a
    RotatingKVCache of `context_len` that keeps the first CONTEXT_KEEP tokens; a window that fits
    is kept, as is recurrent state (ArraysCache: a fixed size, nothing to bound) and a chunked
    attention layer whose chunk fits. Any other kind (CacheList, ChunkedKVCache of a longer
    chunk, a subclass with state of its own) is left as the model made it and named in the
    second result: mlx-lm has no rotating form of it. It is not refused, because pymlxc's client
    always sends a context_len (its default 131072), so a refusal would stop these models from
    loading at all.
    """
    if context_len is None:
        return caches, []
    keep = min(CONTEXT_KEEP, context_len - 1)  # a sink per slot would leave nothing to rotate
    out: list[Any] = []
    left: set[str] = set()
    for c in caches:
        # Exact types: a subclass may carry state that a plain rotating cache would drop.
        if type(c) is KVCache or (type(c) is RotatingKVCache and c.max_size > context_len):
            out.append(RotatingKVCache(max_size=context_len, keep=keep))  # type: ignore[no-untyped-call]  # mlx-lm
        else:
            fits = type(c) is RotatingKVCache or (type(c) is ChunkedKVCache and c.chunk_size <= context_len)
            if not (fits or isinstance(c, ArraysCache)):
                left.add(type(c).__name__)
            out.append(c)
    return out, sorted(left)


class Engine:
    """A model and tokenizer loaded by mlx-lm, with the worker's commands as methods."""

    def __init__(self, path: str, adapter_path: str | None, context_len: int | None, device: str | None) -> None:
        # The worker has checked that the paths are directories (mlx_lm.load would try the network)
        # and that the model asks for no custom code; trust_remote_code=False is the second guard.
        # Set on every load: the default device is process-wide, so "cpu" would otherwise outlive its model.
        try:
            mx.set_default_device({"cpu": mx.cpu, "gpu": mx.gpu}.get(device or "default", _START_DEVICE))
        except ValueError as e:  # "gpu" where mlx has no GPU backend
            raise CommandError("load_failed", f"device {device!r} is not available here: {e}") from None
        try:
            loaded = mlx_lm.load(
                path, adapter_path=adapter_path, return_config=True,
                tokenizer_config={"trust_remote_code": False}, trust_remote_code=False)
        except Exception as e:  # mlx-lm raises several kinds (ValueError, KeyError, FileNotFoundError...)
            raise CommandError("load_failed", f"mlx-lm could not load {path!r}: {type(e).__name__}: {e}") from e
        if len(loaded) != 3:  # its annotation allows two results; return_config=True asks for three
            raise CommandError(
                "load_failed", f"mlx-lm's load returned {len(loaded)} values, not (model, tokenizer, config)"
            )
        self.model, self.tokenizer, self.config = loaded
        self.path, self.adapter_path, self.context_len = path, adapter_path, context_len
        # Ids are checked against the embedding's rows: the config's vocab_size may say otherwise.
        rows = _embedding_rows(self.model)
        self.vocab_size = rows if rows is not None else self.info()["vocab_size"]
        tokens = len(self.tokenizer._tokenizer)
        if tokens > self.vocab_size:
            raise CommandError(
                "load_failed",
                f"the tokenizer of {path!r} has {tokens} tokens but the model's embedding "
                f"has {self.vocab_size} rows: ids from {self.vocab_size} on have no embedding",
            )
        # generation_config.json's eos_token_id reaches mlx-lm unchecked; a non-integer one would stop nothing.
        odd = [t for t in self.tokenizer.eos_token_ids if isinstance(t, bool) or not isinstance(t, int)]
        if odd:
            raise CommandError(
                "load_failed", f"the model at {path!r} names EOS token ids that are not integers: {odd!r}"
            )
        self.token_bytes = TokenBytes(self.tokenizer.detokenizer, self.tokenizer.decode)
        _, left = bounded_caches(make_prompt_cache(self.model), context_len)
        if left:  # said once, at load; the client logs the worker's stderr
            print(f"warning: context_len={context_len} does not bound the {', '.join(left)} caches of "
                  f"{self.model_type} models (mlx-lm has no rotating form of them): those layers keep "
                  "every token", file=sys.stderr, flush=True)

    def make_cache(self) -> list[Any]:
        """Fresh caches for one sequence, bounded by the load's context_len (`bounded_caches`)."""
        return bounded_caches(make_prompt_cache(self.model), self.context_len)[0]

    # ---- facts ----------------------------------------------------------------------------------

    @property
    def model_type(self) -> str:
        return str(self.config.get("model_type", "unknown"))

    def info(self) -> dict[str, Any]:
        layers = getattr(self.model, "layers", None)
        quant = self.config.get("quantization") or {}
        return {
            "architecture": self.model_type,
            "vocab_size": int(_config_value(self.config, "vocab_size") or len(self.tokenizer.get_vocab())),
            "num_layers": (
                len(layers) if layers is not None else int(_config_value(self.config, "num_hidden_layers") or 0)
            ),
            "hidden_size": int(_config_value(self.config, "hidden_size") or 0),
            "quant_bits": int(quant.get("bits", 0)),
            "quant_group": int(quant.get("group_size", 0)),
        }

    def describe(self) -> dict[str, Any]:
        return {
            "model_type": self.model_type,
            "info": self.info(),
            "path": self.path,
            "adapter_path": self.adapter_path,
            "context_len": self.context_len,
            "eos_token_ids": sorted(self.tokenizer.eos_token_ids),
            "mlx_lm_version": mlx_lm.__version__,
        }

    def inspect_limit(self) -> int | None:
        """The longest prompt `inspect_attention` takes: the load's context_len (what generation's
        caches keep), else the model's max_position_embeddings; None where neither is known."""
        if self.context_len is not None:
            return self.context_len
        positions = _config_value(self.config, "max_position_embeddings")
        return positions if isinstance(positions, int) and not isinstance(positions, bool) and positions > 0 else None

    def recover(self) -> None:
        """Undo what a failed command may leave behind. An exception inside one of mlx-lm's compiled
        samplers leaves mlx's global random state a placeholder that makes every later sample fail;
        reseeding replaces it."""
        mx.random.seed(int.from_bytes(os.urandom(8), "little"))

    # ---- tokens ---------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, tokens: list[int]) -> str:
        return str(self.tokenizer.decode(self.check_tokens(tokens, "decode")))

    def check_tokens(self, tokens: list[int], cmd: str = "inspect_attention") -> list[int]:
        """`tokens`, after checking that each has an embedding row (every id passes here before MLX sees it)."""
        bad = [t for t in tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise CommandError(
                "bad_field",
                f"{cmd}: token id {bad[0]} is outside the vocabulary of {self.vocab_size} "
                f"(the embedding's rows)" + (f"; {len(bad)} such ids" if len(bad) > 1 else ""),
            )
        return tokens

    def prompt_tokens(self, prompt: str, cmd: str = "generate") -> list[int]:
        # As mlx-lm's stream_generate: add special tokens unless the prompt already starts with BOS.
        bos = self.tokenizer.bos_token
        tokens = self.encode(prompt, add_special_tokens=bos is None or not prompt.startswith(bos))
        if not tokens:
            raise CommandError("bad_field", "prompt encodes to no tokens")
        return self.check_tokens(tokens, cmd)

    def chat_tokens(self, messages: list[dict[str, str]], template_kwargs: dict[str, Any] | None = None) -> list[int]:
        if not self.tokenizer.has_chat_template:
            raise CommandError("no_chat_template", "the model's tokenizer has no chat template")
        ids = self.tokenizer.apply_chat_template(  # type: ignore[no-untyped-call]  # unannotated in mlx-lm
            messages, add_generation_prompt=True, **(template_kwargs or {})
        )
        return self.check_tokens(list(ids), "chat")

    # ---- sampling -------------------------------------------------------------------------------

    def _filters(self, opts: dict[str, Any]) -> list[Callable[[Any], Any]]:
        """mlx-lm's filters in pymlxc's order (backends/metal/sample.py, llama.cpp's): top-k, then
        top-p over what top-k kept, then min-p. mlx-lm's make_sampler applies top-p to the whole
        distribution before top-k, which keeps other tokens when both are set."""
        # top_k beyond the vocabulary keeps every token, i.e. is off; mlx-lm would raise instead.
        top_k = opts["top_k"] if opts["top_k"] < self.vocab_size else 0
        top_p, min_p = opts["top_p"], opts["min_p"]
        filters: list[Callable[[Any], Any]] = []
        if top_k > 0:
            filters.append(lambda x: apply_top_k(x, top_k))
        if 0.0 < top_p < 1.0:
            filters.append(lambda x: apply_top_p(x, top_p))
        if min_p > 0.0:
            filters.append(lambda x: apply_min_p(x, min_p))
        return filters

    def _sampling(self, opts: dict[str, Any]) -> tuple[Any, list[Any]]:
        """The sampler (on mlx's global random state, seeded here when asked) and logits processors."""
        if opts["seed"] is not None:
            mx.random.seed(opts["seed"] % (1 << 64))  # mlx takes a uint64; any JSON integer is accepted
        temperature = opts["temperature"]
        sampler: Callable[[Any], Any] = greedy_sampler
        if temperature != 0.0:
            filters = self._filters(opts)

            def sample(logprobs: Any) -> Any:
                for f in filters:
                    logprobs = f(logprobs)
                return categorical_sampling(logprobs, temperature)

            sampler = sample
        penalty = opts["repeat_penalty"]
        processors = make_logits_processors(repetition_penalty=penalty if penalty != 1.0 else None,
                                            repetition_context_size=REPEAT_PENALTY_CONTEXT)
        return sampler, processors

    def _row_samplers(self, opts: dict[str, Any], rows: int) -> list[Callable[[Any], Any]] | None:
        """One sampler per row of a seeded batch, each with its own key from the seed (None where the
        batch shares one): a row then samples as `generate` does with that seed, whatever else the
        batch holds, as the metal backend's batch rows do."""
        temperature, seed = opts["temperature"], opts["seed"]
        if temperature == 0.0 or seed is None or rows < 2:
            return None
        filters = self._filters(opts)

        def keyed(state: list[Any]) -> Callable[[Any], Any]:
            def sample(logprobs: Any) -> Any:
                for f in filters:
                    logprobs = f(logprobs)
                # How mlx draws from its global state: split, keep the first half, draw with the second.
                state[0], key = mx.random.split(state[0])
                return mx.random.categorical(logprobs * (1.0 / temperature), key=key)

            return sample

        return [keyed([mx.random.key(seed % (1 << 64))]) for _ in range(rows)]

    def _memory(self) -> dict[str, int]:
        return {"peak_memory_bytes": int(mx.get_peak_memory()), "active_memory_bytes": int(mx.get_active_memory())}

    def _no_work(self) -> dict[str, Any]:
        """The metrics of a batch that ran nothing: every key a run's reply has, so replies keep one shape."""
        times = ("prompt_time", "generation_time", "total_time", "prompt_tps", "generation_tps")
        return {"prompt_tokens": 0, "generation_tokens": 0, **dict.fromkeys(times, 0.0), **self._memory()}

    # ---- generate -------------------------------------------------------------------------------

    def generate(self, tokens: list[int], opts: dict[str, Any], hooks: Hooks) -> Iterator[Event]:
        """Yield {"token_id", "token"} events, each as soon as its token is sampled, then one
        {"finish_reason", "tail", metrics...} event. A token's text is "" while a character is
        unfinished; `tail` is what is still held when the stream ends (an unfinished character)."""
        mx.reset_peak_memory()
        stop_ids = set(self.tokenizer.eos_token_ids) | set(opts["stop_tokens"])
        sampler, processors = self._sampling(opts)
        text = self.token_bytes.stream()
        finish, count = "length", 0
        start = time.perf_counter()
        prompt_time = 0.0

        def on_progress(processed: int, total: int) -> None:
            if hooks.cancelled():
                raise _Stopped
            if 0 < processed < total:  # one heartbeat per prefill chunk, for long prompts
                hooks.progress(processed, total)

        if opts["max_tokens"] == 0 or hooks.cancelled():
            finish = "length" if opts["max_tokens"] == 0 else "cancelled"
            steps: Iterator[Any] = iter(())
        else:
            steps = generate_step(
                mx.array(tokens),
                self.model,
                max_tokens=opts["max_tokens"],
                sampler=sampler,
                logits_processors=processors,
                prompt_cache=self.make_cache(),  # not max_kv_size: mlx-lm ignores it for models with make_cache
                prompt_progress_callback=on_progress,
            )
        try:
            for token, _ in steps:
                if count == 0:
                    prompt_time = time.perf_counter() - start
                if token in stop_ids:
                    finish = "stop"
                    break
                if hooks.cancelled():
                    finish = "cancelled"
                    break
                count += 1
                piece = text.add(int(token))
                if count == opts["max_tokens"]:  # known to be the last: it takes any unfinished character
                    piece += text.finish()
                yield {"token_id": int(token), "token": piece}
        except _Stopped:
            finish = "cancelled"
        tail = text.finish()
        total = time.perf_counter() - start
        decode_time = total - prompt_time if count else 0.0
        yield {
            "finish_reason": finish,
            "tail": tail,
            "prompt_tokens": len(tokens),
            "generation_tokens": count,
            "prompt_time": prompt_time,
            "generation_time": decode_time,
            "total_time": total,
            "prompt_tps": len(tokens) / prompt_time if prompt_time > 0 else 0.0,
            "generation_tps": count / decode_time if decode_time > 0 else 0.0,
            **self._memory(),
        }

    # ---- attention ------------------------------------------------------------------------------

    def inspect_attention(self, tokens: list[int], include_queries: bool) -> dict[str, Any]:
        """Keys (after RoPE) of every layer from fresh caches after one forward pass of `tokens`, and
        the queries recorded at each attention call when asked; arrays as base64 float32 LE."""
        # Before the passes: positions past the context are not the model's.
        check_context("inspect_attention", len(tokens), self.inspect_limit())
        cache = make_prompt_cache(self.model)
        chunks: list[list[Any]] = []
        for start in range(0, len(tokens), INSPECT_STEP):
            recorded: list[Any] = []
            with _recording_queries(recorded if include_queries else None):
                self.model(mx.array(tokens[start:start + INSPECT_STEP])[None], cache=cache)
            # Evaluated chunk by chunk, so that each pass's temporaries go before the next one's.
            mx.eval([x for c in cache for x in (getattr(c, "keys", None), getattr(c, "values", None))
                     if isinstance(x, mx.array)], recorded)
            chunks.append(recorded)
        if include_queries and len({len(c) for c in chunks}) > 1:
            raise CommandError("failed", "inspect_attention: the chunks of the prompt made different numbers of "
                               "attention calls; this architecture's attention is not supported")
        # A layer's queries, chunk after chunk, on the sequence axis [B, heads, L, D].
        queries = [mx.concatenate(list(q), axis=2) if len(q) > 1 else q[0] for q in zip(*chunks, strict=True)]
        keys = []
        for i, c in enumerate(cache):
            # One chunk into empty KVCache / RotatingKVCache buffers: positions 0..offset-1 in order.
            k = getattr(c, "keys", None)
            if (
                getattr(c, "offset", None) != len(tokens)
                or not isinstance(k, mx.array)
                or k.ndim != 4
                or k.shape[2] < len(tokens)
            ):
                raise CommandError("failed", f"inspect_attention: layer {i}'s cache ({type(c).__name__}) does not hold "
                                   f"one key per token; this architecture is not supported")
            keys.append(k[..., : len(tokens), :])
        if include_queries and len(queries) != len(keys):
            raise CommandError(
                "failed",
                f"inspect_attention: {len(queries)} attention calls seen for {len(keys)} layers; "
                "this architecture's attention is not supported",
            )
        mx.eval(keys, queries)
        layers = []
        for i, k in enumerate(keys):
            layer: dict[str, Any] = {
                "kv_heads": k.shape[1],
                "head_dim": k.shape[3],
                "keys": _b64(k),
                "query_heads": None,
                "queries": None,
            }
            if include_queries:
                layer.update(query_heads=queries[i].shape[1], queries=_b64(queries[i]))
            layers.append(layer)
        return {
            "architecture": self.model_type,
            "num_layers": len(layers),
            "num_kv_heads": layers[0]["kv_heads"],
            "num_query_heads": int(_config_value(self.config, "num_attention_heads") or 0) if not include_queries
            else layers[0]["query_heads"],
            "head_dim": layers[0]["head_dim"],
            "seq_len": len(tokens),
            "token_ids": tokens,
            "encoding": "base64-float32-le",
            "layers": layers,
        }

    # ---- batches --------------------------------------------------------------------------------

    def _run_batch(
        self,
        prompts: list[list[int]],
        opts: dict[str, Any],
        max_tokens: int | list[int],
        stops: list[list[int]],
        cancelled: Callable[[], bool],
        first_logits: list[Any] | None = None,
        row_samplers: bool = False,
    ) -> tuple[dict[int, list[tuple[int, Any]]], dict[int, str], dict[str, Any]]:
        """Run mlx-lm's BatchGenerator; per prompt index: (token, logprobs) pairs and a finish reason.

        `first_logits`, when given, receives per prompt the logits its first token was sampled from
        (after the logits processors), which BatchGenerator does not return: it hands the sampler
        only their log-probabilities. `row_samplers`: a seeded batch's rows each sample with their own
        key (`_row_samplers`, batch_generate); else they share one draw (classify, as the metal
        backend's classify samples its rows at once)."""
        sampler, processors = self._sampling(opts)
        samplers = self._row_samplers(opts, len(prompts)) if row_samplers else None
        per_prompt = None
        if first_logits is not None:
            first_logits[:] = [None] * len(prompts)
            per_prompt = [[*processors, _first_logits_recorder(first_logits, i)] for i in range(len(prompts))]
        rows_max = max_tokens if isinstance(max_tokens, list) else None  # per prompt, or one for all
        gen = BatchGenerator(
            self.model,
            max_tokens=max(max_tokens) if isinstance(max_tokens, list) else max_tokens,
            stop_tokens=stops or None,
            sampler=sampler,
            logits_processors=processors,
        )
        steps: dict[int, list[tuple[int, Any]]] = {}
        finish: dict[int, str] = {}
        try:
            # Each row's caches bounded as generate's are (BatchGenerator's max_kv_size has mlx-lm's gap).
            uids = gen.insert(prompts, max_tokens=rows_max, caches=[self.make_cache() for _ in prompts],
                              samplers=samplers, logits_processors=per_prompt)
            index = {uid: i for i, uid in enumerate(uids)}
            steps = {i: [] for i in range(len(prompts))}
            with gen.stats() as stats:
                while len(finish) < len(prompts):
                    if cancelled():
                        break
                    responses = gen.next_generated()  # type: ignore[no-untyped-call]  # unannotated in mlx-lm
                    if not responses:
                        break
                    for r in responses:
                        i = index[r.uid]
                        steps[i].append((int(r.token), r.logprobs))
                        if r.finish_reason is not None:
                            finish[i] = r.finish_reason
        finally:
            gen.close()  # type: ignore[no-untyped-call]  # unannotated in mlx-lm
        for i in range(len(prompts)):
            finish.setdefault(i, "cancelled")
        metrics = {
            # Every prompt token, as generate counts them: mlx-lm's count leaves out each prompt's last
            # token, which it runs in the first generation step.
            "prompt_tokens": sum(len(p) for p in prompts),
            "generation_tokens": stats.generation_tokens,
            "prompt_time": stats.prompt_time,
            "generation_time": stats.generation_time,
            "total_time": stats.wall_time,
            "prompt_tps": stats.prompt_tps,
            "generation_tps": stats.generation_tps,
            **self._memory(),
        }
        return steps, finish, metrics

    def classify(
        self, prompts: list[str], opts: dict[str, Any], cancelled: Callable[[], bool]
    ) -> tuple[list[Event], dict[str, Any]]:
        """One prefill per prompt, batched, and the token sampled after it (with its raw logits if asked)."""
        mx.reset_peak_memory()
        if not prompts:
            return [], self._no_work()
        encoded = []
        for i, prompt in enumerate(prompts):
            try:
                encoded.append(self.prompt_tokens(prompt))
            except CommandError as e:
                raise CommandError(e.code, f"classify: prompts item {i}: {e}") from None
        for i, ids in enumerate(encoded):  # every prompt fits, or none runs
            check_context("classify", len(ids), self.context_len, item=i)
        logits: list[Any] | None = [] if opts["return_logits"] else None
        steps, finish, metrics = self._run_batch(encoded, opts, 1, [], cancelled, first_logits=logits)
        if any(reason == "cancelled" for reason in finish.values()):
            raise CommandError("cancelled", "classify was cancelled")
        results = []
        for i in range(len(prompts)):
            token, _ = steps[i][0]
            item: Event = {"token_id": token, "token": self.tokenizer.decode([token])}
            if logits is not None:
                if logits[i] is None:
                    raise RuntimeError(f"classify: no logits were recorded for prompts item {i}")
                item["logits"] = logits[i].astype(mx.float32).reshape(-1).tolist()
            results.append(item)
        return results, metrics

    def batch_generate(
        self, prompts: list[str], opts: dict[str, Any], cancelled: Callable[[], bool]
    ) -> tuple[list[Event], dict[str, Any]]:
        """Generate for every prompt at once; each result has tokens, a finish reason and maybe an error."""
        mx.reset_peak_memory()
        results: list[Event] = [{"tokens": [], "finish_reason": "length", "error": None} for _ in prompts]
        runnable: list[int] = []
        encoded: list[list[int]] = []
        for i, prompt in enumerate(prompts):
            try:
                encoded.append(self.prompt_tokens(prompt))
                runnable.append(i)
            except CommandError as e:
                results[i].update(finish_reason="error", error=str(e))
        for i, ids in zip(runnable, encoded, strict=True):  # every prompt fits, or none runs
            check_context("batch_generate", len(ids), self.context_len, item=i)
        if not runnable or opts["max_tokens"] == 0:
            return results, self._no_work()
        # A row ends where its prompt and tokens fill the context (as the metal backend's batch rows;
        # generate's caches rotate on): each row's max_tokens is what the context holds after its prompt.
        max_tokens, limit = opts["max_tokens"], self.context_len
        room = {i: max_tokens if limit is None else min(max_tokens, limit - len(ids))
                for i, ids in zip(runnable, encoded, strict=True)}

        def context_full(i: int, prompt: int, generated: int) -> None:
            if limit is not None and room[i] < max_tokens:  # the context, not max_tokens, ended the row
                results[i]["error"] = "ContextFull: " + context_full_problem(prompt, generated, limit, max_tokens)

        for i, ids in zip(runnable, encoded, strict=True):
            if room[i] <= 0:  # no room at all: the prompt is the whole context
                context_full(i, len(ids), 0)
        rows = [(i, ids) for i, ids in zip(runnable, encoded, strict=True) if room[i] > 0]
        if not rows:
            return results, self._no_work()
        stops = [[t] for t in sorted(set(self.tokenizer.eos_token_ids) | set(opts["stop_tokens"]))]
        steps, finish, metrics = self._run_batch([ids for _, ids in rows], opts, [room[i] for i, _ in rows], stops,
                                                 cancelled, row_samplers=True)
        for j, (i, row_ids) in enumerate(rows):
            reason = finish[j]
            ids = [t for t, _ in steps[j]]
            if reason == "stop":  # the stop token itself is not part of the answer
                ids = ids[:-1]
            results[i].update(tokens=self._pieces(ids), finish_reason=reason)
            if reason == "length":
                context_full(i, len(row_ids), len(ids))
        # The tokens answered, as generate counts them: mlx-lm's count takes in each row's stop token.
        count = sum(len(results[i]["tokens"]) for i in runnable)
        time_spent = metrics["generation_time"]
        metrics.update(generation_tokens=count, generation_tps=count / time_spent if time_spent > 0 else 0.0,
                       prompt_tokens=sum(len(ids) for ids in encoded))
        return results, metrics

    def _pieces(self, ids: list[int]) -> list[Event]:
        """Per-token text whose pieces join into the full decode, as mlx-lm's batch_generate returns it.

        Made by the stream `generate` sends (TokenBytes), not by mlx-lm's detokenizer: its BPE one
        reads the byte 0x00 (the token "\u0100") as the letter "\u0100" where the decode has "\x00",
        shows an id past the tokenizer's table (a padding row of the embedding) as "!", and its SPM
        one raises IndexError on such an id. Those ids have no text, in the decode as in the stream."""
        table = self.token_bytes
        text = table.stream()
        pieces: list[Event] = [{"token_id": t, "token": text.add(t)} for t in ids]
        if not pieces:
            return pieces
        pieces[-1]["token"] += text.finish()
        # The stream drops a leading space that a full decode keeps: give it back, to the first token
        # with any bytes (the one it came from; a padding id's piece stays "").
        joined, full = "".join(p["token"] for p in pieces), str(self.tokenizer.decode(ids))
        if joined != full and full.endswith(joined):
            first = next((p for p in pieces if table.bytes_of is None or table.bytes_of(p["token_id"])), pieces[0])
            first["token"] = full[: len(full) - len(joined)] + first["token"]
        return pieces

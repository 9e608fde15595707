"""`MetalTextModel`: the `TextModel` of the native backend (text in, tokens out, lifetime, slots).

The loops are in `generate.py`; this class turns text into ids and ids into `Token`s, applies the
error convention of `pymlxc.model.TextModel`, caps concurrent generations with `parallel_slots`, and
frees the weights on `close()`.

Lifetime: every piece of work that touches the model's arrays (one step of a stream, a whole
classify, batch or prompt-cache call) runs inside `_step()`, which counts it. `close()` marks the
model closed (no new step starts; running ones stop at their next token through the guard), waits
for the counted steps to end, and only then frees. A paused stream is between steps: it holds its
slot and its own KV cache, never a weight that is being freed.

`max_tokens=0` is valid and means "generate nothing": the stream is empty, `batch_generate` gives
empty results, and `classify` is unaffected (it always produces one token).
"""
from __future__ import annotations

import contextlib
import numbers
import os
import threading
import time
import warnings
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import pymlxc.core as mx
from pymlxc.model import (
    GenerationCancelled,
    ModelClosedError,
    check_context,
    check_decode_ids,
    check_flag,
    check_messages,
    check_text,
    detached_error,
)
from pymlxc.options import (
    GenerateConfig,
    LoadConfig,
    check_stop_tokens,
    check_template_kwargs,
    checked_int,
    make_config,
)
from pymlxc.types import AttentionSnapshot, BatchResult, ClassifyResult, GenerateMetrics, Message, ModelInfo, Token

from . import batching
from . import generate as loops
from . import prompt_cache as pcache
from .decode.batch_step import BatchStep, batch_compile_on
from .decode.decoder import CompiledDecoder
from .distributed.runtime import agree_options
from .sample import Sampler, make_logits_processors, make_sampler
from .training import TrainableMixin

# How long close() waits for running steps (one token, or one prefill chunk, each) to notice it.
# Past it, the last step to end frees the model instead: close() never frees under a running step.
CLOSE_WAIT_S = 30.0


class Detokenizer(Protocol):
    def add(self, token_id: int) -> str: ...

    def finish(self) -> str: ...


class TokenizerLike(Protocol):
    """What the model needs from `tokenizer.Tokenizer`."""

    eos_token_ids: frozenset[int]
    chat_template: str | None
    model_type: str | None
    special_tokens: dict[str, str]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...

    def detokenizer(self, skip_special_tokens: bool = False) -> Detokenizer: ...


def _tokens(ids: Iterator[int], detokenizer: Detokenizer, last: int | None = None) -> Iterator[Token]:
    """Ids to Tokens, each as soon as its id arrives (its text "" while a character is unfinished).

    `last`: how many ids there are at most (max_tokens, or a batch row's length): the token that
    reaches it also carries what `finish()` releases, so that the texts add up to the decode. A
    stream that ends earlier (a stop id, an error) drops an unfinished character at its end.
    """
    for count, token_id in enumerate(ids, 1):
        piece = detokenizer.add(token_id)
        if count == last:
            piece += detokenizer.finish()
        yield Token(token_id, piece)


class MetalTextModel(TrainableMixin):
    """A loaded model of the native backend. Thread-safe; see the module doc for `max_tokens=0`.
    The training side (apply_lora, adapters, logits) comes from `training.TrainableMixin`.

    `err()` answers for the calling thread: the error that ended its last stream (or batch), reset
    at each of its calls, so concurrent callers do not see one another's errors. It is a copy
    without traceback (see `detached_error`).
    """

    _tokenizer: TokenizerLike

    def __init__(self, model: Any, tokenizer: TokenizerLike, *, model_type: str, info: ModelInfo,
                 release: Callable[[], None] | None = None, config: LoadConfig | None = None,
                 stop_ids: frozenset[int] = frozenset()) -> None:
        config = config or LoadConfig()
        self._model = model
        self._tokenizer = tokenizer
        self._model_type = model_type
        self._info = info
        self._context_len = config.context_len
        self._distributed = config.distributed is not None
        self._device = mx.cpu if config.gpu_layers == 0 else None
        self._stop_ids = frozenset(tokenizer.eos_token_ids) | frozenset(stop_ids)
        self._parallel_slots = config.parallel_slots
        self._slots = threading.BoundedSemaphore(config.parallel_slots)
        self._state_lock = threading.Lock()
        self._idle = threading.Condition(self._state_lock)  # notified when the last step ends
        self._closed = False
        self._steps: dict[int, int] = {}  # thread id -> steps it is running now
        self._held: dict[int, int] = {}  # thread id -> slots held by streams it started
        self._free_at_idle = False  # close() gave up waiting: the last step to end frees
        self._errors: dict[int, BaseException | None] = {}
        self._metrics = GenerateMetrics()
        # Off for pipeline ranks: each holds other layers (other cache kinds and sizes), so whether an
        # entry is kept, evicted or restorable could differ between ranks, and then their prefills
        # (chunks, collectives) would. Tensor ranks hold every layer alike and decide alike.
        entries = 0 if config.distributed == "pipeline" else config.prompt_cache_entries
        self._prompt_cache = pcache.PromptCache(entries, config.prompt_cache_bytes)
        # Whatever owns memory registers its release here; close() runs them in reverse order.
        self._resources = contextlib.ExitStack()
        if release is not None:
            self._resources.callback(release)
        self._resources.callback(self._prompt_cache.clear)
        # The compiled decode step (see decode/decoder.py), used where it applies unless PYMLXC_COMPILE=0.
        self.settings = config.settings  # the PYMLXC_* switches this model runs with (pymlxc/settings.py)
        self._decoder = CompiledDecoder(model, settings=config.settings)
        self._resources.callback(self._decoder.close)
        # The continuous batch's compiled step (decode/batch_step.py), under the same switch.
        self._batch_step = BatchStep(model, enabled=batch_compile_on(config.settings))
        self._resources.callback(self._batch_step.close)
        self.compiled_decode = True
        self._scheduler: batching.Scheduler | None = None  # made by scheduler()

    # ------------------------------------------------------------------ facts
    @property
    def model_type(self) -> str:
        return self._model_type

    def info(self) -> ModelInfo:
        return self._info

    def metrics(self) -> GenerateMetrics:
        """The metrics of the last call that finished (on any thread)."""
        return self._metrics

    def err(self) -> BaseException | None:
        return self._errors.get(threading.get_ident())

    @property
    def model(self) -> Any:
        """The underlying architecture object (`Model.__call__(inputs, cache, mask)`)."""
        self._check_open()
        return self._model

    @property
    def tokenizer(self) -> TokenizerLike:
        return self._tokenizer

    @property
    def context_len(self) -> int:
        """The `context_len` it was loaded with: what its caches keep."""
        return self._context_len

    @property
    def num_layers(self) -> int:
        return self._info.num_layers

    @property
    def stop_ids(self) -> frozenset[int]:
        """The ids that end a generation (the tokenizer's EOS ids and the checkpoint's own)."""
        return self._stop_ids

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def prompt_cache(self) -> pcache.PromptCache:
        """The KV caches kept from earlier calls (`resize(entries, bytes)`, `clear()`, `entries()`)."""
        return self._prompt_cache

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text` (with the tokenizer's own specials, BOS say, unless told not to), as
        the mlx_lm backend's `encode` takes it."""
        self._check_open()  # the tokenizer outlives close(), but the model's calls do not (TextModel)
        if not isinstance(text, str):  # before the flag, as the mlx_lm backend checks them
            raise TypeError(f"text must be a str, not {type(text).__name__}")
        check_flag("add_special_tokens", add_special_tokens)
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: Sequence[int]) -> str:
        self._check_open()
        checked = check_decode_ids(ids)
        vocab = self._info.vocab_size
        for n, token in enumerate(checked):
            # tokenizers raises OverflowError for a negative id and decodes one past its vocabulary to "".
            if not 0 <= token < vocab:
                raise ValueError(f"token id {token} at position {n} is outside the vocabulary of {vocab}")
        return self._tokenizer.decode(checked)

    def prompt_length(self, prompt: str | Sequence[Message | Mapping[str, Any]], *,
                      chat_template_kwargs: Mapping[str, Any] | None = None) -> int:
        """How many tokens the model reads for `prompt`: text as `generate` encodes it, or messages
        as `chat` renders them (what a server checks against its context before generating)."""
        self._check_open()
        if not isinstance(prompt, Sequence) or isinstance(prompt, (bytes, Mapping)):
            raise TypeError(f"prompt must be a str or a sequence of messages, not {type(prompt).__name__}")
        if isinstance(prompt, str):
            return len(self._encode_prompt(prompt))
        return len(self._chat_ids(prompt, check_template_kwargs(chat_template_kwargs), None))

    # ------------------------------------------------------------------ public calls
    def generate(self, prompt: str, **config: Any) -> Iterator[Token]:
        """Stream the tokens that follow `prompt` (encoded with the tokenizer's own specials)."""
        options = self._begin(config)
        ids = self._encode_prompt(prompt)
        check_context(len(ids), self._context_len)
        return self._stream(self._model, ids, options)

    def chat(self, messages: Sequence[Message | Mapping[str, Any]], *,
             chat_template_kwargs: Mapping[str, Any] | None = None, **config: Any) -> Iterator[Token]:
        """Stream the assistant's answer to `messages`, rendered with the model's chat template;
        `chat_template_kwargs` reach the template as variables (e.g. enable_thinking=False)."""
        options = self._begin(config)
        template_kwargs = check_template_kwargs(chat_template_kwargs)
        # The template is the checkpoint's code: it renders under the call's cancel and timeout
        # (and the model's closing), besides its own bounds.
        guard = loops.Guard.make(options.cancel, options.timeout, self._is_closed)
        try:
            ids = self._chat_ids(messages, template_kwargs, guard)
        except (GenerationCancelled, ModelClosedError) as exc:
            # A stop while the template renders ends the stream as one while it decodes does:
            # quietly, the reason in err() (as on the mlx_lm backend), not raised at the call.
            self._errors[threading.get_ident()] = detached_error(exc)
            return iter(())
        check_context(len(ids), self._context_len)
        # The rendering spent part of the call's timeout: the stream keeps the same deadline.
        return self._stream(self._model, ids, options, guard)

    def classify(self, prompts: Sequence[str], **config: Any) -> list[ClassifyResult]:
        """The next token after each prompt, each prefilled as `generate` prefills it (chunked). Not
        a stream: errors, cancellation and timeout included, are raised."""
        options = self._begin(config)
        model = self._model
        rows = self._encode_prompts(prompts)
        timings = loops.Timings()
        guard = loops.Guard.make(options.cancel, options.timeout, self._is_closed)
        try:
            with self._slot(guard), self._step(), self._on_device():
                ids, logits = loops.classify_ids(
                    model, rows, sampler=self._sampler(options), return_logits=options.return_logits,
                    processors=make_logits_processors(options.repeat_penalty), timings=timings,
                    context_len=self._context_len, guard=guard)
        except Exception as exc:
            # Raised, and kept in err() too, as the mlx_lm backend keeps why its classify failed.
            self._errors[threading.get_ident()] = detached_error(exc)
            raise
        finally:
            self._finish(timings)
        return [ClassifyResult(Token(i, self._tokenizer.decode([i])), logits[n] if logits is not None else None)
                for n, i in enumerate(ids)]

    def batch_generate(self, prompts: Sequence[str], **config: Any) -> list[BatchResult]:
        """Generate for every prompt at once: the prompts join the model's continuous batch
        (`scheduler()`; one decode step for every running row). With a context length (the
        `context_len` load option) a row ends where prompt and tokens fill it, unlike `generate`,
        whose caches keep the latest tokens: its result then holds the tokens so far and an error
        that says so (`batching.ContextFull`), and the other rows are unaffected. A prompt past the
        context raises ContextLengthError before any row runs, as on every call."""
        options = self._begin(config)
        rows_in = self._encode_prompts(prompts)
        if options.max_tokens == 0:
            # This call's metrics (its prompt, nothing generated), not the previous call's.
            self._finish(loops.Timings(prompt_tokens=sum(len(r) for r in rows_in), prefilled=False))
            return [BatchResult() for _ in rows_in]
        guard = loops.Guard.make(options.cancel, options.timeout, self._is_closed)
        scheduler = self.scheduler()
        timings = loops.Timings(prompt_tokens=sum(len(r) for r in rows_in))
        stop_ids = self._stop_ids | frozenset(options.stop_tokens)
        params = batching.SamplingParams(
            max_tokens=options.max_tokens, temperature=options.temperature, top_p=options.top_p,
            top_k=options.top_k, min_p=options.min_p, seed=options.seed,
            repetition_penalty=options.repeat_penalty, stop_ids=stop_ids)
        requests = [(batching.Request(ids, params, collector), collector)
                    for ids, collector in ((ids, batching.Collector()) for ids in rows_in)]
        error: BaseException | None = None
        try:
            with self._slot(guard):  # as any call: held by the caller while its rows run
                batching.run_all(scheduler, requests, guard)
        except Exception as exc:  # noqa: BLE001 - reported per row and in err()
            error = exc
        # A row that the context cut short says so on its own result; any other error fails the call.
        ends = [collector.finish() for _, collector in requests]
        own = [end.error if end is not None else None for end in ends]
        for why in own:
            if error is None and why is not None and not isinstance(why, batching.ContextFull):
                error = why
        if error is not None:
            self._errors[threading.get_ident()] = detached_error(error)
        if any(c.events for _, c in requests):
            timings.mark_first_token()
        timings.generated_tokens = sum(len(c.tokens()) for _, c in requests)
        self._finish(timings)
        results = []
        for (_, collector), why in zip(requests, own, strict=True):
            ids = collector.tokens()
            tokens = list(_tokens(iter(ids), self._tokenizer.detokenizer(), last=len(ids)))
            why = error if error is not None else why
            results.append(BatchResult(tokens, None if why is None else f"{type(why).__name__}: {why}"))
        return results

    # ------------------------------------------------------------------ continuous batching
    def scheduler(self, *, max_batch: int | None = None, max_queue: int | None = None) -> batching.Scheduler:
        """The model's continuous-batching scheduler (`batching.py`), made at the first call; its
        thread runs each step as a counted step and stops at close(). `max_batch` (rows decoding
        at once) and `max_queue` (requests waiting beyond them) change it for later admissions.
        Recurrent layers (Qwen3-Next, Qwen 3.5) join the batch's decode steps; their prompts are
        prefilled one by one (no left-padded groups)."""
        self._check_open()
        # Checked here for both paths: a scheduler made already used to take any value (0 as the
        # default, -1, 1.5, "x"), failing later admissions instead.
        if max_batch is not None:
            max_batch = checked_int("max_batch", max_batch, low=1)
        if max_queue is not None:
            max_queue = checked_int("max_queue", max_queue, low=0)
        with self._state_lock:
            if self._scheduler is None:
                self._scheduler = batching.Scheduler(_BatchHost(self), context_len=self._context_len,
                                                     max_batch=max_batch or 32, max_queue=64 if max_queue is None
                                                     else max_queue)
                self._resources.callback(self._scheduler.close)
            elif max_batch is not None or max_queue is not None:
                self._scheduler.max_batch = max_batch or self._scheduler.max_batch
                self._scheduler.max_queue = self._scheduler.max_queue if max_queue is None else max_queue
            return self._scheduler

    # ------------------------------------------------------------------ prompt cache and inspection
    def warm_prompt_cache(self, prefix: str | Sequence[int] | Sequence[Message | Mapping[str, Any]]) -> int:
        """Prefill `prefix` into the prompt cache ahead of time, so that prompts starting with its
        tokens skip it (a system prompt, a tool schema). `prefix` is text (encoded as `generate`
        encodes a prompt), token ids, or chat messages (rendered without the generation prompt).
        Reuse is by exact tokens: text must end where the later prompts' tokens split. Returns the
        number of tokens cached: 0 when the prompt cache is off or could not keep the prefix (an
        entry larger than `prompt_cache_bytes`, a prefix past a `context_len` bound)."""
        self._begin({})
        model = self._model
        ids = self._prefix_ids(prefix)
        if not self._prompt_cache.enabled:
            return 0
        timings = loops.Timings(prompt_tokens=len(ids))
        use = pcache.CacheUse()
        kept = True  # a full hit: an entry holds the prefix already
        try:
            with self._slot(loops.Guard.make(None, None, self._is_closed)), self._step(), self._on_device():
                cache, cached, use = self._restore_prompt_cache(model, ids, limit=len(ids))
                if cached < len(ids):
                    loops.prefill(model, mx.array([ids], dtype=mx.int32), cache, start=cached)
                    kept = self._keep_prompt_cache(ids, cache)
        finally:
            self._finish(timings, use)
        return len(ids) if kept else 0

    def save_prompt_cache(self, path: str | os.PathLike[str]) -> int:
        """Write the prompt cache's entries to a safetensors file at `path`, with the model's identity
        and each entry's token ids in its metadata; returns how many entries were written."""
        with self._step(), self._on_device():
            return pcache.save_entries(path, self._prompt_cache.snapshot(),
                                       pcache.model_identity(self._model, self._model_type))

    def load_prompt_cache(self, path: str | os.PathLike[str]) -> int:
        """Add the entries of a file written by `save_prompt_cache` (most recent last); returns how
        many were kept. A file made by another model, or with another `context_len`, raises
        `PromptCacheError` and changes nothing."""
        with self._step(), self._on_device():
            model = self._model
            cache = self._prompt_cache
            entries = pcache.load_entries(path, pcache.model_identity(model, self._model_type),
                                          model.make_cache(self._context_len), self._info.vocab_size, model=model,
                                          max_entries=cache.max_entries, max_bytes=cache.max_bytes)
            if self.compiled_decode and self._decoder.enabled:
                self._decoder.prepare_weights()
            self._prompt_cache.check_weights(model.parameters().values())
            return sum(self._prompt_cache.store(tokens.tolist(), caches) for tokens, caches in entries)

    def inspect_attention(self, prompt: str | Sequence[int], include_queries: bool = False) -> AttentionSnapshot:
        """The keys (after RoPE) of every layer and KV head for `prompt` (text, encoded as `generate`
        encodes it, or token ids, at most `context_len` of them), and the queries of every head when
        asked: a chunked prefill."""
        from .inspection import inspect_attention

        self._begin({})
        check_flag("include_queries", include_queries)  # "no" or 0 would be taken by truth
        model = self._model
        ids = self._prefix_ids(prompt, "prompt")
        check_context(len(ids), self._context_len)
        with self._slot(loops.Guard.make(None, None, self._is_closed)), self._step(), self._on_device():
            return inspect_attention(model, ids, architecture=self._model_type, include_queries=include_queries,
                                     context_len=self._context_len)

    def _prefix_ids(self, prefix: str | Sequence[Any], what: str = "prefix") -> list[int]:
        """`prefix` (the argument named `what`) as token ids."""
        if isinstance(prefix, str):
            return self._encode_prompt(prefix, f"the {what}")
        if isinstance(prefix, (bytes, bytearray, Mapping)) or not isinstance(prefix, Iterable):
            raise TypeError(f"{what} must be text, token ids, or chat messages, not {type(prefix).__name__}")
        items = list(prefix)
        if items and all(isinstance(m, (Message, dict)) for m in items):
            from .chat_template import render_chat

            text = render_chat(check_messages(items), self._tokenizer, add_generation_prompt=False)
            ids = self._tokenizer.encode(text, add_special_tokens=False)
        elif all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in items):
            ids = [int(t) for t in items]  # numpy's integers too, as `decode` and the mlx_lm backend take them
        else:
            raise TypeError(f"{what} must be text, token ids, or chat messages, not a mix or other items")
        self._check_ids(ids, f"the {what}")
        return ids

    def _restore_prompt_cache(self, model: Any, ids: list[int], limit: int) -> tuple[list[Any], int, pcache.CacheUse]:
        """Fresh caches, or the prompt cache's longest prefix of `ids` (at most `limit` tokens)."""
        if not self._prompt_cache.enabled:
            return model.make_cache(self._context_len), 0, pcache.CacheUse()
        if self.compiled_decode and self._decoder.enabled:
            self._decoder.prepare_weights()  # a first fusion must not look like new weights later
        self._prompt_cache.check_weights(model.parameters().values())
        restored, cached, use = pcache.timed_lookup(self._prompt_cache, ids, limit)
        return (restored if restored is not None else model.make_cache(self._context_len)), cached, use

    def _keep_prompt_cache(self, tokens: list[int], cache: list[Any]) -> bool:
        """Keep `cache` in the prompt cache; `tokens` are those fed to it (more is fine: its offset
        says how many went in). Whether it was kept."""
        n = pcache.consistent_offset(cache)
        if self._closed or n is None or not 0 < n <= len(tokens):
            return False
        return self._prompt_cache.store(tokens[:n], cache)

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Free every weight. Idempotent; later calls raise ModelClosedError. Streams running on
        other threads stop at their next token (their err(): ModelClosedError) and close() waits
        for them before freeing (at most CLOSE_WAIT_S; past it, with a warning, the last of them
        frees on its way out). A paused stream ends with ModelClosedError when resumed."""
        me = threading.get_ident()
        with self._state_lock:
            if self._closed:
                return
            self._closed = True
            deadline = time.monotonic() + CLOSE_WAIT_S
            # Steps of this very thread (close() from inside one) cannot end while it waits.
            while self._active_steps() > self._steps.get(me, 0) and (left := deadline - time.monotonic()) > 0:
                self._idle.wait(left)
            deferred = self._free_at_idle = self._active_steps() > 0
        if deferred:
            if not self._steps.get(me):
                warnings.warn(f"close(): generations still running after {CLOSE_WAIT_S:g} s; the model is "
                              "freed when the last of them stops", RuntimeWarning, stacklevel=2)
            return
        self._free()

    def _free(self) -> None:
        try:
            self._resources.close()
        finally:
            self._model = None
            mx.clear_cache()

    def __enter__(self) -> MetalTextModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # A backstop only: close() is the way to free a model at a known time.
        with contextlib.suppress(Exception):
            if not getattr(self, "_closed", True):
                self.close()

    # ------------------------------------------------------------------ internals
    def _is_closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise ModelClosedError("the model is closed")

    def _active_steps(self) -> int:
        return sum(self._steps.values())

    @contextlib.contextmanager
    def _step(self) -> Iterator[None]:
        """Run work that touches the model's arrays: refused once closed, and counted, so that
        close() frees nothing under it."""
        me = threading.get_ident()
        with self._state_lock:
            if self._closed:
                raise ModelClosedError("the model was closed")
            self._steps[me] = self._steps.get(me, 0) + 1
        try:
            yield
        finally:
            with self._state_lock:
                self._steps[me] -= 1
                if not self._steps[me]:
                    del self._steps[me]
                idle = not self._steps
                free = idle and self._free_at_idle
                if free:
                    self._free_at_idle = False
                if idle:
                    self._idle.notify_all()
            if free:
                self._free()

    def _begin(self, config: dict[str, Any]) -> GenerateConfig:
        """Start a call: check the model and options (raising at once) and reset err()."""
        self._check_open()
        options: GenerateConfig = make_config(GenerateConfig, **config)
        check_stop_tokens(options.stop_tokens, self._info.vocab_size)
        if self._distributed:  # every rank must run the same steps: one seed, no timeout (distributed/runtime.py)
            options = agree_options(options)
        self._errors[threading.get_ident()] = None
        return options

    def _check_ids(self, ids: Sequence[int], what: str = "the prompt") -> None:
        """Every prompt's ids (`what` names it in errors) pass here before MLX sees them
        (`loops.check_prompt_ids`)."""
        # A prompt longer than context_len is refused by the calls that run one (check_context),
        # not here: prompt_length counts it, and warm_prompt_cache reports it by keeping nothing. A
        # generation past it goes on: the caches keep the latest tokens (and the first few).
        if not ids:
            raise ValueError(f"{what} encodes to no tokens")
        loops.check_prompt_ids(ids, self._info.vocab_size)

    def _chat_ids(self, messages: Sequence[Message | Mapping[str, Any]], template_kwargs: dict[str, Any],
                  guard: loops.Guard | None) -> list[int]:
        """The ids of `messages` rendered by the chat template with the generation prompt."""
        from .chat_template import render_chat

        text = render_chat(check_messages(messages), self._tokenizer, add_generation_prompt=True,
                           guard=guard.check if guard is not None else None, **template_kwargs)
        # The template writes the special tokens itself (BOS included).
        ids = self._tokenizer.encode(text, add_special_tokens=False)
        self._check_ids(ids)
        return ids

    def _encode_prompt(self, prompt: str, what: str = "the prompt") -> list[int]:
        if not isinstance(prompt, str):
            raise TypeError(f"{what} must be a str, not {type(prompt).__name__}")
        if not prompt:
            raise ValueError(f"{what} is empty")
        check_text(prompt, what)
        # As mlx-lm's generate and server: no BOS added to a prompt that already starts with its text.
        bos = self._tokenizer.special_tokens.get("bos_token")
        ids = self._tokenizer.encode(prompt, add_special_tokens=bos is None or not prompt.startswith(bos))
        self._check_ids(ids)
        return ids

    def _encode_prompts(self, prompts: Sequence[str]) -> list[list[int]]:
        """Each prompt's ids; once all are encoded, ContextLengthError naming the first that does not
        fit the context (classify and batch_generate run every prompt or none)."""
        # A sequence, as the mlx_lm backend takes it: results come back in its order. A set or a
        # dict's keys have an order the caller did not choose, and an empty iterator is truthy, so
        # it passed the check below and answered [] silently.
        if isinstance(prompts, (str, bytes, Mapping)) or not isinstance(prompts, Sequence):
            what = "one str" if isinstance(prompts, str) else type(prompts).__name__
            raise TypeError(f"prompts must be a sequence of str, not {what}")
        if not prompts:
            raise ValueError("no prompts given")
        rows = [self._encode_prompt(p, f"prompts item {i}") for i, p in enumerate(prompts)]
        for i, ids in enumerate(rows):
            check_context(len(ids), self._context_len, item=i)
        return rows

    @staticmethod
    def _sampler(options: GenerateConfig) -> Sampler:
        return make_sampler(options.temperature, options.top_k, options.top_p, options.min_p, key=options.seed)

    @contextlib.contextmanager
    def _slot(self, guard: loops.Guard) -> Iterator[None]:
        """Hold one of the `parallel_slots` (waiting while all are taken, cancellable). Where every
        slot is held by paused streams of the calling thread, no other thread can free one while
        this thread waits: that raises at once instead of waiting forever."""
        me = threading.get_ident()
        while not self._slots.acquire(timeout=0.05):
            guard.check()
            with self._state_lock:
                mine = self._held.get(me, 0)
            if mine >= self._parallel_slots:
                raise RuntimeError(
                    f"all {self._parallel_slots} generation slots (parallel_slots) are held by unfinished "
                    "streams of this thread; a call here would wait for them forever: finish or close() "
                    "those iterators first, or load the model with more parallel_slots")
        counted = False  # a guard that fires before the count leaves this thread's other slots counted
        try:
            guard.check()
            with self._state_lock:
                self._held[me] = self._held.get(me, 0) + 1
                counted = True
                if sum(self._held.values()) == 1:
                    # Peak memory is process-wide: only reset it when no other call is measuring.
                    mx.reset_peak_memory()
            yield
        finally:
            if counted:
                with self._state_lock:
                    self._held[me] -= 1
                    if not self._held[me]:
                        del self._held[me]
            self._slots.release()

    @contextlib.contextmanager
    def _on_device(self) -> Iterator[None]:
        if self._device is None:
            yield
        else:
            with mx.stream_scope(self._device):
                yield

    def _finish(self, timings: loops.Timings, use: pcache.CacheUse | None = None) -> None:
        timings.finish()
        metrics = timings.metrics()
        if use is not None:
            metrics.prompt_cache_hits, metrics.prompt_cache_misses = use.hits, use.misses
            metrics.prompt_cache_hit_tokens = use.hit_tokens
            metrics.prompt_cache_restore_duration = use.restore_duration
            # Prefill speed counts the tokens that went through the model, not those restored.
            prefilled = metrics.prompt_tokens - use.hit_tokens
            metrics.prefill_tokens_per_sec = (prefilled / metrics.prefill_duration
                                              if metrics.prefill_duration > 0 else 0.0)
        self._metrics = metrics

    def _stream(self, model: Any, ids: list[int], options: GenerateConfig,
                guard: loops.Guard | None = None) -> Iterator[Token]:
        # `model` is taken when the call is made: a close() racing with the stream's start then
        # ends the stream (ModelClosedError in err()) at its first step, before `model` is used.
        if options.max_tokens == 0:
            # Nothing runs, but metrics() answers for this call (as on the mlx_lm backend).
            self._finish(loops.Timings(prompt_tokens=len(ids), prefilled=False))
            return iter(())
        owner = threading.get_ident()
        return self._reporting(self._token_stream(model, ids, options, guard), owner)

    def _token_stream(self, model: Any, ids: list[int], options: GenerateConfig,
                      guard: loops.Guard | None = None) -> Generator[Token, None, None]:
        if guard is None:
            guard = loops.Guard.make(options.cancel, options.timeout, self._is_closed)
        timings = loops.Timings()
        use = pcache.CacheUse()
        try:
            with self._slot(guard):
                # The last prompt token is the first decode step's input: at most the rest is restored.
                cache, cached, use = self._restore_prompt_cache(model, ids, limit=len(ids) - 1)
                sampled: list[int] = []
                id_stream = loops.generate_ids(
                    model, ids, cache=cache, cached=cached, sampled_ids=sampled,
                    sampler=self._sampler(options), processors=make_logits_processors(options.repeat_penalty),
                    max_tokens=options.max_tokens,
                    stop_ids=self._stop_ids | frozenset(options.stop_tokens), guard=guard, timings=timings,
                    decoder=self._decoder if self.compiled_decode and self._decoder.enabled else None)
                try:
                    yield from _tokens(id_stream, self._tokenizer.detokenizer(), last=options.max_tokens)
                finally:
                    if isinstance(id_stream, Generator):  # generate_ids is one; its cleanup runs here
                        id_stream.close()
                    self._keep_prompt_cache(ids + sampled, cache)
        finally:
            self._finish(timings, use)

    def _reporting(self, tokens: Generator[Token, None, None], owner: int) -> Iterator[Token]:
        """Run each step of `tokens` as a counted step on the model's device. An error is kept for
        err() (of the thread that made the call); cancellation, timeout and close() end the stream
        quietly, any other error is raised as well."""
        try:
            while True:
                try:
                    with self._step(), self._on_device():
                        token = next(tokens)
                except StopIteration:
                    return
                except (GenerationCancelled, ModelClosedError) as exc:
                    self._errors[owner] = detached_error(exc)
                    return
                except Exception as exc:
                    self._errors[owner] = detached_error(exc)
                    raise
                yield token
        finally:
            # The stream's own cleanup (its caches into the prompt cache, the queued step drained)
            # is a step too while the model is open; once it is closed the cleanup touches no weight.
            try:
                with self._step(), self._on_device():
                    tokens.close()
            except ModelClosedError:
                tokens.close()


class _BatchHost:
    """What the scheduler reaches of its model (`batching.Host`): the architecture, counted steps
    on the model's device, and the prompt cache."""

    def __init__(self, owner: MetalTextModel) -> None:
        self._owner = owner

    @property
    def language_model(self) -> Any:
        return self._owner.model

    @property
    def vocab_size(self) -> int:
        return self._owner.info().vocab_size

    @property
    def batch_step(self) -> BatchStep | None:
        owner = self._owner
        return owner._batch_step if owner.compiled_decode and owner._batch_step.enabled else None

    @contextlib.contextmanager
    def counted_step(self) -> Iterator[None]:
        with self._owner._step(), self._owner._on_device():
            yield

    def restore_prefix(self, ids: list[int]) -> tuple[list[Any], int]:
        # The last prompt token is prefilled anyway: its logits give the first token.
        cache, cached, _ = self._owner._restore_prompt_cache(self._owner.model, ids, limit=len(ids) - 1)
        return cache, cached

    def keep_prefix(self, ids: list[int], cache: list[Any]) -> None:
        self._owner._keep_prompt_cache(ids, cache)

    @property
    def keeps_prefixes(self) -> bool:
        return self._owner._prompt_cache.enabled

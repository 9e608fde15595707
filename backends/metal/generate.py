"""The generation loops of the native backend: prefill, pipelined decode, batches and classify.

Everything here works on token ids and MLX arrays; text (tokenizer, detokenizer, chat templates)
and locking live in `textmodel.py`. The loops read back one thing per step, the sampled token, and
build step n+1 before reading step n's token so that the device never waits on Python.

Masks are boolean, shaped [B, 1, L, S] (True = may attend), as the models pass them on to
`scaled_dot_product_attention`. A padded query attends to itself as well, so that no row of the
softmax is empty (an empty row would give NaN, and NaN in a padded position's hidden state would
leak into later layers' keys and values).
"""
from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import pymlxc.core as mx
from pymlxc.model import GenerationCancelled, ModelClosedError
from pymlxc.types import GenerateMetrics

from . import memory_check
from .cache import LeftPaddedMask
from .models.base import layer_listener
from .nn import arrays_of
from .recurrent_cache import set_left_padding
from .sample import DEFAULT_PENALTY_CONTEXT, LogitsProcessor, Sampler, apply_processors, greedy
from .step_queue import StepQueue

if TYPE_CHECKING:
    from .cache import Cache
    from .decode.decoder import CompiledDecoder
    from .decode.prefill import PrefillRunner

# Prompt tokens per forward pass. 2048 as mlx-lm: on a GPU, 512-token chunks measured 0.4-0.6x of
# mlx-lm's prefill for 2048-token prompts (H100, MLX 0.32.4) from smaller matmuls and more launches;
# the chunk still bounds the attention scores' memory where the fused kernel is not used.
PREFILL_STEP = 2048
# Layers of a prefill the host may hand over before the device has run them. MLX holds each layer's
# temporaries until the device has run the layer, a dense product's dequantized weights (two bytes a
# weight) among them, so a chunk built and encoded far ahead held every layer's at once: on an H100,
# a 2048-token prompt took Llama-3.2-1B 4-bit's MLX peak to 3749 MiB, 1865 MiB with this lead
# (`benchmarks/profile/probe_memory.py`). Two layers keep the device fed while one is built.
PREFILL_LEAD_LAYERS = 2
# The lead is one layer where PREFILL_LEAD_LAYERS + 1 layers' dense-product weight copies
# (`nn.mark_dense_products`) would pass PREFILL_DENSE_BYTES. On an H100, over a 2048-token prompt
# and 256 tokens after it, the process's peak as nvidia-smi lists it: Llama-3.1-8B 4-bit (416 MiB of
# copies a layer) 4866 against 5826 MiB with a lead of one, its prefill 1% slower; Llama-3.2-1B's
# Q4_0 GGUF file (116 MiB a layer) 1538 against 1766-1826 MiB, llama.cpp 1656 on the same file, its
# 2048-token prefill 8-34% slower (`probe_memory.py`, `probe_prefill.py --lead`,
# `benchmarks/results/h100-probe-memory.json`, `h100-llama-cpp-*-peak-memory.json`).
PREFILL_DENSE_BYTES = 1 << 28
# Prompts of at least this many new tokens give MLX's buffer cache back once the first token is read.
# The cache keeps a long chunk's freed temporaries (the dense products' weight copies, the 2048-row
# activations) for reuse, and a decode allocates buffers of other sizes beside them: on an H100 the
# process grew by 106 MiB (Llama-3.2-1B 4-bit) and 376 MiB (Llama-3.1-8B 4-bit) while decoding 256
# tokens after a 2048-token prompt (`benchmarks/profile/probe_memory.py --keep-cache`). mlx-lm clears
# it after each prefill chunk.
CLEAR_CACHE_PROMPT_TOKENS = 512


class LanguageModel(Protocol):
    """inputs [B, L] int32 -> logits [B, L, V] (`last_only`: [B, 1, V], the last position's);
    `output(h)` gives the logits of hidden states after the last layer; `make_cache` gives one cache
    per layer."""

    def __call__(self, inputs: mx.Array, cache: Sequence[Any] | None = None, mask: mx.Array | None = None, *,
                 last_only: bool = False) -> mx.Array: ...

    def output(self, h: mx.Array) -> mx.Array: ...

    def make_cache(self, context_len: int | None = None) -> list[Any]: ...


# ---------------------------------------------------------------------- stopping and timing

@dataclass(frozen=True)
class Guard:
    """Stops a loop between tokens: the cancel event, the deadline, or a closed model."""

    cancel: threading.Event | None = None
    deadline: float | None = None  # time.perf_counter() value
    timeout: float | None = None  # for the message
    closed: Callable[[], bool] | None = None

    @classmethod
    def make(cls, cancel: threading.Event | None, timeout: float | None,
             closed: Callable[[], bool] | None = None) -> Guard:
        deadline = time.perf_counter() + timeout if timeout is not None else None
        return cls(cancel, deadline, timeout, closed)

    def check(self) -> None:
        if self.cancel is not None and self.cancel.is_set():
            raise GenerationCancelled("generation cancelled")
        if self.deadline is not None and time.perf_counter() > self.deadline:
            raise GenerationCancelled(f"generation timed out after {self.timeout:g} s")
        if self.closed is not None and self.closed():
            raise ModelClosedError("the model was closed during generation")


NO_GUARD = Guard()


@dataclass
class Timings:
    """Filled in as a call goes; `metrics()` turns it into the public record."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    start: float = field(default_factory=time.perf_counter)
    first_token: float | None = None  # when the first sampled token was read back
    end: float | None = None
    prefilled: bool = True  # False: nothing ran (max_tokens=0), so there is no prefill to time

    def mark_first_token(self) -> None:
        if self.first_token is None:
            self.first_token = time.perf_counter()

    def finish(self) -> None:
        if self.end is None:
            self.end = time.perf_counter()

    def metrics(self) -> GenerateMetrics:
        end = self.end if self.end is not None else time.perf_counter()
        first = self.first_token if self.first_token is not None else end
        # Prefill runs until the first token is known (time to first token), as mlx-lm counts it;
        # the first token then belongs to prefill, so decode speed counts the tokens after it.
        prefill, decode = (first - self.start if self.prefilled else 0.0), end - first
        decoded = max(self.generated_tokens - 1, 0)
        return GenerateMetrics(
            prompt_tokens=self.prompt_tokens,
            generated_tokens=self.generated_tokens,
            prefill_duration=prefill,
            decode_duration=decode,
            total_duration=end - self.start,
            prefill_tokens_per_sec=self.prompt_tokens / prefill if prefill > 0 else 0.0,
            decode_tokens_per_sec=decoded / decode if decode > 0 and decoded else 0.0,
            peak_memory_bytes=mx.get_peak_memory(),
            active_memory_bytes=mx.get_active_memory(),
        )


# ---------------------------------------------------------------------- masks

def _positions(start: int, stop: int) -> mx.Array:
    return mx.arange(start, stop, dtype=mx.int32)


def left_padded_mask(pads: mx.Array, offset: int, length: int, window: int | None = None) -> mx.Array:
    """Mask for `length` queries at positions offset.. of left-padded rows (`pads` [B] int32):
    causal (within `window` keys of each query, if given), and no key inside a row's padding
    except the query itself (a query with nothing to see would make NaN, and padded keys must stay
    finite)."""
    queries = _positions(offset, offset + length)[:, None]  # [L, 1]
    keys = _positions(0, offset + length)[None, :]  # [1, S]
    causal = keys <= queries
    if window is not None:
        causal = causal & (keys > queries - window)
    real = keys[None] >= pads[:, None, None]  # [B, 1, S]
    mask = mx.expand_dims(causal[None] & (real | (keys == queries)[None]), 1)  # [B, 1, L, S]
    # Without a window, the prefill attention kernel takes the pads instead (its padded form).
    return LeftPaddedMask(mask, pads) if window is None else mask


# ---------------------------------------------------------------------- prefill and decode

def _cache_state(cache: Sequence[Cache]) -> list[Any]:
    return [c.state for c in cache]


def check_prompt_ids(ids: Sequence[int], vocab: int) -> None:
    """ValueError naming the first id of `ids` outside [0, vocab): one past the embedding's rows
    would read out of bounds, as MLX's gather does not check. Every way a prompt reaches these
    loops calls it first (the model's calls, the scheduler's requests, the benchmarks)."""
    if ids and (min(ids) < 0 or max(ids) >= vocab):
        n, bad = next((n, t) for n, t in enumerate(ids) if not 0 <= t < vocab)
        raise ValueError(f"token id {bad} (position {n} of the prompt) is outside the model's vocabulary "
                         f"of {vocab} (ids 0..{vocab - 1}, the embedding's rows)")


def prefill(model: LanguageModel, tokens: mx.Array, cache: Sequence[Any], *, step: int = PREFILL_STEP,
            mask: Callable[[int, int], mx.Array | None] | None = None, guard: Guard = NO_GUARD,
            start: int = 0, queue: StepQueue | None = None, runner: PrefillRunner | None = None,
            finish: Callable[[mx.Array], mx.Array] | None = None, new_tokens: int | None = 0) -> mx.Array | None:
    """Run `tokens` [B, L] through the model into `cache`, `step` positions at a time.

    Only the caches are evaluated (the chunks' logits are never needed), except that with `finish`
    the logits [B, V] of the last position are computed (for that position alone) and
    `finish(logits)` (the first sampled ids, say) is built with the last chunk and returned,
    scheduled and readable. Chunks are pipelined: a chunk is queued, then the previous one is
    waited for, so the host builds chunk n+1 while the device runs chunk n and at most two chunks'
    activations exist at a time; the last chunk is left running (what comes next builds on it).
    Within a chunk each layer is queued as it is built, the host at most PREFILL_LEAD_LAYERS
    layers ahead of the device (`LayerLead`).
    `mask(offset, length)` gives each chunk's mask. `start`: the first `start` tokens are in
    `cache` already (a prompt-cache hit); the chunks keep the boundaries of a prefill from 0,
    because a context-bounded cache's results depend on them. With a threaded `queue` (see
    step_queue.py) each layer is handed to the evaluation thread as soon as it is built, so MLX
    encodes layer i while Python builds layer i+1. `runner` (`CompiledDecoder.prefill_runner`)
    runs the chunks instead of the model's forward where no mask is given. Before anything is
    allocated, the caches at their final size (`new_tokens` more per row to come after the prompt)
    and a chunk's attention are checked against the device's free memory (DeviceMemoryError;
    `new_tokens=None`: the caller has checked).
    """
    if new_tokens is not None:
        check_memory(model, cache, tokens.shape[0], tokens.shape[1], new_tokens, step)
    forward = _chunk_forward(model, mask, runner)
    layers_ahead = prefill_lead(model, tokens.shape[0] * _largest_chunk(tokens.shape[1], start, step),
                                runner if mask is None else None)
    if queue is not None and queue.threaded:
        return _prefill_threaded(forward, tokens, cache, step=step, guard=guard, start=start, queue=queue,
                                 finish=finish, lead=layers_ahead)
    length = tokens.shape[1]
    running: list[Any] = []
    result = None
    lead = LayerLead(queue if queue is not None else StepQueue(threaded=False), layers_ahead)
    while start < length:
        guard.check()
        stop = min((start // step + 1) * step, length)
        logits = forward(tokens[:, start:stop], cache, start, lead.on_layer, finish is not None and stop == length)
        state = _cache_state(cache)
        if logits is not None and finish is not None:
            result = finish(logits)
        mx.async_eval([state, result] if result is not None else state)
        if running:
            mx.eval(running)
        running = state
        start = stop
    return result


def _largest_chunk(length: int, start: int, step: int) -> int:
    """The longest chunk of a prefill of positions start..length: chunks end on multiples of `step`."""
    first = min(step - start % step, length - start)
    return max(first, min(step, length - start - first))


def prefill_lead(model: Any, rows: int, runner: PrefillRunner | None = None) -> int:
    """Layers the host may run ahead of the device in a prefill whose largest chunk has `rows` rows:
    PREFILL_LEAD_LAYERS, or one where the chunk's dense products (op by op, or the compiled
    prefill's dequantized ones through `runner`) would hold more than PREFILL_DENSE_BYTES of weight
    copies over that many layers."""
    dense_rows = getattr(model, "dense_rows", 0)
    per_layer = getattr(model, "dense_block_bytes", 0)
    if runner is not None and runner.dense_block_bytes and runner.takes_rows(rows):
        per_layer = runner.dense_block_bytes
    elif not (dense_rows and rows >= dense_rows):
        per_layer = 0
    if (PREFILL_LEAD_LAYERS + 1) * per_layer > PREFILL_DENSE_BYTES:
        return 1
    return PREFILL_LEAD_LAYERS


class LayerLead:
    """Hands a prefill's layers over as they are built (`on_layer`) and keeps the host at most `lead`
    layers ahead of the device: after handing over layer i it waits for layer i - lead to finish
    (counted across chunks: a chunk's first layers wait for the last of the one before). Through
    `queue` (threaded or not), so the waits read copies the evaluation thread made."""

    def __init__(self, queue: StepQueue, lead: int | None = None) -> None:
        self._queue = queue
        self._lead = PREFILL_LEAD_LAYERS if lead is None else lead
        self._running: collections.deque[tuple[Any, mx.Array]] = collections.deque()

    def on_layer(self, h: mx.Array, layer_cache: Any) -> None:
        """After a layer is built: its output `h` [B, L, D] and its cache (None where it has none)."""
        marker = self._queue.readable(h[:, -1:, :1])  # one value: its readiness is the layer's
        arrays = [h, layer_cache.state, marker] if layer_cache is not None else [h, marker]
        self._running.append((self._queue.submit(arrays), marker))
        if len(self._running) > self._lead:
            ticket, done = self._running.popleft()
            self._queue.ready(ticket)
            mx.eval(done)


def check_memory(model: LanguageModel, cache: Sequence[Any], batch: int, prompt_len: int, new_tokens: int,
                 step: int = PREFILL_STEP) -> None:
    """DeviceMemoryError where `batch` prompts of `prompt_len` tokens and `new_tokens` generated
    after them cannot fit the device's free memory (see memory_check.py)."""
    memory_check.check(model, cache, batch=batch, prompt_len=prompt_len, new_tokens=new_tokens, step=step,
                       what=f"{batch} x {prompt_len} prompt tokens" + (f" and {new_tokens} new tokens" if new_tokens
                                                                       else ""))


def _chunk_forward(model: LanguageModel, mask: Callable[[int, int], mx.Array | None] | None,
                   runner: PrefillRunner | None) -> Callable[..., mx.Array | None]:
    """`forward(chunk, cache, offset, on_layer, logits)`: the runner where it takes the chunk
    (`PrefillRunner.takes`) and applies (it is dropped
    for the rest of the prompt if it cannot trace), else the model's forward (which reports its
    layers to the `layer_listener`). With `logits`, returns the chunk's last position's logits
    [B, V]. Either way the last layer's queries, attention output and MLP and the head run on the
    last position alone (`last_only`): every position's keys and values still reach the caches."""
    from .decode.decoder import CompileUnavailable  # noqa: PLC0415

    use = [runner if mask is None else None]

    def forward(chunk: mx.Array, cache: Sequence[Any], offset: int, on_layer: Callable[..., None] | None,
                logits: bool = False) -> mx.Array | None:
        if use[0] is not None and use[0].takes(chunk):
            try:
                h = use[0](chunk, cache, on_layer)
                return model.output(h)[:, -1, :] if logits else None
            except CompileUnavailable:
                use[0] = None
        with layer_listener(on_layer) if on_layer is not None else contextlib.nullcontext():
            # The last layer past its keys and values, and the head, on the last position alone, even
            # where the logits are unused: the caches need no more, and there is less graph to build
            # (and, with the threaded prefill, less of the last layer to evaluate).
            out = model(chunk, cache=cache, mask=mask(offset, chunk.shape[1]) if mask else None, last_only=True)
            return out[:, -1, :] if logits else None

    return forward


def _prefill_threaded(forward: Callable[..., mx.Array | None], tokens: mx.Array, cache: Sequence[Any], *,
                      step: int, guard: Guard, start: int, queue: StepQueue,
                      finish: Callable[[mx.Array], mx.Array] | None, lead: int | None = None) -> mx.Array | None:
    """`prefill` with the evaluation thread: the same chunks, each layer submitted when built. The
    wait for the previous chunk reads a copy of its state (see `StepQueue.readable`); `finish`'s
    result is returned as a readable copy, once the thread has scheduled it."""
    queue.hand_over([tokens, _cache_state(cache)])  # built here (a slice; a prompt-cache hit's caches)
    layer_lead = LayerLead(queue, lead)

    length = tokens.shape[1]
    previous: tuple[Any, list[Any]] | None = None
    result = None
    while start < length:
        guard.check()
        stop = min((start // step + 1) * step, length)
        with queue.building():
            logits = forward(tokens[:, start:stop], cache, start, layer_lead.on_layer,
                             finish is not None and stop == length)
            state = _cache_state(cache)
            marker = [queue.readable(c[0]) for c in state[-1:] if c]  # one array: waits for the whole submission
            if logits is not None and finish is not None:
                result = queue.readable(finish(logits))
        handle = queue.submit([state, marker] if result is None else [state, marker, result])
        if previous is not None:
            queue.ready(previous[0])
            mx.eval(previous[1])
        previous = (handle, marker)
        start = stop
    if result is not None and previous is not None:
        queue.ready(previous[0])
    return result


StepFn = Callable[[mx.Array], mx.Array]


def make_step(model: LanguageModel, cache: Sequence[Any], sampler: Sampler,
              processors: Sequence[LogitsProcessor] = (), history: mx.Array | None = None) -> StepFn:
    """One decode step: inputs [B, 1] -> sampled ids [B], lazily.

    `history` [B, T] holds the recent ids the logits processors look at; each step appends its
    inputs.
    """
    seen_ids = history

    def step(inputs: mx.Array) -> mx.Array:
        nonlocal seen_ids
        logits = model(inputs, cache=cache)[:, -1, :]
        if processors:
            seen = inputs if seen_ids is None else mx.concatenate([seen_ids, inputs], axis=1)
            if seen.shape[1] > DEFAULT_PENALTY_CONTEXT:
                seen = seen[:, -DEFAULT_PENALTY_CONTEXT:]
            seen_ids = seen
            logits = apply_processors(processors, seen, logits)
        return sampler(logits)

    return step


def _queue_for(model: Any) -> StepQueue:
    """Threaded (where the device suits) only for the backend's own modules, whose every array
    `_hand_over_weights` finds; another model may hold lazy arrays the thread could not evaluate."""
    from .nn import Module  # noqa: PLC0415

    return StepQueue(None if isinstance(model, Module) else False)


def _hand_over_weights(queue: StepQueue, model: Any, weights: list[mx.Array] | None = None) -> None:
    """The model's arrays (`weights`, else found by walking the model) to a threaded queue (an
    update or an adapter may have left them lazy)."""
    if queue.threaded:
        queue.hand_over(weights if weights is not None else arrays_of(model))


def decode(step: StepFn, first_inputs: mx.Array, max_tokens: int, queue: StepQueue | None = None) -> Iterator[mx.Array]:
    """Yield up to `max_tokens` sampled id arrays [B], each scheduled before the previous is read.

    The consumer reads each yielded array (one host sync per token) while the next step is
    already queued on the device; stopping early wastes at most that one queued step. `queue`
    says where steps are built and encoded (see step_queue.py; by default as the device suits).
    """
    if max_tokens <= 0:
        return
    queue = queue if queue is not None else StepQueue()
    queue.hand_over([first_inputs])
    try:
        yield from queue.pipeline(lambda: step(first_inputs), lambda tokens: step(mx.expand_dims(tokens, 1)),
                                  max_tokens)
    finally:
        queue.drain(raise_errors=False)


def _history(rows: Sequence[Sequence[int]]) -> mx.Array:
    """The last prompt ids of each row for the logits processors, rectangular.

    Short rows are filled by repeating their own first id: a repeated id changes nothing for the
    penalty, which only asks whether an id was seen.
    """
    recent = [list(r[-DEFAULT_PENALTY_CONTEXT:]) for r in rows]
    width = max(len(r) for r in recent)
    return mx.array([[r[0]] * (width - len(r)) + r for r in recent], dtype=mx.int32)


def generate_ids(model: LanguageModel, prompt: Sequence[int], *, cache: Sequence[Any], sampler: Sampler,
                 processors: Sequence[LogitsProcessor] = (), max_tokens: int = 256,
                 stop_ids: frozenset[int] = frozenset(), guard: Guard = NO_GUARD,
                 timings: Timings | None = None, prefill_step: int = PREFILL_STEP, cached: int = 0,
                 sampled_ids: list[int] | None = None, decoder: CompiledDecoder | None = None) -> Iterator[int]:
    """Generate ids after `prompt` (stop ids are not yielded). Raises GenerationCancelled from
    `guard` between tokens.

    `cached`: how many prompt tokens `cache` holds already (at most all but the last). `sampled_ids`
    receives every sampled id, stop ids included, as it is read: with the prompt, the tokens the
    cache has seen (the cache's offset says how many of them went in). `decoder`: decode on its
    compiled step where it applies (see `decode/decoder.py`; the same tokens as without it)."""
    if not prompt:
        raise ValueError("the prompt has no tokens")
    if not 0 <= cached < len(prompt):
        raise ValueError(f"cached must be in [0, {len(prompt) - 1}], not {cached}")
    timings = timings if timings is not None else Timings()
    timings.prompt_tokens = len(prompt)
    tokens = mx.array([list(prompt)], dtype=mx.int32)
    if decoder is not None:
        decoder.reserve(cache, len(prompt), max_tokens)
    queue = _queue_for(model)
    walk = None  # the model's arrays and module classes, walked once for this generation
    if queue.threaded or decoder is not None:
        walk = arrays_of(model, with_classes=True)
        _hand_over_weights(queue, model, walk[0])
    runner = None
    if decoder is not None:
        runner = decoder.prefill_runner(sampler is greedy and not processors, walk)
    history = _history([prompt]) if processors else None

    def sample_first(logits: mx.Array) -> mx.Array:
        return sampler(apply_processors(processors, history, logits) if history is not None else logits)

    def emit(token: int) -> bool:
        """Record a read token; False where it stops the generation."""
        timings.mark_first_token()
        if sampled_ids is not None:
            sampled_ids.append(token)
        if token in stop_ids:
            return False
        timings.generated_tokens += 1
        return True

    try:
        # The whole prompt goes through prefill, and the first token is sampled from the logits of
        # its last position alone: the time to the first token is one forward pass (no separate
        # step for the last prompt token), and decoding starts from the first generated token.
        first = prefill(model, tokens, cache, step=prefill_step, guard=guard, start=cached, queue=queue,
                        runner=runner, finish=sample_first if max_tokens > 0 else None, new_tokens=max_tokens)
        if first is None:  # max_tokens <= 0: the prompt is in the caches, nothing is sampled
            return
        token = first.item()
        if not emit(token):
            return
        yield token
        guard.check()
        if len(prompt) - cached >= CLEAR_CACHE_PROMPT_TOKENS:
            mx.clear_cache()  # after the first token is out: not in its latency
        if max_tokens == 1:
            return
        first_inputs = mx.array([[token]], dtype=mx.int32)
        queue.hand_over([first_inputs, _cache_state(cache)])

        def uncompiled() -> Iterator[mx.Array]:
            return decode(make_step(model, cache, sampler, processors, history), first_inputs, max_tokens - 1, queue)

        if decoder is not None:
            stream = decoder.decode(cache, first_inputs, max_tokens - 1, sampler=sampler, processors=processors,
                                    history=history, fallback=uncompiled, queue=queue, walk=walk)
        else:
            stream = uncompiled()
        for sampled in stream:
            token = sampled.item()
            if not emit(token):
                return
            yield token
            guard.check()
    finally:
        queue.drain(raise_errors=False)
        if decoder is not None:
            decoder.unreserve(cache)
        timings.finish()


# ---------------------------------------------------------------------- batches

def classify_ids(model: LanguageModel, prompts: Sequence[Sequence[int]], *, sampler: Sampler,
                 processors: Sequence[LogitsProcessor] = (), return_logits: bool = False,
                 timings: Timings | None = None, context_len: int | None = None, guard: Guard = NO_GUARD,
                 step: int = PREFILL_STEP) -> tuple[list[int], list[list[float]] | None]:
    """The next id after each prompt (sampled from its last position's logits), and those logits
    when asked.

    Each prompt goes through the model as `generate`'s prefill takes it: into fresh caches of
    `context_len` (None: unbounded), in chunks of `step` at the same boundaries, the head on its
    last position alone; so its logits are those `generate` samples its first token from, and memory
    is bounded by a chunk, whatever the prompt's length. Prompts that fit one chunk and
    `context_len` are batched, left-padded as `batch_generate` pads (up to `step` tokens a pass);
    longer ones go alone, so that a cache that evicts sees exactly the chunks of that prompt alone."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    timings = timings if timings is not None else Timings()
    timings.prompt_tokens = sum(len(p) for p in prompts)
    rows: list[mx.Array | None] = [None] * len(prompts)
    for group in _classify_groups([len(p) for p in prompts], step, context_len):
        guard.check()
        members = [prompts[i] for i in group]
        width = max(len(p) for p in members)
        pad_counts = [width - len(p) for p in members]
        tokens = mx.array([[p[0]] * pad + list(p) for p, pad in zip(members, pad_counts, strict=True)], dtype=mx.int32)
        cache = model.make_cache(context_len)
        mask = None
        if any(pad_counts):
            pads = mx.array(pad_counts, dtype=mx.int32)
            mask = lambda offset, length, pads=pads: left_padded_mask(pads, offset, length)  # noqa: E731
            set_left_padding(cache, pads)
        last = prefill(model, tokens, cache, step=step, mask=mask, guard=guard, finish=lambda logits: logits)
        assert last is not None  # the prompt's last chunk always builds `finish`
        mx.eval(last)  # before the caches go: only the [rows, V] logits stay
        del cache
        for j, i in enumerate(group):
            rows[i] = last[j]
    logits = mx.stack(rows, axis=0)  # [B, V]
    if processors:
        logits = apply_processors(processors, _history(prompts), logits)
    ids = sampler(logits)
    outputs = [ids, logits.astype(mx.float32)] if return_logits else [ids]
    mx.eval(outputs)
    timings.mark_first_token()
    timings.generated_tokens = len(prompts)
    timings.finish()
    return ids.tolist(), (outputs[1].tolist() if return_logits else None)


def _classify_groups(lengths: Sequence[int], step: int, context_len: int | None) -> list[list[int]]:
    """Indices of the prompts run together by `classify_ids`, shortest first: prompts of at most one
    chunk and `context_len` tokens share a pass while rows x width stays within `step` tokens
    (padding changes nothing for them: no chunk boundary, no eviction); any other goes alone."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    groups: list[list[int]] = []
    current: list[int] = []
    for i in order:
        n = lengths[i]
        if n > step or (context_len is not None and n > context_len):
            groups.append([i])
            continue
        if current and (len(current) + 1) * n > step:  # sorted: n is the widest so far
            groups.append(current)
            current = []
        current.append(i)
    if current:
        groups.append(current)
    return groups

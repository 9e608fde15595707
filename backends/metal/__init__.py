"""The native backend: models run in this process on MLX through `pymlxc.core`.

Importing this package is cheap (`pymlxc` imports it to register the backend); the loader, the
architectures and the generation loops are imported by `MetalBackend.load`.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pymlxc.options import LoadConfig

if TYPE_CHECKING:
    from pymlxc.types import ModelInfo

    from .textmodel import MetalTextModel

Progress = Callable[[int, int], None]  # (done, total), e.g. bytes or tensors loaded


class MetalBackend:
    """`load(path, LoadConfig)` gives a `MetalTextModel`. `available()` when the binding imports."""

    name = "metal"

    def unavailable_reason(self) -> str | None:
        try:
            import pymlxc.core  # noqa: F401, PLC0415 - the question is whether it imports
        except Exception as exc:  # noqa: BLE001 - any failure to load the library is the reason
            return f"pymlxc.core cannot be imported: {type(exc).__name__}: {exc}"
        return None

    def available(self) -> bool:
        return self.unavailable_reason() is None

    def load(self, path: str, config: LoadConfig | None = None, *, progress: Progress | None = None) -> MetalTextModel:
        """Load the model directory (or GGUF file) at `path`. `progress(done, total)` is called while weights load."""
        config = config or LoadConfig()
        if config.gpu_layers not in (-1, 0):
            warnings.warn(f"gpu_layers={config.gpu_layers} is ignored by the metal backend: MLX runs every layer "
                          "on one device (gpu_layers=0 selects the CPU)", UserWarning, stacklevel=2)
        if config.gpu_layers == 0:
            import pymlxc.core as mx  # noqa: PLC0415 - this package imports cheaply (see the module doc)

            with mx.stream_scope(mx.cpu):
                return _load(path, config, progress)
        return _load(path, config, progress)


def _load(path: str, config: LoadConfig, progress: Progress | None) -> MetalTextModel:
    # The loader, the models and the generation loops load here, not when pymlxc registers the backend.
    from .formats.safetensors import read_config  # noqa: PLC0415
    from .loader import gguf_file_of, load_gguf_model, load_weights_and_config  # noqa: PLC0415
    from .textmodel import MetalTextModel  # noqa: PLC0415
    from .tokenizer import Tokenizer  # noqa: PLC0415

    gguf_file = gguf_file_of(path)
    if gguf_file is not None:  # tokenizer and weights from one GGUF file (see gguf.py)
        tokenizer, loaded = load_gguf_model(gguf_file, context_len=config.context_len, progress=progress,
                                            settings=config.settings, dtype=config.dtype)
        source = str(gguf_file)
    else:
        read_config(path)  # first: a folder that is no model directory is named as such, not by its tokenizer
        tokenizer = Tokenizer(path)  # then: a missing tokenizer fails before gigabytes are read
        loaded = load_weights_and_config(path, context_len=config.context_len, progress=progress,
                                         settings=config.settings, distributed=config.distributed,
                                         dtype=config.dtype)
        source = str(Path(path) / "tokenizer.json")
    if config.distributed is not None and loaded.distributed is None:  # GGUF: split once loaded (distributed/)
        from .distributed import shard_loaded  # noqa: PLC0415 - loaded with the model (see above)

        shard_loaded(loaded, config.distributed)
    try:
        check_vocab(tokenizer, loaded.model.args, source)
        model = MetalTextModel(loaded.model, tokenizer, model_type=loaded.model_type, info=_model_info(loaded),
                               release=loaded.free, config=config, stop_ids=_config_eos_ids(loaded.config))
    except BaseException:
        loaded.free()
        raise
    if config.adapter_path is not None:
        try:
            model.load_adapter(config.adapter_path)
        except BaseException:
            model.close()
            raise
    return model


def embedding_rows(args: Any) -> int:
    """How many token ids the model can embed: `vocab_size`, or fewer when a second table (Gemma 4's
    per-layer input embeddings) is smaller."""
    rows = int(args.vocab_size)
    if getattr(args, "hidden_size_per_layer_input", 0) and getattr(args, "vocab_size_per_layer_input", None):
        rows = min(rows, int(args.vocab_size_per_layer_input))
    return rows


def check_vocab(tokenizer: Any, args: Any, source: str) -> None:
    """The tokenizer's ids against the model's embedding rows. Ordinary text encoding to ids the
    model has no row for means tokenizer and weights do not belong together: an error. Added tokens
    past the rows (a `<pad>` appended by a fine-tuning tool, say) are common and harmless as long as
    those ids never reach the model, which the per-call id check of the model refuses: a warning."""
    from .tokenizer import TokenizerLoadError  # noqa: PLC0415 - loaded with the model (see _load)

    rows = embedding_rows(args)
    backend = tokenizer.backend
    added = backend.get_added_tokens_decoder()
    base_max = max((i for i in backend.get_vocab(with_added_tokens=False).values() if i not in added), default=-1)
    if base_max >= rows:
        raise TokenizerLoadError(f"{source}: the tokenizer's vocabulary has ids up to {base_max}, but the model "
                                 f"embeds only {rows} (config vocab_size): the tokenizer is not this model's")
    beyond = sorted(i for i in added if i >= rows)
    if beyond:
        names = ", ".join(f"{added[i].content!r} ({i})" for i in beyond[:5]) + (" ..." if len(beyond) > 5 else "")
        warnings.warn(f"{source}: {len(beyond)} added token{'s' if len(beyond) > 1 else ''} past the model's "
                      f"{rows} embedding rows: {names}; a prompt that contains "
                      f"{'them' if len(beyond) > 1 else 'it'} cannot be run", UserWarning, stacklevel=3)


def _model_info(loaded: Any) -> ModelInfo:
    from pymlxc.types import ModelInfo  # noqa: PLC0415 - loaded with the model (see _load)

    args = loaded.model.args
    return ModelInfo(
        architecture=loaded.model_type,
        vocab_size=int(args.vocab_size),
        num_layers=len(loaded.model.layers),
        hidden_size=int(args.hidden_size),
        quant_bits=int(loaded.quant_bits or 0),
        quant_group=int(loaded.quant_group or 0),
    )


def _config_eos_ids(config: Any) -> frozenset[int]:
    """eos_token_id of config.json (an id or a list), in case the tokenizer files lack it."""
    if not isinstance(config, dict):
        return frozenset()
    text_config = config.get("text_config")
    sources: list[dict[str, Any]] = [config, text_config if isinstance(text_config, dict) else {}]
    ids: set[int] = set()
    for source in sources:
        value = source.get("eos_token_id")
        values = value if isinstance(value, list) else [value]
        ids.update(v for v in values if isinstance(v, int) and not isinstance(v, bool))
    return frozenset(ids)


BACKEND = MetalBackend()


def register_backend() -> None:
    """Add the metal backend to pymlxc's registry."""
    from pymlxc.registry import register  # noqa: PLC0415 - pymlxc imports this package while it registers backends

    register(BACKEND)


__all__ = ["MetalBackend", "BACKEND", "register_backend"]

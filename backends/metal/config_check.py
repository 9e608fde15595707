"""The one validator of `config.json` for every architecture: each field that a `ModelArgs`
dataclass declares is checked against its type annotation and a range, the RoPE entries against
what the RoPE code reads, and a few fields against each other, before anything is built from them.
A second pass checks the resolved arguments (after `__post_init__` has merged `rope_parameters`
and filled defaults). `check_against_tensors` then compares the sizes with the checkpoint's
tensors before a model of that size is allocated.

Errors are `ConfigError`s that name the field (`rope_scaling.factor`, `text_config.hidden_size`);
the loader prefixes the file.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import re
import reprlib
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any

from .formats.errors import ConfigError

MAX_DIM = 2**31 - 1  # MLX shapes are 32-bit integers

# Sizes and counts that must be at least 1 when given (other integers may be 0, e.g. num_experts).
POSITIVE_INTS = frozenset({
    "hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads", "vocab_size", "head_dim",
    "num_key_value_heads", "global_head_dim", "num_global_key_value_heads", "vocab_size_per_layer_input",
    "sliding_window", "sliding_window_pattern", "num_experts_per_tok", "decoder_sparse_step", "top_k_experts",
    "max_position_embeddings",
})
# Floats that must be above 0 (other floats must be finite and not negative): an RMSNorm of eps 0
# divides a zero row by 0, a softcap of 0 divides the logits by 0 (null turns a softcap off).
POSITIVE_FLOATS = frozenset({"rope_theta", "rope_local_base_freq", "query_pre_attn_scalar", "rms_norm_eps",
                             "attn_logit_softcapping", "final_logit_softcapping"})
LAYER_TYPES = ("sliding_attention", "full_attention")
_ROPE_NUMBERS = ("rope_theta", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings",
                 "partial_rotary_factor")

_repr = reprlib.Repr()
_repr.maxstring = 60
_repr.maxother = 60
_repr.maxlevel = 2


def _show(value: Any) -> str:
    return _repr.repr(value)


def _bad(field: str, want: str, value: Any) -> ConfigError:
    return ConfigError(f"{field}: expected {want}, got {_show(value)}")


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_int(field: str, value: Any, positive: bool) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # 4096.0 is 4096, exactly
    if not isinstance(value, int) or isinstance(value, bool):
        raise _bad(field, "an integer", value)
    low = 1 if positive else 0
    if not low <= value <= MAX_DIM:
        raise _bad(field, f"an integer in {low}..{MAX_DIM}", value)
    return value


def _check_float(field: str, value: Any, positive: bool) -> float:
    if not _is_number(value) or not math.isfinite(value):
        raise _bad(field, "a finite number", value)
    if value < 0 or (positive and value == 0):
        raise _bad(field, "a number above 0" if positive else "a number of at least 0", value)
    return float(value)


def _optional(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in typing.get_args(hint)


def check_value(field: str, hint: Any, value: Any) -> Any:
    """`value` checked against the annotation `hint` (int, float, bool, str, dict, list[...] and
    their `| None`); returns it normalised (an integral float as an int, an int as a float)."""
    name = field.rpartition(".")[2]
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:
            return check_value(field, options[0], value)
        return value  # no such field today; accept what the dataclass takes
    if hint is Any:
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise _bad(field, "true or false", value)
        return value
    if hint is int:
        return _check_int(field, value, name in POSITIVE_INTS)
    if hint is float:
        return _check_float(field, value, name in POSITIVE_FLOATS)
    if hint is str:
        if not isinstance(value, str):
            raise _bad(field, "a string", value)
        return value
    if origin is dict or hint is dict:
        if not isinstance(value, Mapping):
            raise _bad(field, "an object", value)
        return value
    if origin is list or hint is list:
        if not isinstance(value, list):
            raise _bad(field, "a list", value)
        item = args[0] if args else Any
        return [check_value(f"{field}[{i}]", item, v) for i, v in enumerate(value)]
    return value


def check_rope(field: str, params: Any) -> None:
    """A `rope_scaling` / `rope_parameters` entry: an object whose numbers are finite and positive,
    with the `factor` that linear and llama3 scaling divide by."""
    if params is None:
        return
    if not isinstance(params, Mapping):
        raise _bad(field, "an object", params)
    for key in ("type", "rope_type"):
        if key in params and not isinstance(params[key], str):
            raise _bad(f"{field}.{key}", "a string", params[key])
    # An unsupported kind is refused by the RoPE code of the architectures that use it (qwen3_moe,
    # like mlx-lm, ignores the scaling), so only the numbers that the code reads are checked here.
    kind = str(params.get("type") or params.get("rope_type") or "default")
    for key in _ROPE_NUMBERS:
        if key in params and params[key] is not None:
            _check_float(f"{field}.{key}", params[key], positive=True)
    if kind in ("linear", "llama3") and params.get("factor") is None:
        raise ConfigError(f"{field}.factor: {kind} RoPE scaling needs a factor")
    if kind == "llama3" and params.get("low_freq_factor", 1.0) == params.get("high_freq_factor", 4.0):
        raise ConfigError(f"{field}: low_freq_factor and high_freq_factor must differ (llama3 RoPE divides by "
                          "their difference)")
    if "partial_rotary_factor" in params and params["partial_rotary_factor"] > 1:
        raise _bad(f"{field}.partial_rotary_factor", "a number in (0, 1]", params["partial_rotary_factor"])


def _check_rope_fields(values: Mapping[str, Any], prefix: str) -> None:
    check_rope(prefix + "rope_scaling", values.get("rope_scaling"))
    rp = values.get("rope_parameters")
    if rp is None:
        return
    if not isinstance(rp, Mapping):
        raise _bad(prefix + "rope_parameters", "an object", rp)
    nested = [k for k in LAYER_TYPES if k in rp]
    for k in nested:  # transformers >= 5, per layer type: {"full_attention": {...}, "sliding_attention": {...}}
        check_rope(f"{prefix}rope_parameters.{k}", rp[k])
    if not nested:
        check_rope(prefix + "rope_parameters", rp)


def check_params(cls: type, params: Any, prefix: str = "") -> dict[str, Any]:
    """The keyword arguments of `cls` (a ModelArgs dataclass) from the config dict `params`, each
    checked; unknown keys are ignored, missing required ones named."""
    if not isinstance(params, Mapping):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected an object, got {_show(params)}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    missing = [n for n, f in fields.items()
               if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and n not in params]
    if missing:
        raise ConfigError(f"config is missing required field{'s' if len(missing) > 1 else ''}: "
                          + ", ".join(prefix + m for m in missing))
    hints = _hints(cls)
    # null where the field cannot be None but has a default means "not set" (as in transformers).
    unset = {k for k, v in params.items() if v is None and k in fields and not _optional(hints[k])
             and (fields[k].default is not dataclasses.MISSING or fields[k].default_factory is not dataclasses.MISSING)}
    kwargs = {k: check_value(prefix + k, hints[k], v) for k, v in params.items() if k in fields and k not in unset}
    _check_rope_fields(kwargs, prefix)
    return kwargs


def check_args(args: Any, prefix: str = "") -> None:
    """The resolved arguments (after `__post_init__`): every field again, the RoPE entries, and the
    fields that must agree with each other."""
    cls: type = type(args)
    hints = _hints(cls)
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(args)}
    for name, value in values.items():
        check_value(prefix + name, hints[name], value)
    _check_rope_fields(values, prefix)
    n_layers = values.get("num_hidden_layers")
    heads = values.get("num_attention_heads")
    for kv in ("num_key_value_heads", "num_global_key_value_heads"):
        if heads and values.get(kv) and heads % values[kv]:
            raise ConfigError(f"{prefix}{kv}: {values[kv]} does not divide num_attention_heads {heads}")
    layer_types = values.get("layer_types")
    if layer_types is not None and n_layers is not None:
        if len(layer_types) != n_layers:
            raise ConfigError(f"{prefix}layer_types: {len(layer_types)} entries for num_hidden_layers {n_layers}")
        unknown = sorted(set(layer_types) - set(LAYER_TYPES))
        if unknown:
            raise ConfigError(f"{prefix}layer_types: unsupported layer types {unknown} "
                              f"(supported: {', '.join(LAYER_TYPES)})")
    for name in ("mlp_only_layers",):
        for i in values.get(name) or ():
            if n_layers is not None and not 0 <= i < n_layers:
                raise ConfigError(f"{prefix}{name}: layer {i} is not in 0..{n_layers - 1}")
    shared = values.get("num_kv_shared_layers")
    if shared is not None and n_layers is not None and shared >= n_layers and shared:
        raise ConfigError(f"{prefix}num_kv_shared_layers: {shared} of {n_layers} layers leaves none to share from")


_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.")
_EXPERT = re.compile(r"^(?:model\.)?layers\.\d+\.mlp\.experts\.(\d+)\.")


def check_against_tensors(args: Any, shapes: Mapping[str, Sequence[int]]) -> None:
    """The config's sizes against the checkpoint's tensors (canonical names -> shapes), before a
    model of the config's size is built: the number of layers and the embedding's rows and width.
    Only what strict loading would refuse later is refused here, so no valid checkpoint fails."""
    n_layers = getattr(args, "num_hidden_layers", None)
    indices = {int(m.group(1)) for name in shapes if (m := _LAYER.match(name))}
    if n_layers is not None and not indices and any(n.startswith("model.") for n in shapes):
        raise ConfigError(f"num_hidden_layers: {n_layers}, but the checkpoint has no layer tensors (model.layers.*)")
    if n_layers is not None and indices and max(indices) + 1 != n_layers:
        raise ConfigError(f"num_hidden_layers: {n_layers}, but the checkpoint's tensors hold "
                          f"{max(indices) + 1} layers (model.layers.0 .. model.layers.{max(indices)})")
    # Per-expert tensors (HF's layout) are stacked by index 0 .. num_experts - 1: a count that differs
    # stacked nothing (an MLX error) or built 2**31 names before any tensor was looked at.
    n_experts = getattr(args, "num_experts", None)
    experts = {int(m.group(1)) for name in shapes if (m := _EXPERT.match(name))}
    if isinstance(n_experts, int) and experts and max(experts) + 1 != n_experts:
        raise ConfigError(f"num_experts: {n_experts}, but the checkpoint's tensors hold {max(experts) + 1} experts "
                          f"(mlp.experts.0 .. mlp.experts.{max(experts)})")
    for name in ("model.embed_tokens.weight", "embed_tokens.weight"):
        shape = shapes.get(name)
        if shape is None:
            continue
        vocab, hidden = getattr(args, "vocab_size", None), getattr(args, "hidden_size", None)
        if vocab is not None and len(shape) == 2 and shape[0] != vocab:
            raise ConfigError(f"vocab_size: {vocab}, but the checkpoint's {name} has {shape[0]} rows")
        quantized = name.replace(".weight", ".scales") in shapes  # packed: the width is not hidden_size
        if hidden is not None and len(shape) == 2 and not quantized and shape[1] != hidden:
            raise ConfigError(f"hidden_size: {hidden}, but the checkpoint's {name} is {shape[1]} wide")
        break


__all__ = ["ConfigError", "MAX_DIM", "check_params", "check_args", "check_value", "check_rope",
           "check_against_tensors"]

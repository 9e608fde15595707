"""The config of a GGUF model: its metadata as Python values, and the HF-style config.json that
pymlxc's architecture files read, from the `<arch>.*` keys and the tensor shapes (checked against
each other, so that a corrupt count fails before a model of that size is built)."""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal, overload

import numpy as np
from gguf import GGMLQuantizationType as QType
from gguf import GGUFReader, GGUFValueType

ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe", "gemma2", "gemma3", "gemma4", "qwen3next",
                 "qwen35", "qwen35moe")
_MODEL_TYPE = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe",
               "gemma2": "gemma2", "gemma3": "gemma3_text", "gemma4": "gemma4_text", "qwen3next": "qwen3_next",
               "qwen35": "qwen3_5", "qwen35moe": "qwen3_5_moe"}
_MOE = ("qwen2moe", "qwen3moe")
GATED_DELTA = ("qwen3next", "qwen35", "qwen35moe")  # Gated DeltaNet linear attention (Qwen3-Next, Qwen 3.5)


class GGUFError(ValueError):
    """A GGUF file is malformed, or holds something pymlxc cannot load; the message names the file."""



# ---------------------------------------------------------------------- metadata

def metadata(reader: GGUFReader, key: str, default: Any = None) -> Any:
    """A metadata value as Python: str, int, float, bool, or a list of them."""
    field = reader.fields.get(key)
    if field is None or not field.types:
        return default
    try:
        if field.types[0] == GGUFValueType.ARRAY:
            return field.contents(slice(None))
        value = field.contents()
    except UnicodeDecodeError as exc:
        raise GGUFError(f"metadata {key} is not valid UTF-8: {exc}") from None
    if field.types[0] == GGUFValueType.FLOAT32:
        value = float(str(np.float32(value)))  # 1e-05, not 9.999999747378752e-06
    return value


def scalar(reader: GGUFReader, key: str, default: Any = None) -> Any:
    value = metadata(reader, key, default)
    return default if isinstance(value, list) else value


# An int default or `required` makes the result an int.
@overload
def _int(reader: GGUFReader, key: str, default: int, *, required: bool = False) -> int: ...
@overload
def _int(reader: GGUFReader, key: str, default: None = None, *, required: Literal[True]) -> int: ...
@overload
def _int(reader: GGUFReader, key: str, default: None = None, *, required: bool = False) -> int | None: ...
def _int(reader: GGUFReader, key: str, default: int | None = None, *, required: bool = False) -> int | None:
    """An integer key; a per-layer list is accepted when all its entries agree."""
    value = metadata(reader, key)
    if isinstance(value, list):
        distinct = set(value)
        if len(distinct) != 1:
            raise GGUFError(f"{key} varies by layer ({sorted(distinct)}), which pymlxc's models do not support")
        value = distinct.pop()
    if value is None:
        if required:
            raise GGUFError(f"the metadata key {key} is missing")
        return default
    # A float key may hold NaN or infinity, which int() refuses with a bare ValueError or OverflowError.
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or value != int(value) or value < 0):
        raise GGUFError(f"{key} must be a non-negative integer, got {value!r}")
    return int(value)


@overload
def _float(reader: GGUFReader, key: str, default: float) -> float: ...
@overload
def _float(reader: GGUFReader, key: str, default: None = None) -> float | None: ...
def _float(reader: GGUFReader, key: str, default: float | None = None) -> float | None:
    value = metadata(reader, key)  # not `scalar`: a list in place of the number is refused, not ignored
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise GGUFError(f"{key} must be a finite number, got {value!r}")
    return float(value)


def architecture(reader: GGUFReader) -> str:
    arch = metadata(reader, "general.architecture")
    if arch is None:
        raise GGUFError("the metadata key general.architecture is missing")
    if not isinstance(arch, str):
        raise GGUFError(f"general.architecture must be a string, got {arch!r}")
    return arch


def _check_vocab_size(reader: GGUFReader, arch: str, rows: int) -> None:
    """`<arch>.vocab_size`, where the file has it, must be the token embedding's rows (llama.cpp
    refuses the file otherwise)."""
    key = f"{arch}.vocab_size"
    value = metadata(reader, key)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value != rows:
        raise GGUFError(f"{key} is {value!r}, but the token embedding token_embd.weight has {rows} rows")


def _embedding(shapes: Mapping[str, tuple[int, ...]]) -> tuple[int, ...]:
    embed = shapes.get("token_embd.weight")
    if embed is None:
        raise GGUFError("the token embedding tensor token_embd.weight is missing")
    if len(embed) != 2:
        raise GGUFError(f"the token embedding tensor token_embd.weight has shape {embed}, not [vocab, hidden]")
    return embed


def model_type_of(arch: str) -> str:
    if arch not in _MODEL_TYPE:
        raise GGUFError(f"GGUF architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}")
    return _MODEL_TYPE[arch]


def _tensor_shapes(reader: GGUFReader) -> dict[str, tuple[int, ...]]:
    """Tensor shapes in MLX order (GGUF lists the fastest-varying dimension first)."""
    return {t.name: tuple(int(d) for d in reversed(t.shape.tolist())) for t in reader.tensors}


def gguf_config(reader: GGUFReader) -> dict[str, Any]:
    """The HF-style config.json of the model in `reader`, from its `<arch>.*` keys and tensor shapes."""
    arch = architecture(reader)
    model_type = model_type_of(arch)
    shapes = _tensor_shapes(reader)
    def key(name: str) -> str:
        return f"{arch}.{name}"


    hidden = _int(reader, key("embedding_length"), required=True)
    heads = _int(reader, key("attention.head_count"), required=True)
    if not hidden or not heads:
        raise GGUFError(f"{key('embedding_length')} and {key('attention.head_count')} must be positive")
    if arch == "gemma4":  # per-layer arrays and two head sizes: a reading of its own
        return _gemma4_config(reader, shapes, hidden, heads)
    if arch in GATED_DELTA:  # linear-attention blocks, partial RoPE, a multi-token prediction tail
        return _gated_delta_config(reader, arch, shapes, hidden, heads)
    kv_heads = _int(reader, key("attention.head_count_kv"), heads) or heads
    head_dim = _int(reader, key("attention.key_length"), hidden // heads) or hidden // heads
    value_dim = _int(reader, key("attention.value_length"), head_dim)
    if value_dim != head_dim:
        raise GGUFError(f"key_length {head_dim} != value_length {value_dim}: not supported")
    rope_dims = _int(reader, key("rope.dimension_count"), head_dim)
    if rope_dims != head_dim:
        raise GGUFError(f"partial rotary embeddings ({rope_dims} of {head_dim} dimensions) are not supported")
    vocab = _embedding(shapes)[0]
    _check_vocab_size(reader, arch, vocab)
    context = _int(reader, key("context_length"), 4096)
    config: dict[str, Any] = {
        "model_type": model_type,
        "architectures": [_ARCH_CLASS[arch]],
        "hidden_size": hidden,
        "num_hidden_layers": _int(reader, key("block_count"), required=True),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": _int(reader, key("feed_forward_length"), 0, required=arch not in _MOE),
        "vocab_size": vocab,
        "max_position_embeddings": context,
        "rms_norm_eps": _float(reader, key("attention.layer_norm_rms_epsilon"), 1e-5 if arch == "llama" else 1e-6),
        "rope_theta": _float(reader, key("rope.freq_base"), 10000.0),
        "tie_word_embeddings": "output.weight" not in shapes,
    }
    _check_against_tensors(config, shapes)
    if arch == "gemma2" and "output.weight" in shapes:
        # Gemma 2's model always computes its logits with the token embedding, so an output head of
        # the file's own would be dropped without a word (llama.cpp refuses the extra tensor too).
        raise GGUFError("tensor output.weight has no place in a gemma2 model, whose output head is the token "
                        "embedding token_embd.weight")
    rope_scaling = _rope_scaling(reader, arch, head_dim, config["rope_theta"])
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    if arch in ("llama", "qwen2", "qwen2moe"):
        config["attention_bias"] = "blk.0.attn_q.bias" in shapes
    if arch in _MOE:
        config.update(_moe_config(reader, arch, config, shapes))
    if arch in ("gemma2", "gemma3"):
        config.update(_gemma_config(reader, arch, config))
    for name in ("bos_token_id", "eos_token_id"):
        token = scalar(reader, f"tokenizer.ggml.{name}")
        if isinstance(token, int) and not isinstance(token, bool):
            config[name] = token
    return config


def _check_against_tensors(config: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], *,
                           attention: bool = True) -> None:
    """The hyperparameters must describe the tensors the file holds (a corrupt block count would
    otherwise build a model of millions of layers before any weight is matched)."""
    layers = config["num_hidden_layers"]
    blocks = {int(n.split(".")[1]) for n in shapes if n.startswith("blk.") and n.split(".")[1].isdigit()}
    if len(blocks) != layers or (blocks and (min(blocks) != 0 or max(blocks) != layers - 1)):
        numbers = sorted(blocks)
        listed = ", ".join(map(str, numbers[:8])) + (", ..." if len(numbers) > 8 else "")
        raise GGUFError(f"block_count is {layers} but the file has tensors for {len(blocks)} blocks"
                        + (f" (numbered {listed}; expected 0 to {layers - 1})" if blocks else ""))
    hidden, head_dim = config["hidden_size"], config["head_dim"]
    expected = {"token_embd.weight": (config["vocab_size"], hidden)}
    if attention:
        expected["blk.0.attn_q.weight"] = (config["num_attention_heads"] * head_dim, hidden)
        expected["blk.0.attn_k.weight"] = (config["num_key_value_heads"] * head_dim, hidden)
    dense = [n for n in shapes if n.startswith("blk.") and n.endswith(".ffn_up.weight")]
    if dense or not any(n.endswith(".ffn_gate_inp.weight") for n in shapes):  # MoE files may have no dense MLP
        expected[dense[0] if dense else "blk.0.ffn_up.weight"] = (config["intermediate_size"], hidden)
    for name, shape in expected.items():
        if shapes.get(name) != shape:
            raise GGUFError(f"tensor {name} has shape {shapes.get(name)}, but the metadata implies {shape}")


_ARCH_CLASS = {"gemma4": "Gemma4ForCausalLM", "qwen3next": "Qwen3NextForCausalLM",
               "qwen35": "Qwen3_5ForCausalLM", "qwen35moe": "Qwen3_5MoeForCausalLM",
               "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
               "qwen2moe": "Qwen2MoeForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM",
               "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}


def _moe_config(reader: GGUFReader, arch: str, base: Mapping[str, Any],
                shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
    """Experts from the `expert_*` keys, checked against the stacked tensors [E, ff, hidden]. Layers
    without a router are dense (`mlp_only_layers`). llama.cpp renormalises the top-k weights for
    every Qwen MoE but qwen2moe, unless `expert_weights_norm` says otherwise; qwen2moe, qwen3next and
    qwen35moe add a gated shared expert."""
    def key(name: str) -> str:
        return f"{arch}.{name}"

    layers, hidden = base["num_hidden_layers"], base["hidden_size"]
    experts = _int(reader, key("expert_count"), required=True)
    used = _int(reader, key("expert_used_count"), required=True)
    moe_layers = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" in shapes]
    if not experts or not used or not moe_layers:
        raise GGUFError(f"{key('expert_count')} is {experts} and {key('expert_used_count')} {used}, "
                        f"with routers in {len(moe_layers)} blocks: not a mixture-of-experts model")
    first = moe_layers[0]
    ff = shapes.get(f"blk.{first}.ffn_up_exps.weight")
    fused = shapes.get(f"blk.{first}.ffn_gate_up_exps.weight")
    if ff is None and fused is not None and len(fused) == 3 and fused[1] % 2 == 0:
        ff = (fused[0], fused[1] // 2, fused[2])  # llama.cpp's fused [experts, 2 * ff, hidden]
    if ff is None or len(ff) != 3:
        raise GGUFError(f"tensor blk.{first}.ffn_up_exps.weight is missing or not stacked [experts, ff, hidden]")
    ff_len = _int(reader, key("expert_feed_forward_length"), ff[1])
    if ff != (experts, ff_len, hidden):
        raise GGUFError(f"tensor blk.{first}.ffn_up_exps.weight has shape {ff}, but the metadata implies "
                        f"{(experts, ff_len, hidden)}")
    norm = metadata(reader, key("expert_weights_norm"))
    out: dict[str, Any] = {
        "num_experts": experts, "num_experts_per_tok": used, "moe_intermediate_size": ff_len, "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in range(layers) if i not in moe_layers],
        "norm_topk_prob": bool(norm) if isinstance(norm, bool) else arch != "qwen2moe",
    }
    if arch in ("qwen2moe", *GATED_DELTA):
        shared = shapes.get(f"blk.{first}.ffn_up_shexp.weight")
        out["shared_expert_intermediate_size"] = _int(reader, key("expert_shared_feed_forward_length"),
                                                      shared[0] if shared else 0)
        if not shared or shared != (out["shared_expert_intermediate_size"], hidden):
            raise GGUFError(f"tensor blk.{first}.ffn_up_shexp.weight has shape {shared}, but the metadata implies "
                            f"{(out['shared_expert_intermediate_size'], hidden)}")
    return out


# llama.cpp scales Gemma's queries by 1/sqrt(hidden / heads) in the 27B models and by
# 1/sqrt(head_dim) in the others; the GGUF has no key for it. The 27B models are told by depth.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def _gemma_config(reader: GGUFReader, arch: str, base: Mapping[str, Any]) -> dict[str, Any]:
    def key(name: str) -> str:
        return f"{arch}.{name}"

    layers, hidden, heads = base["num_hidden_layers"], base["hidden_size"], base["num_attention_heads"]
    wide = layers == _GEMMA_27B_LAYERS[arch]
    out: dict[str, Any] = {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": hidden // heads if wide else base["head_dim"],
        "sliding_window": _int(reader, key("attention.sliding_window"), 4096),
        "attn_logit_softcapping": _float(reader, key("attn_logit_softcapping")),
        "final_logit_softcapping": _float(reader, key("final_logit_softcapping")),
    }
    if arch == "gemma2":
        if out["attn_logit_softcapping"] is None:
            out["attn_logit_softcapping"] = 50.0
        if out["final_logit_softcapping"] is None:
            out["final_logit_softcapping"] = 30.0
        return out
    # Gemma 3: every sixth layer is global unless the file says otherwise (a period, or a per-layer
    # list of booleans, true for sliding-window layers). A file without a window (or 0) has none:
    # every layer attends to the whole context, as llama.cpp loads it (not Gemma 2's 4096).
    window = _int(reader, key("attention.sliding_window"))
    if window is None or window <= 0:
        out["sliding_window"] = base["max_position_embeddings"]
        out["layer_types"] = ["full_attention"] * layers
    else:
        sliding, period = _sliding_layers(reader, key("attention.sliding_window_pattern"), layers, 6)
        if period is not None:
            out["sliding_window_pattern"] = period
        out["layer_types"] = ["sliding_attention" if s else "full_attention" for s in sliding]
    out["rope_local_base_freq"] = _float(reader, key("rope.freq_base_swa"), 10000.0)
    return out


def _sliding_layers(reader: GGUFReader, key: str, layers: int, default_period: int) -> tuple[list[bool], int | None]:
    """Which layers use the sliding window, from `key`: a per-layer list of booleans (true for
    sliding layers), else a period (`default_period` when absent or not positive) whose every last
    layer is global. Also the period, None where the file gave a list."""
    pattern = metadata(reader, key)
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise GGUFError(f"{key} has {len(pattern)} entries for {layers} layers")
        if not all(isinstance(v, bool) for v in pattern):
            raise GGUFError(f"{key} must be one boolean per layer (true for sliding-window layers), got {pattern!r}")
        return [bool(v) for v in pattern], None
    if pattern is not None and (isinstance(pattern, bool) or not isinstance(pattern, int)):
        raise GGUFError(f"{key} must be a period (an integer) or one boolean per layer, got {pattern!r}")
    period = int(pattern) if isinstance(pattern, int) and pattern > 0 else default_period
    return [(i + 1) % period != 0 for i in range(layers)], period


def _rope_scaling(reader: GGUFReader, arch: str, head_dim: int, base: float) -> dict[str, Any] | None:
    def key(name: str) -> str:
        return f"{arch}.{name}"

    kind = metadata(reader, key("rope.scaling.type"))
    if kind is not None and not isinstance(kind, str):
        raise GGUFError(f"{key('rope.scaling.type')} must be a string, got {kind!r}")
    factor = _float(reader, key("rope.scaling.factor"))
    if kind in ("linear", "yarn") and factor and factor != 1.0:
        out: dict[str, Any] = {"rope_type": kind, "factor": factor}
        original = _int(reader, key("rope.scaling.original_context_length"))
        if original:
            out["original_max_position_embeddings"] = original
        return out
    if kind not in (None, "none", "linear", "yarn"):
        raise GGUFError(f"RoPE scaling type {kind!r} is not supported")
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if arch == "llama" and freqs is not None:
        if freqs.tensor_type not in (QType.F32, QType.F16):
            raise GGUFError(f"rope_freqs.weight has type {freqs.tensor_type.name} (expected F32)")
        return llama3_rope_scaling(np.asarray(freqs.data, dtype=np.float64), head_dim, base)
    return None


def llama3_rope_scaling(factors: np.ndarray, head_dim: int, base: float) -> dict[str, Any] | None:
    """The HF `rope_scaling` of Llama 3 whose per-pair factors llama.cpp stored as `rope_freqs`.

    Pair i of frequency base^(-2i/d) has wavelength w = 2 pi base^(2i/d). Llama 3 keeps short
    wavelengths (factor 1), slows long ones by `factor`, and in between divides by
    (1 - s) / factor + s with s = (L / w - low) / (high - low), L the original context. Those three
    numbers are only fixed up to a common scale, so low is taken as 1 (Llama 3's value) and s is
    fitted against 1 / w. The fit is checked by recomputing every factor."""
    f = np.asarray(factors, dtype=np.float64).reshape(-1)
    if f.size != head_dim // 2 or not np.all(np.isfinite(f)) or np.any(f <= 0):
        raise GGUFError(f"rope_freqs has {f.size} entries (expected {head_dim // 2} positive ones)")
    if np.allclose(f, 1.0):
        return None
    factor = float(f.max())
    wavelen = 2 * math.pi * base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    medium = (f > 1 + 1e-6) & (f < factor * (1 - 1e-6))
    s = (1 / f[medium] - 1 / factor) / (1 - 1 / factor)  # the blend weight of each medium pair
    if medium.sum() >= 2:
        slope, intercept = np.polyfit(1 / wavelen[medium], s, 1)
        if intercept >= 0 or slope <= 0:
            raise GGUFError("rope_freqs do not follow Llama 3's RoPE scaling")
        high = 1 - 1 / intercept
        original = -slope / intercept
    elif medium.sum() == 1:
        # One equation, s = (L / w - 1) / (high - 1): any L between this wavelength and the first
        # slowed one whose high keeps the shorter wavelengths unscaled reproduces every factor.
        w, slowed = float(wavelen[medium][0]), wavelen[f >= factor * (1 - 1e-6)]
        top = float(slowed.min()) if slowed.size else w * 1e3
        llama3 = w * (1 + 3 * float(s[0]))  # the L of Llama 3's high / low = 4, tried first
        for original in [llama3, *np.geomspace(w, top, 66)[1:-1]]:
            high = 1 + (original / w - 1) / float(s[0])
            trial = {"factor": factor, "low_freq_factor": 1.0, "high_freq_factor": high,
                     "original_max_position_embeddings": original}
            if np.allclose(_llama3_factors(trial, wavelen), f, rtol=1e-4, atol=1e-6):
                break
        else:
            raise GGUFError("rope_freqs do not follow Llama 3's RoPE scaling")
    else:  # no blend region: any boundaries between the kept and the slowed wavelengths fit
        kept, slowed = wavelen[f <= 1 + 1e-6], wavelen[f > 1 + 1e-6]
        if not kept.size or not slowed.size:
            raise GGUFError("rope_freqs do not follow Llama 3's RoPE scaling")
        original, high = float(np.sqrt(kept.max() * slowed.min())), 1.0 + 1e-3
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": float(high),
               "original_max_position_embeddings": float(original)}
    if not np.allclose(_llama3_factors(scaling, wavelen), f, rtol=1e-4, atol=1e-6):
        raise GGUFError("rope_freqs do not follow Llama 3's RoPE scaling")
    return scaling


def _llama3_factors(scaling: Mapping[str, Any], wavelen: np.ndarray) -> np.ndarray:
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    smooth = (original / wavelen - low) / (high - low)
    blend = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, blend))


def model_layers(reader: GGUFReader, arch: str) -> int:
    """Blocks of the model proper: llama.cpp appends the multi-token prediction layers
    (`nextn_predict_layers`) to `block_count`; pymlxc drops them."""
    total = _int(reader, f"{arch}.block_count", required=True)
    nextn = _int(reader, f"{arch}.nextn_predict_layers", 0) or 0
    if nextn >= total:
        raise GGUFError(f"{arch}.nextn_predict_layers is {nextn} of {total} blocks")
    return total - nextn


def _full_attention_interval(reader: GGUFReader, arch: str, layers: int) -> int:
    """Every interval-th layer is full attention, the others linear. Newer converters write the
    per-layer `attention.recurrent_layers` (the multi-token prediction layers last, not recurrent);
    pymlxc's models take a period, so the list must be one."""
    recurrent = metadata(reader, f"{arch}.attention.recurrent_layers")
    interval = _int(reader, f"{arch}.full_attention_interval", 4) or 0
    if isinstance(recurrent, list):
        if len(recurrent) < layers:
            raise GGUFError(f"{arch}.attention.recurrent_layers has {len(recurrent)} entries for {layers} layers")
        linear = [bool(v) for v in recurrent[:layers]]
        interval = next((i + 1 for i, v in enumerate(linear) if not v), layers + 1)
        if any(v != ((i + 1) % interval != 0) for i, v in enumerate(linear)):
            raise GGUFError(f"{arch}.attention.recurrent_layers {linear} is not one full-attention layer every n "
                            "layers, which pymlxc's models require")
    if interval < 1:
        raise GGUFError(f"{arch}.full_attention_interval must be at least 1, got {interval}")
    return interval


def _gated_delta_config(reader: GGUFReader, arch: str, shapes: Mapping[str, tuple[int, ...]], hidden: int,
                        heads: int) -> dict[str, Any]:
    """Qwen3-Next and Qwen 3.5 as llama.cpp's converter writes them: the linear layers' sizes under
    `ssm.*` (conv_kernel, state_size = key head size, group_count = key heads, time_step_rank =
    value heads, inner_size = value heads x value head size), the rotated share of the attention
    head as `rope.dimension_count` (the M-RoPE sections change nothing for text), and the
    multi-token prediction blocks after the model's own (dropped)."""
    def key(name: str) -> str:
        return f"{arch}.{name}"

    layers = model_layers(reader, arch)
    own = {n: s for n, s in shapes.items()
           if not (n.startswith("blk.") and n.split(".")[1].isdigit() and int(n.split(".")[1]) >= layers)}
    kv_heads = _int(reader, key("attention.head_count_kv"), heads) or heads
    head_dim = _int(reader, key("attention.key_length"), hidden // heads) or hidden // heads
    if _int(reader, key("attention.value_length"), head_dim) != head_dim:
        raise GGUFError(f"{key('attention.key_length')} and value_length differ: not supported")
    rope_dims = _int(reader, key("rope.dimension_count"), head_dim // 4)
    if not rope_dims or rope_dims > head_dim or rope_dims % 2:
        raise GGUFError(f"{key('rope.dimension_count')} is {rope_dims} for a head of {head_dim}")
    nk = _int(reader, key("ssm.group_count"), required=True)
    nv = _int(reader, key("ssm.time_step_rank"), required=True)
    dk = _int(reader, key("ssm.state_size"), required=True)
    inner = _int(reader, key("ssm.inner_size"), required=True)
    conv = _int(reader, key("ssm.conv_kernel"), required=True)
    if not (nk and nv and dk and inner and conv) or nv % nk or inner % nv:
        raise GGUFError(f"linear attention sizes do not fit: ssm.group_count {nk}, ssm.time_step_rank {nv}, "
                        f"ssm.state_size {dk}, ssm.inner_size {inner}, ssm.conv_kernel {conv} (the value heads "
                        "must be a multiple of the key heads and divide inner_size)")
    embed = _embedding(own)
    _check_vocab_size(reader, arch, embed[0])
    interval = _full_attention_interval(reader, arch, layers)
    moe = any(n.endswith(".ffn_gate_inp.weight") for n in own)
    config: dict[str, Any] = {
        "model_type": _MODEL_TYPE[arch], "architectures": [_ARCH_CLASS[arch]],
        "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "intermediate_size": _int(reader, key("feed_forward_length"), 0, required=not moe),
        "vocab_size": embed[0], "max_position_embeddings": _int(reader, key("context_length"), 4096),
        "rms_norm_eps": _float(reader, key("attention.layer_norm_rms_epsilon"), 1e-6),
        "rope_theta": _float(reader, key("rope.freq_base"), 10000.0),
        "partial_rotary_factor": rope_dims / head_dim,
        "tie_word_embeddings": "output.weight" not in own,
        "full_attention_interval": interval,
        "linear_num_key_heads": nk, "linear_num_value_heads": nv, "linear_key_head_dim": dk,
        "linear_value_head_dim": inner // nv, "linear_conv_kernel_dim": conv,
    }
    rope_scaling = _rope_scaling(reader, arch, head_dim, config["rope_theta"])
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    if moe:
        config.update(_moe_config(reader, arch, config, own))
        if arch == "qwen35moe" and config["mlp_only_layers"]:  # mlx-lm's qwen3_5_moe: a router in every layer
            raise GGUFError(f"blocks {config['mlp_only_layers']} have no router (ffn_gate_inp): every qwen35moe "
                            "block is a mixture of experts")
        if not config["intermediate_size"]:
            config["intermediate_size"] = config["moe_intermediate_size"]
    elif arch != "qwen35":
        raise GGUFError(f"no block has a router (ffn_gate_inp): a {arch} model is a mixture of experts")
    _check_gated_delta_tensors(config, own)
    for name in ("bos_token_id", "eos_token_id"):
        token = scalar(reader, f"tokenizer.ggml.{name}")
        if isinstance(token, int) and not isinstance(token, bool):
            config[name] = token
    return config


def _check_gated_delta_tensors(config: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]]) -> None:
    """The sizes must describe the tensors: blocks, the first linear and attention layers."""
    _check_against_tensors(config, shapes, attention=False)
    layers, hidden, interval = config["num_hidden_layers"], config["hidden_size"], config["full_attention_interval"]
    nk, nv = config["linear_num_key_heads"], config["linear_num_value_heads"]
    dk, dv, conv = config["linear_key_head_dim"], config["linear_value_head_dim"], config["linear_conv_kernel_dim"]
    expected: dict[str, tuple[int, ...]] = {}
    linear = next((i for i in range(layers) if (i + 1) % interval), None)
    if linear is not None:
        b = f"blk.{linear}."
        expected[b + "ssm_conv1d.weight"] = (2 * nk * dk + nv * dv, conv)
        expected[b + "ssm_out.weight"] = (hidden, nv * dv)
        expected[b + "ssm_a"] = (nv,)
        if b + "ssm_in.weight" not in shapes:  # the legacy qwen3next projection has its own layout
            expected[b + "attn_qkv.weight"] = (2 * nk * dk + nv * dv, hidden)
            expected[b + "attn_gate.weight"] = (nv * dv, hidden)
    attn = next((i for i in range(layers) if (i + 1) % interval == 0), None)
    if attn is not None:
        head_dim = config["head_dim"]
        expected[f"blk.{attn}.attn_q.weight"] = (2 * config["num_attention_heads"] * head_dim, hidden)
        expected[f"blk.{attn}.attn_k.weight"] = (config["num_key_value_heads"] * head_dim, hidden)
    for name, shape in expected.items():
        if shapes.get(name) != shape:
            raise GGUFError(f"tensor {name} has shape {shapes.get(name)}, but the metadata implies {shape}")


def _per_layer(reader: GGUFReader, key: str, layers: int, default: int | None = None) -> list[int]:
    """An integer key that may be one value or one per layer -> one per layer."""
    value = metadata(reader, key, default)
    values = value if isinstance(value, list) else [value] * layers
    if len(values) != layers or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in values):
        raise GGUFError(f"{key} must be a non-negative integer or one per layer ({layers}), got {value!r}")
    return [int(v) for v in values]


def _gemma4_config(reader: GGUFReader, shapes: Mapping[str, tuple[int, ...]], hidden: int,
                   heads: int) -> dict[str, Any]:
    """Gemma 4 as llama.cpp's converter writes it: `key_length` is the full-attention head size and
    `key_length_swa` the sliding one; `head_count_kv` and `feed_forward_length` may be per layer
    (the full layers' kv heads, the double-wide MLP of the shared-KV tail); the sliding pattern is a
    per-layer list; the full layers' "proportional" RoPE is the `rope_freqs` tensor (1 for rotated
    pairs, 1e30 for fixed ones); norms are stored as they are (no 1 + w)."""
    def key(name: str) -> str:
        return f"gemma4.{name}"

    layers = _int(reader, key("block_count"), required=True)
    sliding, _ = _sliding_layers(reader, key("attention.sliding_window_pattern"), layers, 5)
    full_head = _int(reader, key("attention.key_length"), hidden // heads) or hidden // heads
    swa_head = _int(reader, key("attention.key_length_swa"), full_head) or full_head
    kv = _per_layer(reader, key("attention.head_count_kv"), layers, heads)
    kv_swa = {kv[i] for i in range(layers) if sliding[i]} or {kv[0]}
    kv_full = {kv[i] for i in range(layers) if not sliding[i]} or kv_swa
    if len(kv_swa) != 1 or len(kv_full) != 1:
        raise GGUFError(f"{key('attention.head_count_kv')} varies within a layer type: {kv}")
    ff = _per_layer(reader, key("feed_forward_length"), layers)
    shared = _int(reader, key("attention.shared_kv_layers"), 0)
    if shared >= layers:
        raise GGUFError(f"{key('attention.shared_kv_layers')} is {shared} of {layers} layers")
    first_shared = layers - shared
    wide = any(ff[i] == 2 * ff[0] for i in range(first_shared, layers)) and ff[0] > 0
    if any(v != ff[0] * (2 if wide and i >= first_shared else 1) for i, v in enumerate(ff)):
        raise GGUFError(f"{key('feed_forward_length')} {ff} is not one width (doubled in the shared-KV tail)")
    embed = _embedding(shapes)
    _check_vocab_size(reader, "gemma4", embed[0])
    full_theta = _float(reader, key("rope.freq_base"), 1000000.0)
    swa_rot = _int(reader, key("rope.dimension_count_swa"), swa_head)
    rope = {"full_attention": {"rope_type": "proportional", "rope_theta": full_theta,
                               "partial_rotary_factor": _gemma4_rotated(reader, full_head)},
            "sliding_attention": {"rope_type": "default",
                                  "rope_theta": _float(reader, key("rope.freq_base_swa"), 10000.0),
                                  "partial_rotary_factor": swa_rot / swa_head}}
    per_layer = _int(reader, key("embedding_length_per_layer_input"), 0)
    full_layers = [i for i in range(first_shared) if not sliding[i]]
    config: dict[str, Any] = {
        "model_type": "gemma4_text", "architectures": [_ARCH_CLASS["gemma4"]],
        "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_swa.pop(), "head_dim": swa_head, "global_head_dim": full_head,
        "intermediate_size": ff[0], "use_double_wide_mlp": wide, "num_kv_shared_layers": shared,
        "vocab_size": embed[0], "max_position_embeddings": _int(reader, key("context_length"), 131072),
        "rms_norm_eps": _float(reader, key("attention.layer_norm_rms_epsilon"), 1e-6),
        "sliding_window": _int(reader, key("attention.sliding_window"), 512),
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "rope_parameters": rope, "final_logit_softcapping": _float(reader, key("final_logit_softcapping")),
        "hidden_size_per_layer_input": per_layer,
        "vocab_size_per_layer_input": (shapes.get("per_layer_token_embd.weight") or embed)[0],
        # K = V on full layers: they have no value projection of their own.
        "attention_k_eq_v": bool(full_layers) and f"blk.{full_layers[0]}.attn_v.weight" not in shapes,
        "num_global_key_value_heads": kv_full.pop(),
        "tie_word_embeddings": "output.weight" not in shapes,
        "enable_moe_block": any(n.endswith(".ffn_gate_inp.weight") for n in shapes),
    }
    if config["enable_moe_block"]:
        down = next((shapes[n] for n in shapes if n.endswith(".ffn_down_exps.weight")), None)
        config.update({"num_experts": _int(reader, key("expert_count"), required=True),
                       "top_k_experts": _int(reader, key("expert_used_count"), required=True),
                       "moe_intermediate_size": _int(reader, key("expert_feed_forward_length"),
                                                     down[-1] if down else None, required=True)})
    _check_against_tensors(config, shapes, attention=False)  # the per-layer sizes meet strict loading
    for name in ("bos_token_id", "eos_token_id"):
        token = scalar(reader, f"tokenizer.ggml.{name}")
        if isinstance(token, int) and not isinstance(token, bool):
            config[name] = token
    return config


def _gemma4_rotated(reader: GGUFReader, head_dim: int) -> float:
    """The share of the full layers' head that rotates, from the `rope_freqs` factors (1.0 rotated,
    1e30 fixed: llama.cpp's encoding of the "proportional" RoPE)."""
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is None:
        return 1.0
    f = np.asarray(freqs.data, dtype=np.float64).reshape(-1)
    rotated = int(np.sum(f == 1.0))
    if f.size != head_dim // 2 or rotated + int(np.sum(f >= 1e29)) != f.size or np.any(f[:rotated] != 1.0):
        raise GGUFError(f"rope_freqs.weight is not Gemma 4's proportional RoPE ({f.size} factors for a head of "
                        f"{head_dim}: 1.0 for the rotated pairs first, then 1e30)")
    return 2 * rotated / head_dim


__all__ = ["GGUFError", "ARCHITECTURES", "GATED_DELTA", "model_layers", "metadata", "scalar", "architecture",
           "model_type_of", "gguf_config", "llama3_rope_scaling"]

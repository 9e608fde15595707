"""Tiny random model directories, for smoke tests without downloads.

`write_tiny_model(path, arch)` writes what a Hugging Face checkpoint of that architecture holds:
`config.json`, `generation_config.json`, `tokenizer.json` (a byte-level BPE trained here on a short
built-in text), `tokenizer_config.json` (with the family's chat template), `special_tokens_map.json`
and `model.safetensors` with seeded random weights under the checkpoint's own names, optionally in
mlx-lm's quantized layout. The result loads in mlx-lm and transformers' `AutoTokenizer`.

Weights are stored as float32 or float16. bfloat16 cannot be written with `safetensors.numpy`
(numpy has no bfloat16); convert a float32 tiny model if you need it.

CLI: `python -m pymlxc.testing ARCH PATH [--quantize-bits N] [--seed S] [--dtype float16]`.
"""
from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "gemma3", "qwen2_moe", "qwen3_moe",
                 "gemma4_text", "gemma4", "qwen3_next", "qwen3_5", "qwen3_5_moe")
QUANTIZE_BITS = (2, 3, 4, 6, 8)
DTYPES = ("float32", "float16")
LLAMA3_ROPE_SCALING: dict[str, Any] = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

# Training text for the tokenizer: plain English with some non-ASCII, so that byte tokens which
# split multi-byte UTF-8 characters exist (streaming detokenizers must cope with them).
CORPUS = """\
The tiny model reads a short story. Once upon a time there was a small town by the river, and in
that town lived a baker who woke before the sun every morning. She baked bread, cakes and little
pastries, and the whole street smelled of butter and warm sugar. Children walked to school past
her window and waved; old men sat on the bench outside and talked about the weather, the price of
flour and the football results. In the evening the lights came on one by one, the river turned
dark and quiet, and the baker counted the coins in her drawer before she locked the door.
Numbers matter too: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024 3.14159, and so do symbols like + - * / =
( ) [ ] { } < > # @ & % $ ! ? ; : ' " _ | ~ ^ and the backslash \\.
A programmer writes: def add(a, b): return a + b  # adds two numbers
for i in range(10): print(i)   if x > 0 and y < 0: pass   while True: break
Some words from elsewhere: héllo wörld, café, naïve, résumé, Straße, smörgåsbord, fiancée.
你好，世界。今天天气很好。日本語のテキストも少し。한국어 문장도 있습니다.
Привет, мир! Καλημέρα κόσμε. مرحبا بالعالم. שלום עולם.
Emoji appear in chat: 🙂 😀 🎉 👍 🚀 ❤️ and flags like 🇫🇷.
The question is simple: what is the capital of France? The answer is Paris. What is two plus
two? It is four. Please write a haiku about the sea. Waves fold into foam; the gull laughs over
the salt; evening takes the shore.
"""


@dataclass(frozen=True)
class _TokenFamily:
    """What a model family's tokenizer looks like: its special tokens, flags and chat template."""

    specials: tuple[str, ...]  # special added tokens, given the first ids in this order
    bos: str | None
    eos: str  # tokenizer_config's eos_token
    pad: str | None
    unk: str | None
    config_eos: tuple[str, ...]  # config.json / generation_config.json eos ids
    post_bos: bool  # tokenizer.json's post-processor prepends bos
    add_bos_token: bool | None  # written to tokenizer_config.json when not None
    chat_template: str
    plain_added: tuple[str, ...] = ()  # added tokens that are not special


_LLAMA3_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- for message in messages %}\n"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
)
_MISTRAL_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- for message in messages %}\n"
    "{%- if message['role'] == 'system' %}\n"
    "{{- message['content'] + '\\n\\n' }}\n"
    "{%- elif message['role'] == 'user' %}\n"
    "{{- '[INST] ' + message['content'] + ' [/INST]' }}\n"
    "{%- elif message['role'] == 'assistant' %}\n"
    "{{- message['content'] + eos_token }}\n"
    "{%- else %}\n"
    "{{- raise_exception('Only system, user and assistant roles are supported!') }}\n"
    "{%- endif %}\n"
    "{%- endfor %}\n"
)
_CHATML_TEMPLATE = (
    "{%- for message in messages %}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- '<|im_start|>assistant\\n' }}\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}\n"
    "{{- '<think>\\n\\n</think>\\n\\n' }}\n"
    "{%- endif %}\n"
    "{%- endif %}\n"
)
# Qwen 3.5's generation prompt opens the thinking block, or writes it empty when thinking is off.
_QWEN35_TEMPLATE = (
    "{%- for message in messages %}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- '<|im_start|>assistant\\n' }}\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}\n"
    "{{- '<think>\\n\\n</think>\\n\\n' }}\n"
    "{%- else %}\n"
    "{{- '<think>\\n' }}\n"
    "{%- endif %}\n"
    "{%- endif %}\n"
)
_GEMMA_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}\n"
    "{%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    "{%- set first_user_prefix = '' -%}\n"
    "{%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}\n"
    "{%- endif -%}\n"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}\n"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}\n"
    "{{- message['content'] | trim }}\n"
    "{{- '<end_of_turn>\\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "{{ '<start_of_turn>model\\n' }}\n"
    "{%- endif -%}\n"
)

_LLAMA3 = _TokenFamily(
    specials=("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
    bos="<|begin_of_text|>", eos="<|eot_id|>", pad=None, unk=None,
    config_eos=("<|end_of_text|>", "<|eot_id|>"), post_bos=True, add_bos_token=None, chat_template=_LLAMA3_TEMPLATE,
)
_MISTRAL = _TokenFamily(
    specials=("<unk>", "<s>", "</s>", "[INST]", "[/INST]"),
    bos="<s>", eos="</s>", pad=None, unk="<unk>",
    config_eos=("</s>",), post_bos=True, add_bos_token=True, chat_template=_MISTRAL_TEMPLATE,
)
_QWEN = _TokenFamily(
    specials=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
    bos=None, eos="<|im_end|>", pad="<|endoftext|>", unk=None,
    config_eos=("<|im_end|>", "<|endoftext|>"), post_bos=False, add_bos_token=None, chat_template=_CHATML_TEMPLATE,
)
_QWEN3 = replace(_QWEN, plain_added=("<think>", "</think>"))
_QWEN35 = replace(_QWEN3, chat_template=_QWEN35_TEMPLATE)
_GEMMA = _TokenFamily(
    specials=("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"),
    bos="<bos>", eos="<eos>", pad="<pad>", unk="<unk>",
    config_eos=("<eos>", "<end_of_turn>"), post_bos=True, add_bos_token=True, chat_template=_GEMMA_TEMPLATE,
)
_FAMILIES: dict[str, _TokenFamily] = {
    "llama": _LLAMA3, "mistral": _MISTRAL, "qwen2": _QWEN, "qwen3": _QWEN3,
    "gemma2": _GEMMA, "gemma3_text": _GEMMA, "gemma3": _GEMMA,
    "qwen2_moe": _QWEN, "qwen3_moe": _QWEN3, "gemma4_text": _GEMMA, "gemma4": _GEMMA,
    "qwen3_next": _QWEN3, "qwen3_5": _QWEN35, "qwen3_5_moe": _QWEN35,
}


# -- quantization ---------------------------------------------------------------------------------
def quantize_affine(w: np.ndarray, group_size: int = 64, bits: int = 4) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """MLX's affine quantization in numpy: returns (packed uint32 weight, scales, biases).

    Per group of `group_size` along the last axis, w ≈ scale * q + bias with q in [0, 2^bits).
    Like MLX, the scale is nudged so that the endpoint of larger magnitude is hit exactly (which
    keeps 0 exact when it is the group's minimum or maximum), and the q values are packed as one
    little-endian bit stream per row, `bits` bits each, into uint32 words.
    """
    if bits not in QUANTIZE_BITS:
        raise ValueError(f"bits must be one of {QUANTIZE_BITS}, got {bits}")
    if w.ndim < 2 or w.shape[-1] % group_size:
        raise ValueError(f"last axis {w.shape[-1]} of shape {w.shape} is not a multiple of group_size {group_size}")
    groups = w.astype(np.float32).reshape(*w.shape[:-1], -1, group_size)
    w_min = groups.min(axis=-1, keepdims=True)
    w_max = groups.max(axis=-1, keepdims=True)
    levels = np.float32(2**bits - 1)
    scales = np.maximum((w_max - w_min) / levels, np.float32(1e-7))
    min_is_edge = np.abs(w_min) > np.abs(w_max)
    scales = np.where(min_is_edge, scales, -scales)
    edge = np.where(min_is_edge, w_min, w_max)
    q0 = np.rint(edge / scales)
    with np.errstate(divide="ignore", invalid="ignore"):
        scales = np.where(q0 != 0, edge / q0, scales).astype(np.float32)
    biases = np.where(q0 == 0, np.float32(0), edge).astype(np.float32)
    q = np.clip(np.rint((groups - biases) / scales), 0, levels).astype(np.uint8)
    q = q.reshape(*w.shape[:-1], w.shape[-1])
    # Little-endian bit stream: value j takes bits [j*bits, (j+1)*bits) of its row.
    bit_planes = (q[..., None] >> np.arange(bits, dtype=np.uint8)) & 1
    stream = bit_planes.reshape(*w.shape[:-1], w.shape[-1] * bits)
    packed = np.packbits(stream, axis=-1, bitorder="little").view("<u4").astype(np.uint32)
    return packed, scales[..., 0].astype(w.dtype), biases[..., 0].astype(w.dtype)


# -- tokenizer ------------------------------------------------------------------------------------
def build_tokenizer(arch: str, vocab_size: int) -> Tokenizer:
    """A byte-level BPE with the family's special tokens, exactly `vocab_size` ids in all."""
    family = _family(arch)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    minimum = 256 + len(family.specials) + len(family.plain_added)
    if vocab_size < minimum:
        raise ValueError(f"vocab_size must be at least {minimum} for {arch} (256 bytes + its added tokens)")
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(family.plain_added),
        special_tokens=list(family.specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer)
    if family.plain_added:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in family.plain_added])
    # The built-in text runs out of merges near 900 ids; reserved specials fill the rest (as in
    # Llama 3's and Gemma's vocabularies), so the tokenizer size always equals the config's.
    shortfall = vocab_size - tok.get_vocab_size()
    tok.add_special_tokens([f"<reserved_{i}>" for i in range(shortfall)])
    if family.post_bos:
        bos = family.bos
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, tok.token_to_id(bos))]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


# -- config ---------------------------------------------------------------------------------------
def _family(arch: str) -> _TokenFamily:
    if arch not in _FAMILIES:
        raise ValueError(f"unknown architecture {arch!r}; supported: {', '.join(ARCHITECTURES)}")
    return _FAMILIES[arch]


def _text_config(arch: str, *, vocab_size: int, hidden_size: int, num_layers: int, num_heads: int,
                 num_kv_heads: int, intermediate_size: int, tie: bool, ids: Mapping[str, Any],
                 rope_scaling: Mapping[str, Any] | None) -> dict[str, Any]:
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError("hidden_size must divide by num_heads, and num_heads by num_kv_heads")
    head_dim = hidden_size // num_heads
    model_type = {"gemma3": "gemma3_text", "gemma4": "gemma4_text"}.get(arch, arch)
    config: dict[str, Any] = {
        "model_type": model_type,
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "intermediate_size": intermediate_size,
        "vocab_size": vocab_size,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": tie,
        "attention_bias": arch in ("qwen2", "qwen2_moe"),
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        **ids,
    }
    if arch in ("llama", "mistral"):
        config.update(rms_norm_eps=1e-5, rope_theta=500000.0 if arch == "llama" else 1000000.0,
                      hidden_act="silu", mlp_bias=False, rope_scaling=dict(rope_scaling) if rope_scaling else None)
        config["architectures"] = ["LlamaForCausalLM" if arch == "llama" else "MistralForCausalLM"]
        if arch == "mistral":
            config["sliding_window"] = None
    elif arch in ("qwen2", "qwen3"):
        config.update(rms_norm_eps=1e-6, rope_theta=1000000.0, hidden_act="silu", rope_scaling=rope_scaling,
                      use_sliding_window=False, sliding_window=None, max_window_layers=num_layers)
        config["architectures"] = ["Qwen2ForCausalLM" if arch == "qwen2" else "Qwen3ForCausalLM"]
    elif arch in _MOE_ARCHS:
        config.update(_moe_config(arch, num_layers=num_layers))
    elif arch in _NEXT_ARCHS:
        config.update(_next_config(arch, num_layers=num_layers))
    elif arch in ("gemma4_text", "gemma4"):
        config.update(_gemma4_config(arch, num_layers=num_layers, head_dim=head_dim, vocab_size=vocab_size))
    elif arch == "gemma2":
        config.update(rms_norm_eps=1e-6, rope_theta=10000.0, hidden_act="gelu_pytorch_tanh",
                      hidden_activation="gelu_pytorch_tanh", attn_logit_softcapping=50.0,
                      final_logit_softcapping=30.0, query_pre_attn_scalar=head_dim,
                      sliding_window=4096, cache_implementation="hybrid", architectures=["Gemma2ForCausalLM"])
    else:  # gemma3_text and gemma3's text part
        pattern = min(2, num_layers)  # tiny: alternate sliding and global so both kinds are exercised
        config.update(rms_norm_eps=1e-6, rope_theta=1000000.0, rope_local_base_freq=10000.0,
                      hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=head_dim,
                      sliding_window=16, sliding_window_pattern=pattern, rope_scaling=rope_scaling,
                      layer_types=["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                                   for i in range(num_layers)],
                      attn_logit_softcapping=None, final_logit_softcapping=None, cache_implementation="hybrid",
                      architectures=["Gemma3ForCausalLM"])
    return config


# -- weights --------------------------------------------------------------------------------------
def _weights(config: Mapping[str, Any], arch: str, rng: np.random.Generator, dtype: np.dtype) -> dict[str, np.ndarray]:
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim, vocab = config["head_dim"], config["vocab_size"]
    q_out, kv_out = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    gemma = arch.startswith("gemma")

    def linear(out_dim: int, in_dim: int) -> np.ndarray:
        # std 1/sqrt(fan_in) keeps activations O(1), so logits are finite but not all alike.
        return rng.normal(0.0, in_dim**-0.5, size=(out_dim, in_dim))

    def norm(dim: int) -> np.ndarray:
        # Gemma scales by (1 + w): near 0 there means near 1 elsewhere.
        return rng.normal(0.0 if gemma else 1.0, 0.05, size=(dim,))

    w: dict[str, np.ndarray] = {"model.embed_tokens.weight": rng.normal(0.0, hidden**-0.5, size=(vocab, hidden))}
    if arch in ("gemma4_text", "gemma4"):
        return _gemma4_weights(config, arch, w, linear, rng, dtype)
    if arch in _NEXT_ARCHS:
        return _next_weights(config, arch, w, linear, rng, dtype)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = linear(q_out, hidden)
        w[p + "self_attn.k_proj.weight"] = linear(kv_out, hidden)
        w[p + "self_attn.v_proj.weight"] = linear(kv_out, hidden)
        w[p + "self_attn.o_proj.weight"] = linear(hidden, q_out)
        if arch == "qwen2":
            for name, dim in (("q", q_out), ("k", kv_out), ("v", kv_out)):
                w[p + f"self_attn.{name}_proj.bias"] = rng.normal(0.0, 0.02, size=(dim,))
        if arch == "qwen2_moe":
            for name, dim in (("q", q_out), ("k", kv_out), ("v", kv_out)):
                w[p + f"self_attn.{name}_proj.bias"] = rng.normal(0.0, 0.02, size=(dim,))
        if arch in ("qwen3", "gemma3_text", "gemma3", "qwen3_moe"):
            w[p + "self_attn.q_norm.weight"] = norm(head_dim)
            w[p + "self_attn.k_norm.weight"] = norm(head_dim)
        if arch in _MOE_ARCHS and _is_moe_layer(config, i):
            w.update(_moe_weights(config, p, linear))
        else:
            w[p + "mlp.gate_proj.weight"] = linear(inter, hidden)
            w[p + "mlp.up_proj.weight"] = linear(inter, hidden)
            w[p + "mlp.down_proj.weight"] = linear(hidden, inter)
        w[p + "input_layernorm.weight"] = norm(hidden)
        w[p + "post_attention_layernorm.weight"] = norm(hidden)
        if gemma:
            w[p + "pre_feedforward_layernorm.weight"] = norm(hidden)
            w[p + "post_feedforward_layernorm.weight"] = norm(hidden)
    w["model.norm.weight"] = norm(hidden)
    if not config["tie_word_embeddings"]:
        w["lm_head.weight"] = linear(vocab, hidden)
    return {_hf_name(arch, k): v.astype(dtype) for k, v in w.items()}


def _quantize_weights(weights: dict[str, np.ndarray], group_size: int, bits: int) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for name, value in weights.items():
        quantizable = name.endswith(("_proj.weight", "embed_tokens.weight", "lm_head.weight"))
        if quantizable and value.ndim == 2 and value.shape[-1] % group_size == 0:
            stem = name[: -len(".weight")]
            out[name], out[stem + ".scales"], out[stem + ".biases"] = quantize_affine(value, group_size, bits)
        else:
            out[name] = value
    return out


# -- mixture of experts and Gemma 4 -----------------------------------------------------------------
_MOE_ARCHS = ("qwen2_moe", "qwen3_moe")
_SWITCH_ARCHS = ("qwen2_moe", "qwen3_moe", "gemma4_text", "gemma4")  # quantized: mlx-lm's stacked experts
_UNTIED = ("llama", "mistral", "qwen2_moe", "qwen3_moe", "qwen3_next", "qwen3_5_moe")  # mlx-lm's qwen2_moe always has an lm_head
_ROUTER_QUANT = {"group_size": 64, "bits": 8}  # mlx-lm's quant_predicate for the routers


def _moe_config(arch: str, *, num_layers: int) -> dict[str, Any]:
    """4 experts, top 2. Qwen 3 MoE renormalises the top-k and (with 2+ layers) keeps its last
    layer dense through `mlp_only_layers`; Qwen 2 MoE adds the gated shared expert."""
    config: dict[str, Any] = {
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "hidden_act": "silu", "rope_scaling": None,
        "use_sliding_window": False, "sliding_window": None, "max_window_layers": num_layers,
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "decoder_sparse_step": 1,
        "norm_topk_prob": arch == "qwen3_moe", "output_router_logits": False, "router_aux_loss_coef": 0.001,
        "mlp_only_layers": [num_layers - 1] if arch == "qwen3_moe" and num_layers > 1 else [],
        "architectures": ["Qwen3MoeForCausalLM" if arch == "qwen3_moe" else "Qwen2MoeForCausalLM"],
    }
    if arch == "qwen2_moe":
        config["shared_expert_intermediate_size"] = 64
    return config


def _is_moe_layer(config: Mapping[str, Any], i: int) -> bool:
    return i not in config["mlp_only_layers"] and (i + 1) % config["decoder_sparse_step"] == 0


def _gemma4_config(arch: str, *, num_layers: int, head_dim: int, vocab_size: int) -> dict[str, Any]:
    """Sliding and full layers alternate (full ones with twice the head size and partial
    "proportional" RoPE). gemma4_text is shaped like the small Gemma 4 (per-layer inputs, the last
    half of the layers sharing earlier k/v with double-wide MLPs), gemma4 like the 26B MoE
    (experts beside the MLP, K = V on full layers). `extra_config` switches features on or off."""
    small = arch == "gemma4_text"
    return {
        "rms_norm_eps": 1e-6, "hidden_activation": "gelu_pytorch_tanh", "global_head_dim": 2 * head_dim,
        "sliding_window": 16, "final_logit_softcapping": 30.0,
        "layer_types": ["full_attention" if i % 2 else "sliding_attention" for i in range(num_layers)],
        "rope_parameters": {
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        "hidden_size_per_layer_input": 16 if small else 0, "vocab_size_per_layer_input": vocab_size,
        "num_kv_shared_layers": num_layers // 2 if small and num_layers >= 4 else 0, "use_double_wide_mlp": True,
        "attention_k_eq_v": not small, "num_global_key_value_heads": None if small else 1,
        "enable_moe_block": not small, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 32,
        "architectures": ["Gemma4ForCausalLM"],
    }


def _moe_weights(config: Mapping[str, Any], p: str, linear: Any) -> dict[str, np.ndarray]:
    """HF's layout: a router `mlp.gate` and each expert apart (`mlp.experts.E.up_proj`)."""
    hidden, inter, n = config["hidden_size"], config["moe_intermediate_size"], config["num_experts"]
    w = {p + "mlp.gate.weight": linear(n, hidden)}
    for e in range(n):
        w[p + f"mlp.experts.{e}.gate_proj.weight"] = linear(inter, hidden)
        w[p + f"mlp.experts.{e}.up_proj.weight"] = linear(inter, hidden)
        w[p + f"mlp.experts.{e}.down_proj.weight"] = linear(hidden, inter)
    if "shared_expert_intermediate_size" in config:
        shared = config["shared_expert_intermediate_size"]
        w[p + "mlp.shared_expert.gate_proj.weight"] = linear(shared, hidden)
        w[p + "mlp.shared_expert.up_proj.weight"] = linear(shared, hidden)
        w[p + "mlp.shared_expert.down_proj.weight"] = linear(hidden, shared)
        w[p + "mlp.shared_expert_gate.weight"] = linear(1, hidden)
    return w


def _gemma4_weights(config: Mapping[str, Any], arch: str, w: dict[str, np.ndarray], linear: Any,
                    rng: np.random.Generator, dtype: np.dtype) -> dict[str, np.ndarray]:
    """HF's Gemma 4 tensors (`experts.gate_up_proj` [E, 2 * moe_inter, hidden] fused); the
    multimodal checkpoint gets two vision tensors that loading must drop."""
    hidden, inter, n_layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    ple, first_shared = config["hidden_size_per_layer_input"], n_layers - config["num_kv_shared_layers"]

    def norm(dim: int) -> np.ndarray:  # Gemma 4's RMSNorms scale by w itself
        return rng.normal(1.0, 0.05, size=(dim,))

    for i, kind in enumerate(config["layer_types"]):
        p = f"model.layers.{i}."
        full = kind == "full_attention"
        hd = config["global_head_dim"] if full else config["head_dim"]
        k_eq_v = config["attention_k_eq_v"] and full
        kvh = config["num_global_key_value_heads"] or kv_heads if k_eq_v else kv_heads
        w[p + "self_attn.q_proj.weight"] = linear(heads * hd, hidden)
        w[p + "self_attn.o_proj.weight"] = linear(hidden, heads * hd)
        # The attention scale is 1: q/k norm weights near hd^-1/4 keep the scores O(1), as trained ones do.
        w[p + "self_attn.q_norm.weight"] = norm(hd) * hd**-0.25
        if i < first_shared:
            w[p + "self_attn.k_proj.weight"] = linear(kvh * hd, hidden)
            if not k_eq_v:
                w[p + "self_attn.v_proj.weight"] = linear(kvh * hd, hidden)
            w[p + "self_attn.k_norm.weight"] = norm(hd) * hd**-0.25
        width = inter * (2 if config["use_double_wide_mlp"] and i >= first_shared > 0 else 1)
        w[p + "mlp.gate_proj.weight"] = linear(width, hidden)
        w[p + "mlp.up_proj.weight"] = linear(width, hidden)
        w[p + "mlp.down_proj.weight"] = linear(hidden, width)
        for name in ("input", "post_attention", "pre_feedforward", "post_feedforward"):
            w[p + f"{name}_layernorm.weight"] = norm(hidden)
        w[p + "layer_scalar"] = rng.uniform(0.7, 1.3, size=(1,))
        if config["enable_moe_block"]:
            n, moe_inter = config["num_experts"], config["moe_intermediate_size"]
            w[p + "router.proj.weight"] = linear(n, hidden)
            w[p + "router.scale"] = norm(hidden)
            w[p + "router.per_expert_scale"] = rng.uniform(0.5, 1.5, size=(n,))
            w[p + "experts.gate_up_proj"] = np.stack([linear(2 * moe_inter, hidden) for _ in range(n)])
            w[p + "experts.down_proj"] = np.stack([linear(hidden, moe_inter) for _ in range(n)])
            for name in ("post_feedforward_layernorm_1", "post_feedforward_layernorm_2", "pre_feedforward_layernorm_2"):
                w[p + f"{name}.weight"] = norm(hidden)
        if ple:
            w[p + "per_layer_input_gate.weight"] = linear(ple, hidden)
            w[p + "per_layer_projection.weight"] = linear(hidden, ple)
            w[p + "post_per_layer_input_norm.weight"] = norm(hidden)
    if ple:
        w["model.embed_tokens_per_layer.weight"] = rng.normal(
            0.0, ple**-0.5, size=(config["vocab_size_per_layer_input"], n_layers * ple))
        w["model.per_layer_model_projection.weight"] = linear(n_layers * ple, hidden)
        w["model.per_layer_projection_norm.weight"] = norm(ple)
    w["model.norm.weight"] = norm(hidden)
    if not config["tie_word_embeddings"]:
        w["lm_head.weight"] = linear(config["vocab_size"], hidden)
    if arch == "gemma4":
        w["model.vision_tower.patch_embedder.input_proj.weight"] = linear(16, 48)
        w["model.embed_vision.embedding_projection.weight"] = linear(hidden, 16)
    return {_hf_name(arch, k): v.astype(dtype) for k, v in w.items()}


def _hf_name(arch: str, name: str) -> str:
    """Where a text-model tensor sits in the multimodal checkpoints."""
    if arch in ("qwen3_5", "qwen3_5_moe") and name.startswith("model."):
        return "model.language_model." + name[len("model."):]
    if arch == "gemma3":
        return "language_model." + name
    if arch == "gemma4" and name.startswith("model.") and not name.startswith(("model.vision", "model.embed_vision")):
        return "model.language_model." + name[len("model."):]
    return name


def _to_switch_layout(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """HF expert tensors -> mlx-lm's stacked ones (what mlx-lm writes when it quantizes)."""
    out: dict[str, np.ndarray] = {}
    experts: dict[str, dict[int, np.ndarray]] = {}
    for name, value in weights.items():
        if ".mlp.experts." in name:  # Qwen: mlp.experts.E.P.weight -> mlp.switch_mlp.P.weight
            head, rest = name.split(".mlp.experts.")
            e, proj = rest.split(".", 1)
            experts.setdefault(f"{head}.mlp.switch_mlp.{proj}", {})[int(e)] = value
        elif name.endswith(".experts.gate_up_proj"):  # Gemma 4: split the fused gate/up
            base = name[: -len(".gate_up_proj")] + ".switch_glu"
            out[base + ".gate_proj.weight"], out[base + ".up_proj.weight"] = np.split(value, 2, axis=-2)
        elif name.endswith(".experts.down_proj"):
            out[name[: -len(".down_proj")] + ".switch_glu.down_proj.weight"] = value
        else:
            out[name] = value
    for name, by_expert in experts.items():
        out[name] = np.stack([by_expert[e] for e in sorted(by_expert)])
    return out


def _quantize_switch_weights(weights: dict[str, np.ndarray], arch: str, group_size: int,
                             bits: int) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Quantize as mlx-lm does for these families: every Linear, Embedding and expert stack whose
    input size fits the group, the routers at 8 bits (recorded as per-layer overrides)."""
    out: dict[str, np.ndarray] = {}
    overrides: dict[str, Any] = {}
    for name, value in _to_switch_layout(weights).items():
        stem = name[: -len(".weight")]
        router = name.endswith((".mlp.gate.weight", ".router.proj.weight"))
        params = _ROUTER_QUANT if router else {"group_size": group_size, "bits": bits}
        tower = "vision" in name
        if (name.endswith(".weight") and value.ndim >= 2 and not tower
                and value.shape[-1] % params["group_size"] == 0):
            out[name], out[stem + ".scales"], out[stem + ".biases"] = quantize_affine(value, **params)
            if router:  # keyed by mlx-lm's module path (gemma4: language_model.model.layers...)
                key = ("language_model.model." + stem[len("model.language_model."):]
                       if stem.startswith("model.language_model.") else stem)
                overrides[key] = dict(params)
        else:
            out[name] = value
    return out, overrides


# -- Qwen3-Next and Qwen 3.5 (Gated DeltaNet) --------------------------------------------------------
_NEXT_ARCHS = ("qwen3_next", "qwen3_5", "qwen3_5_moe")


def _next_config(arch: str, *, num_layers: int) -> dict[str, Any]:
    """Linear-attention layers with full attention every second layer (`full_attention_interval`),
    2 key heads of 32 and 4 value heads of 16, a window of 4; qwen3_next and qwen3_5_moe with 4
    experts (top 2) and a shared expert, qwen3_5 dense. Qwen 3.5 nests its RoPE settings in
    `rope_parameters` (transformers 5), Qwen3-Next keeps them flat."""
    config: dict[str, Any] = {
        "rms_norm_eps": 1e-6, "hidden_act": "silu", "full_attention_interval": 2,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32,
        "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
    }
    if arch == "qwen3_next":
        config.update(rope_theta=10000.0, partial_rotary_factor=0.25, rope_scaling=None,
                      architectures=["Qwen3NextForCausalLM"])
    else:
        config["model_type"] = f"{arch}_text"
        config["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                     "mrope_section": [1, 1, 0], "mrope_interleaved": True}
    if arch != "qwen3_5":
        config.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=64, decoder_sparse_step=1, mlp_only_layers=[],
                      norm_topk_prob=True)
    return config


def _next_multimodal_config(arch: str, text: dict[str, Any], ids: Mapping[str, Any], dtype: str) -> dict[str, Any]:
    name = "Qwen3_5MoeForConditionalGeneration" if arch == "qwen3_5_moe" else "Qwen3_5ForConditionalGeneration"
    text_only = {k: v for k, v in text.items() if k != "architectures"}
    return {"architectures": [name], "model_type": arch, "text_config": text_only,
            "vision_config": {"model_type": "qwen3_5_vision", "hidden_size": 16, "depth": 1},
            "vocab_size": text["vocab_size"], "tie_word_embeddings": text["tie_word_embeddings"], "torch_dtype": dtype,
            **ids}


def _next_weights(config: Mapping[str, Any], arch: str, w: dict[str, np.ndarray], linear: Any,
                  rng: np.random.Generator, dtype: np.dtype) -> dict[str, np.ndarray]:
    """HF's tensors: RMSNorm weights as offsets from 1 (but the gated norm's), conv weights [C, 1,
    K], experts apart (qwen3_next) or fused `experts.gate_up_proj` (qwen3_5_moe); a multi-token
    prediction tensor, and for Qwen 3.5 a vision tensor, that loading must drop."""
    hidden, inter, heads = config["hidden_size"], config["intermediate_size"], config["num_attention_heads"]
    hd, kv_heads = config["head_dim"], config["num_key_value_heads"]
    nk, nv = config["linear_num_key_heads"], config["linear_num_value_heads"]
    dk, dv, width = config["linear_key_head_dim"], config["linear_value_head_dim"], config["linear_conv_kernel_dim"]
    key_dim, value_dim = nk * dk, nv * dv

    def offset_norm(dim: int) -> np.ndarray:
        return rng.normal(0.0, 0.05, size=(dim,))

    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        if (i + 1) % config["full_attention_interval"]:
            a = p + "linear_attn."
            if arch == "qwen3_next":
                w[a + "in_proj_qkvz.weight"] = linear(2 * key_dim + 2 * value_dim, hidden)
                w[a + "in_proj_ba.weight"] = linear(2 * nv, hidden)
            else:
                w[a + "in_proj_qkv.weight"] = linear(2 * key_dim + value_dim, hidden)
                w[a + "in_proj_z.weight"] = linear(value_dim, hidden)
                w[a + "in_proj_b.weight"] = linear(nv, hidden)
                w[a + "in_proj_a.weight"] = linear(nv, hidden)
            w[a + "conv1d.weight"] = rng.normal(0.0, width**-0.5, size=(2 * key_dim + value_dim, 1, width))
            w[a + "dt_bias"] = rng.normal(0.0, 0.5, size=(nv,))
            w[a + "A_log"] = np.log(rng.uniform(1.0, 16.0, size=(nv,)))
            w[a + "norm.weight"] = rng.normal(1.0, 0.05, size=(dv,))
            w[a + "out_proj.weight"] = linear(hidden, value_dim)
        else:
            w[p + "self_attn.q_proj.weight"] = linear(2 * heads * hd, hidden)
            w[p + "self_attn.k_proj.weight"] = linear(kv_heads * hd, hidden)
            w[p + "self_attn.v_proj.weight"] = linear(kv_heads * hd, hidden)
            w[p + "self_attn.o_proj.weight"] = linear(hidden, heads * hd)
            w[p + "self_attn.q_norm.weight"] = offset_norm(hd)
            w[p + "self_attn.k_norm.weight"] = offset_norm(hd)
        n = config.get("num_experts", 0)
        moe = n > 0 and (arch != "qwen3_next" or _is_moe_layer(config, i))
        if moe:
            moe_inter, shared = config["moe_intermediate_size"], config["shared_expert_intermediate_size"]
            w[p + "mlp.gate.weight"] = linear(n, hidden)
            if arch == "qwen3_next":
                for e in range(n):
                    w[p + f"mlp.experts.{e}.gate_proj.weight"] = linear(moe_inter, hidden)
                    w[p + f"mlp.experts.{e}.up_proj.weight"] = linear(moe_inter, hidden)
                    w[p + f"mlp.experts.{e}.down_proj.weight"] = linear(hidden, moe_inter)
            else:
                w[p + "mlp.experts.gate_up_proj"] = np.stack([linear(2 * moe_inter, hidden) for _ in range(n)])
                w[p + "mlp.experts.down_proj"] = np.stack([linear(hidden, moe_inter) for _ in range(n)])
            w[p + "mlp.shared_expert.gate_proj.weight"] = linear(shared, hidden)
            w[p + "mlp.shared_expert.up_proj.weight"] = linear(shared, hidden)
            w[p + "mlp.shared_expert.down_proj.weight"] = linear(hidden, shared)
            w[p + "mlp.shared_expert_gate.weight"] = linear(1, hidden)
        else:
            w[p + "mlp.gate_proj.weight"] = linear(inter, hidden)
            w[p + "mlp.up_proj.weight"] = linear(inter, hidden)
            w[p + "mlp.down_proj.weight"] = linear(hidden, inter)
        w[p + "input_layernorm.weight"] = offset_norm(hidden)
        w[p + "post_attention_layernorm.weight"] = offset_norm(hidden)
    w["model.norm.weight"] = offset_norm(hidden)
    if not config["tie_word_embeddings"]:
        w["lm_head.weight"] = linear(config["vocab_size"], hidden)
    w["mtp.fc.weight"] = linear(hidden, 2 * hidden)
    out = {_hf_name(arch, k): v.astype(dtype) for k, v in w.items()}
    if arch != "qwen3_next":
        out["model.visual.patch_embed.proj.weight"] = linear(16, 48).astype(dtype)
    return out


def _next_to_mlx_layout(weights: dict[str, np.ndarray], arch: str) -> dict[str, np.ndarray]:
    """What mlx-lm's conversion writes: experts stacked, conv [C, K, 1], norms + 1, no MTP or
    vision tensors, Qwen 3.5's text model under `language_model.`."""
    unfused: dict[str, np.ndarray] = {}
    for name, value in weights.items():
        if name.endswith(".experts.gate_up_proj"):
            base = name[: -len(".experts.gate_up_proj")] + ".switch_mlp"
            unfused[base + ".gate_proj.weight"], unfused[base + ".up_proj.weight"] = np.split(value, 2, axis=-2)
        elif name.endswith(".experts.down_proj"):
            unfused[name[: -len(".experts.down_proj")] + ".switch_mlp.down_proj.weight"] = value
        elif not name.startswith(("mtp.", "model.visual.")):
            unfused[name] = value
    out: dict[str, np.ndarray] = {}
    for name, value in _to_switch_layout(unfused).items():
        if name.endswith("conv1d.weight"):
            value = np.swapaxes(value, 1, 2)
        elif name.endswith(("layernorm.weight", "model.norm.weight", "language_model.norm.weight", "_norm.weight")):
            value = value + 1
        if name.startswith("model.language_model."):
            name = "language_model.model." + name[len("model.language_model."):]
        elif arch != "qwen3_next" and name.startswith("lm_head."):
            name = "language_model." + name
        out[name] = value
    return out


def _quantize_next_weights(weights: dict[str, np.ndarray], arch: str, group_size: int,
                           bits: int) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """mlx-lm's quantization of these families: every projection, embedding and expert stack (not
    the convolution), the routers (`mlp.gate`, `mlp.shared_expert_gate`) at 8 bits as overrides."""
    out: dict[str, np.ndarray] = {}
    overrides: dict[str, Any] = {}
    for name, value in _next_to_mlx_layout(weights, arch).items():
        stem = name[: -len(".weight")]
        router = name.endswith((".mlp.gate.weight", ".mlp.shared_expert_gate.weight"))
        params = _ROUTER_QUANT if router else {"group_size": group_size, "bits": bits}
        if (name.endswith(".weight") and value.ndim >= 2 and "conv1d" not in name
                and value.shape[-1] % params["group_size"] == 0):
            out[name], out[stem + ".scales"], out[stem + ".biases"] = quantize_affine(value, **params)
            if router:
                overrides[stem] = dict(params)
        else:
            out[name] = value
    return out, overrides


# -- writing --------------------------------------------------------------------------------------
def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_tiny_model(
    path: str | Path,
    arch: str = "llama",
    *,
    seed: int = 0,
    dtype: str = "float32",
    quantize_bits: int | None = None,
    group_size: int = 32,
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_layers: int | None = None,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    tie_word_embeddings: bool | None = None,
    chat_template: str | None = None,
    rope_scaling: Mapping[str, Any] | None = None,
    extra_config: Mapping[str, Any] | None = None,
    mute_special_tokens: bool = True,
) -> Path:
    """Write a tiny random `arch` model directory at `path` (created if needed) and return it.

    `tie_word_embeddings` defaults to the family's usual choice (untied for llama and mistral).
    `chat_template`: None writes the family's template, "" writes none, any other string is used.
    `rope_scaling`: e.g. `LLAMA3_ROPE_SCALING`. `extra_config` is merged into the text model's
    config last (weight shapes follow the merged values, e.g. `head_dim`).
    `mute_special_tokens`: zero the output rows of the special tokens (and so, when tied, their
    embeddings). Random logits have a positive maximum, so greedy decoding then never picks EOS
    and streams run to max_tokens, which tests can count on.
    """
    family = _family(arch)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES} (bfloat16 needs a conversion step), got {dtype!r}")
    if quantize_bits is not None and quantize_bits not in QUANTIZE_BITS:
        raise ValueError(f"quantize_bits must be one of {QUANTIZE_BITS}, got {quantize_bits}")
    tie = arch not in _UNTIED if tie_word_embeddings is None else tie_word_embeddings
    num_layers = num_layers or (4 if arch in ("gemma4_text", *_NEXT_ARCHS) else 2)
    if arch == "gemma2" and not tie:
        raise ValueError("gemma2 always ties its output projection to the embeddings")
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)

    tok = build_tokenizer(arch, vocab_size)
    tok.save(str(root / "tokenizer.json"))
    token_id = tok.token_to_id
    eos_ids = [token_id(t) for t in family.config_eos]
    ids: dict[str, Any] = {
        "bos_token_id": token_id(family.bos) if family.bos else token_id(family.specials[0]),
        # Qwen's config.json names only <|im_end|>; generation_config.json lists both.
        "eos_token_id": eos_ids[0] if arch.startswith("qwen") or len(eos_ids) == 1 else eos_ids,
    }
    if family.pad:
        ids["pad_token_id"] = token_id(family.pad)

    text = _text_config(arch, vocab_size=vocab_size, hidden_size=hidden_size, num_layers=num_layers,
                        num_heads=num_heads, num_kv_heads=num_kv_heads, intermediate_size=intermediate_size,
                        tie=tie, ids=ids, rope_scaling=rope_scaling)
    text.update(extra_config or {})
    text["torch_dtype"] = dtype
    weights = _weights(text, arch, np.random.default_rng(seed), np.dtype(dtype))
    if mute_special_tokens:
        out_name = _hf_name(arch, "model.embed_tokens.weight" if tie else "lm_head.weight")
        special_ids = [i for i, added in tok.get_added_tokens_decoder().items() if added.special]
        weights[out_name][special_ids] = 0
    if arch in ("qwen3_5", "qwen3_5_moe"):
        config = _next_multimodal_config(arch, text, ids, dtype)
    elif arch in ("gemma3", "gemma4"):
        text_only = {k: v for k, v in text.items() if k != "architectures"}
        config: dict[str, Any] = {
            "architectures": [f"{arch.capitalize()}ForConditionalGeneration"], "model_type": arch,
            "text_config": text_only, "vocab_size": vocab_size, "tie_word_embeddings": tie,
            "torch_dtype": dtype, **ids,
        }
        if arch == "gemma4":
            config["vision_config"] = {"model_type": "gemma4_vision", "hidden_size": 16, "num_hidden_layers": 1}
    else:
        config = text
    if quantize_bits is not None:
        quant: dict[str, Any] = {"group_size": group_size, "bits": quantize_bits, "mode": "affine"}
        if arch in _NEXT_ARCHS:
            weights, overrides = _quantize_next_weights(weights, arch, group_size, quantize_bits)
            quant.update(overrides)
        elif arch in _SWITCH_ARCHS:
            weights, overrides = _quantize_switch_weights(weights, arch, group_size, quantize_bits)
            quant.update(overrides)
        else:
            weights = _quantize_weights(weights, group_size, quantize_bits)
        config["quantization"] = quant
        config["quantization_config"] = dict(quant)
    save_file(weights, str(root / "model.safetensors"), metadata={"format": "pt"})
    _write_json(root / "config.json", config)
    _write_json(root / "generation_config.json", {"bos_token_id": ids["bos_token_id"], "eos_token_id": eos_ids,
                                                  **({"pad_token_id": ids["pad_token_id"]} if family.pad else {})})

    named = {"bos_token": family.bos, "eos_token": family.eos, "unk_token": family.unk, "pad_token": family.pad}
    named = {k: v for k, v in named.items() if v is not None}
    tok_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": text["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
        **named,
    }
    if family.bos is None:
        tok_config["bos_token"] = None
    if family.add_bos_token is not None:
        tok_config["add_bos_token"] = family.add_bos_token
        tok_config["add_eos_token"] = False
    template = family.chat_template if chat_template is None else chat_template
    if template:
        tok_config["chat_template"] = template
    _write_json(root / "tokenizer_config.json", tok_config)
    _write_json(root / "special_tokens_map.json", named)
    return root


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pymlxc.testing", description="Write a tiny random model.")
    parser.add_argument("arch", choices=ARCHITECTURES)
    parser.add_argument("path")
    parser.add_argument("--quantize-bits", type=int, choices=QUANTIZE_BITS)
    parser.add_argument("--group-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--llama3-rope-scaling", action="store_true", help="add Llama 3.1's rope_scaling")
    args = parser.parse_args(argv)
    out = write_tiny_model(args.path, args.arch, seed=args.seed, dtype=args.dtype, quantize_bits=args.quantize_bits,
                           group_size=args.group_size,
                           rope_scaling=LLAMA3_ROPE_SCALING if args.llama3_rope_scaling else None)
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

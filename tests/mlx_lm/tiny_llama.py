"""A stand-in for `pymlxc.testing.write_tiny_model` while it is being written: a tiny random llama.

Byte-level BPE over the 256 byte symbols plus ChatML specials, HF weight names, float32 weights.
The special tokens get zero rows in `lm_head`, so greedy decoding never picks them (random logits
have a positive maximum) and greedy streams run to `max_tokens`: tests can rely on long streams.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _tokenizer() -> Tokenizer:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIALS))
    return tok


def write_tiny_llama(path: str | Path, *, seed: int = 0, hidden: int = 64, layers: int = 2) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer()
    tok.save(str(path / "tokenizer.json"))
    vocab = tok.get_vocab_size()
    eos = tok.token_to_id("<|im_end|>")
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": CHATML,
        "model_max_length": 512,
    }))
    heads, kv_heads, inter = 4, 2, 2 * hidden
    (path / "config.json").write_text(json.dumps({
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
        "eos_token_id": eos,
        "torch_dtype": "float32",
    }))
    rng = np.random.default_rng(seed)

    def w(*shape: int, scale: float = 0.2) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    head_dim = hidden // heads
    weights = {"model.embed_tokens.weight": w(vocab, hidden, scale=1.0), "model.norm.weight": np.ones(hidden, np.float32)}
    lm_head = w(vocab, hidden)
    lm_head[[tok.token_to_id(s) for s in SPECIALS]] = 0.0
    weights["lm_head.weight"] = lm_head
    for i in range(layers):
        p = f"model.layers.{i}."
        weights |= {
            p + "self_attn.q_proj.weight": w(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": w(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": w(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": w(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": w(inter, hidden),
            p + "mlp.up_proj.weight": w(inter, hidden),
            p + "mlp.down_proj.weight": w(hidden, inter),
            p + "input_layernorm.weight": np.ones(hidden, np.float32),
            p + "post_attention_layernorm.weight": np.ones(hidden, np.float32),
        }
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path

"""The tiny models' tokenizers: a byte-level BPE trained here on a short built-in text, with a
model family's special tokens and chat template; and for the real-shape models a byte-level BPE of
any vocabulary size made without training (`write_byte_tokenizer`)."""
from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

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
class TokenFamily:
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
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}\n"
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


# ChatML turns, then the generation prompt; with thinking off, an empty thinking block.
_CHATML_HEAD = (
    "{%- for message in messages %}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- '<|im_start|>assistant\\n' }}\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}\n"
    "{{- '<think>\\n\\n</think>\\n\\n' }}\n"
)
_CHATML_TEMPLATE = _CHATML_HEAD + "{%- endif %}\n{%- endif %}\n"
# Qwen 3.5's generation prompt opens the thinking block unless thinking is off.
_QWEN35_TEMPLATE = _CHATML_HEAD + "{%- else %}\n{{- '<think>\\n' }}\n{%- endif %}\n{%- endif %}\n"
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

LLAMA3 = TokenFamily(
    specials=("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
    bos="<|begin_of_text|>", eos="<|eot_id|>", pad=None, unk=None,
    config_eos=("<|end_of_text|>", "<|eot_id|>"), post_bos=True, add_bos_token=None, chat_template=_LLAMA3_TEMPLATE,
)


MISTRAL = TokenFamily(
    specials=("<unk>", "<s>", "</s>", "[INST]", "[/INST]"),
    bos="<s>", eos="</s>", pad=None, unk="<unk>",
    config_eos=("</s>",), post_bos=True, add_bos_token=True, chat_template=_MISTRAL_TEMPLATE,
)


QWEN = TokenFamily(
    specials=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
    bos=None, eos="<|im_end|>", pad="<|endoftext|>", unk=None,
    config_eos=("<|im_end|>", "<|endoftext|>"), post_bos=False, add_bos_token=None, chat_template=_CHATML_TEMPLATE,
)
QWEN3 = replace(QWEN, plain_added=("<think>", "</think>"))
QWEN35 = replace(QWEN3, chat_template=_QWEN35_TEMPLATE)
GEMMA = TokenFamily(
    specials=("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"),
    bos="<bos>", eos="<eos>", pad="<pad>", unk="<unk>",
    config_eos=("<eos>", "<end_of_turn>"), post_bos=True, add_bos_token=True, chat_template=_GEMMA_TEMPLATE,
)


def train_tokenizer(family: TokenFamily, vocab_size: int, name: str) -> Tokenizer:
    """A byte-level BPE with the family's special tokens, exactly `vocab_size` ids in all (`name`
    says whose, in errors)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    minimum = 256 + len(family.specials) + len(family.plain_added)
    if vocab_size < minimum:
        raise ValueError(f"vocab_size must be at least {minimum} for {name} (256 bytes + its added tokens)")
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
    if family.post_bos and family.bos is not None:
        bos = family.bos
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, tok.token_to_id(bos))]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def _byte_chars() -> list[str]:
    """GPT-2's byte-level alphabet: byte b -> a printable character (spaces and controls moved up)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), ord("\xff") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def write_byte_tokenizer(path: str | Path, config: dict[str, Any]) -> Path:
    """Write a byte-level BPE `tokenizer.json` (+ `tokenizer_config.json`) with exactly
    `vocab_size` ids: the config's bos/eos ids as special tokens, the 256 bytes, then every pair of
    bytes and as many byte triples as fill the rest, each made by one merge. Meaningless as a
    language, but valid for Hugging Face's tokenizers, gguf's SpecialVocab and llama.cpp."""
    root = Path(path)
    vocab_size = int(config["vocab_size"])
    eos = config.get("eos_token_id")
    specials = {int(config["bos_token_id"]): "<|begin_of_text|>"} if config.get("bos_token_id") is not None else {}
    for i, e in enumerate(eos if isinstance(eos, list) else [eos] if eos is not None else []):
        specials.setdefault(int(e), "<|end_of_text|>" if i == 0 else f"<|eot_{i}|>")
    byte = _byte_chars()

    def pieces() -> Iterator[tuple[str, str | None]]:
        yield from ((c, None) for c in byte)
        yield from ((a + b, f"{a} {b}") for a in byte for b in byte)
        yield from ((a + b + c, f"{a + b} {c}") for a in byte for b in byte for c in byte)

    vocab: dict[str, int] = {}
    merges: list[str] = []
    stream = pieces()
    for i in range(vocab_size):
        if i in specials:
            vocab[specials[i]] = i  # in the model's vocabulary too, so that the ids stay where they are
            continue
        text, merge = next(stream)
        vocab[text] = i
        if merge is not None:
            merges.append(merge)
    if len(vocab) < 256 + len(specials):
        raise ValueError(f"a vocabulary of {vocab_size} ids has no room for the 256 byte tokens")
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": True} for i, t in sorted(specials.items())]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    tokenizer = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
                 "pre_tokenizer": byte_level, "post_processor": None, "decoder": byte_level,
                 "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                           "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                           "ignore_merges": False, "vocab": vocab, "merges": merges}}
    (root / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False))
    tok_config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": True,
                                  "model_max_length": config.get("max_position_embeddings", 4096)}
    names = dict(sorted(specials.items()))
    if config.get("bos_token_id") is not None:
        tok_config["bos_token"] = names[int(config["bos_token_id"])]
    if eos is not None:
        tok_config["eos_token"] = names[int(eos[0] if isinstance(eos, list) else eos)]
    (root / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    return root


__all__ = ["CORPUS", "GEMMA", "LLAMA3", "MISTRAL", "QWEN", "QWEN3", "QWEN35", "TokenFamily", "train_tokenizer",
           "write_byte_tokenizer"]

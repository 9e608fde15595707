"""Checkpoint formats: a checkpoint -> (config, tensors under Hugging Face names), read and checked.

`safetensors.py` reads a Hugging Face / mlx-lm model directory; `gguf.py` (with `gguf_config.py`,
`gguf_tensors.py`, `gguf_quants.py` and `gguf_tokenizer.py`) a llama.cpp GGUF file, which needs the
optional `gguf` package and is imported only for GGUF files. Nothing here builds a model or chooses
a kernel (`loader.py` does): these modules import only each other, `pymlxc.core`, `pymlxc.files`
and third-party packages (tests/test_layers.py holds that).
"""

"""Random model writers for tests and benchmarks, with no downloads.

* `write_tiny_model(path, arch)` (`tiny.py`): a tiny checkpoint of any architecture in
  `ARCHITECTURES`, with a trained tokenizer and chat template; `python -m pymlxc.testing ARCH PATH`.
* `shapes.write_random_model(path, shape)`: real model shapes (`shapes.SHAPES`) with random weights,
  for the benchmarks (imports MLX's own `mlx.core`, so it is not imported here).

Each architecture is one `specs.SPECS` entry: its tokenizer family, config fields, tensors, quantized
layout and checkpoint nesting.
"""
from .quantize import QUANTIZE_BITS, quantize_affine
from .specs import SPECS, ArchSpec
from .tiny import ARCHITECTURES, DTYPES, LLAMA3_ROPE_SCALING, build_tokenizer, main, write_tiny_model
from .tokenizer import CORPUS

__all__ = ["ARCHITECTURES", "CORPUS", "DTYPES", "LLAMA3_ROPE_SCALING", "QUANTIZE_BITS", "SPECS", "ArchSpec",
           "build_tokenizer", "main", "quantize_affine", "write_tiny_model"]

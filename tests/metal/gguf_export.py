"""The GGUF writer the tests use: `pymlxc.testing_gguf` (a product module, so that the benchmarks
write GGUF files the same way)."""
from pymlxc.testing_gguf import K_QUANTS, LEGACY, encode_k, export_gguf, write_spm_gguf

__all__ = ["K_QUANTS", "LEGACY", "encode_k", "export_gguf", "write_spm_gguf"]

"""GGUF models for the native backend: check the file, read its config, map its tensors to HF names.

A GGUF file (llama.cpp's format) holds what a Hugging Face directory spreads over several files:
the architecture's hyperparameters (`<arch>.*` keys), the tokenizer (`tokenizer.*` keys, see
`gguf_tokenizer.py`) and the tensors, under llama.cpp's names (`blk.0.attn_q.weight`). This module
turns it into what `loader.py` builds models from: an HF-style config dict and a weight dict under
HF names, so every architecture file works unchanged.

Reading is done in two passes, both in Python: `read_gguf` checks the whole structure with the
`gguf` package's reader, with bounds checks of its own (a string or array longer than the file, a
tensor count the file cannot hold, tensor data past the end) and the tensor types against those
pymlxc loads; then `gguf_tensors.read_tensors` reads each tensor from the reader's read-only memory
map and converts it (`gguf_quants.py`: which types are repacked into MLX's affine layout, bit-exact
or with float16-rounded scales, and which are kept as llama.cpp's blocks). MLX's own GGUF reader is
not used: it widens K-quants to float16 and maps the file for writing. `docs/gguf.md` has the table.

Llama 3's RoPE scaling, stored as a `rope_freqs` tensor of per-pair factors, becomes config values.
"""
from __future__ import annotations

import contextlib
import math
import os
import struct
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

try:
    from gguf import GGMLQuantizationType as QType
    from gguf import GGUFReader, GGUFValueType
    from gguf.constants import GGML_QUANT_SIZES
except ImportError as exc:  # an optional dependency: pip install 'pymlxc[gguf]'
    raise ImportError("GGUF models need the `gguf` package: pip install 'pymlxc[gguf]' (or pip install gguf)") from exc

from .gguf_quants import AFFINE_BITS, GROUP, use_block_layers
from .gguf_tensors import TensorError, hf_name, read_tensors

GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)
MAX_DIMS = 4  # llama.cpp's GGML_MAX_DIMS
MAX_ARRAY_LEN = 1 << 24  # metadata arrays: real vocabularies have a few hundred thousand entries
MAX_STRING_LEN = 1 << 28  # an embedded tokenizer.json is tens of MiB at most
_MAX_DIM = (1 << 31) - 1  # MLX shapes are int32

# Tensor types pymlxc loads (gguf_quants.py says how each is kept); any other is refused by name.
DENSE_TYPES = (QType.F32, QType.F16, QType.BF16)
QUANT_BITS = {**AFFINE_BITS, QType.Q2_K: 2, QType.Q3_K: 3, QType.Q6_K: 6}
SUPPORTED_TYPES = DENSE_TYPES + tuple(QUANT_BITS)
QUANT_GROUP = GROUP  # the group of every repacked type
# What to do with a file of another type (IQ*, TQ*, MXFP4, ...): every standard recipe loads.
_RECIPES = ("re-quantize it with llama-quantize to Q4_K_M (or any of Q2_K, Q3_K_S/M/L, Q4_0, Q4_1, Q4_K_S/M, "
            "Q5_0, Q5_1, Q5_K_S/M, Q6_K, Q8_0), or load the original safetensors")

ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe", "gemma2", "gemma3")
_MODEL_TYPE = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe",
               "gemma2": "gemma2", "gemma3": "gemma3_text"}
_MOE = ("qwen2moe", "qwen3moe")

class GGUFError(ValueError):
    """A GGUF file is malformed, or holds something pymlxc cannot load; the message names the file."""


class _Corrupt(ValueError):
    """Raised inside the reader; `read_gguf` adds the file name."""


# ---------------------------------------------------------------------- finding the file

def find_gguf(path: str | os.PathLike[str]) -> Path | None:
    """The GGUF file a model path means: the path itself when it is a `.gguf` file, the single
    `.gguf` file of a directory that has no safetensors checkpoint, else None. A directory with
    several model files is an error that lists them (`mmproj*` vision projectors are not models)."""
    p = Path(path)
    if p.is_file():
        return p if p.suffix.lower() == ".gguf" else None
    if not p.is_dir():
        return None
    if (p / "config.json").is_file() and any(p.glob("*.safetensors")):
        return None
    found = sorted(f for f in p.iterdir()
                   if f.suffix.lower() == ".gguf" and f.is_file() and not f.name.lower().startswith("mmproj"))
    if len(found) > 1:
        raise GGUFError(f"{p} holds {len(found)} GGUF files; pass the one to load: "
                        + ", ".join(f.name for f in found))
    return found[0] if found else None


# ---------------------------------------------------------------------- checked reading

class _CheckedReader(GGUFReader):
    """The `gguf` package's reader with every read bounds-checked against the file, and arrays read
    in one piece. Numeric arrays become one part each: read them with `contents()` (a slice), not by
    element index. String arrays keep one part per string, without the length parts."""

    def _plain(self) -> np.ndarray:
        # Slicing a plain view is several times cheaper than slicing the np.memmap subclass.
        plain = self.__dict__.get("_plain_data")
        if plain is None:
            plain = self.__dict__["_plain_data"] = self.data.view(np.ndarray)
        return plain

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
        plain = self._plain()
        dt = np.dtype(dtype)
        offset, count = int(offset), int(count)
        end = offset + dt.itemsize * count
        if count < 0 or end > plain.shape[0]:
            raise _Corrupt(f"truncated or corrupt: {dt.itemsize * count} bytes at offset {offset} go past the end "
                           f"of the file ({plain.shape[0]} bytes)")
        arr = plain[offset:end].view(dt)
        return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

    def _get_str(self, offset: int) -> tuple[np.ndarray, np.ndarray]:
        slen = self._get(offset, np.uint64)
        n = int(slen[0])
        room = self._plain().shape[0] - offset - 8
        if n > min(room, MAX_STRING_LEN):
            limit = f"only {max(room, 0)} remain in the file" if n > room else f"the limit is {MAX_STRING_LEN}"
            raise _Corrupt(f"a string at offset {offset} claims {n} bytes, but {limit}")
        return slen, self._get(offset + 8, np.uint8, n)

    def _get_field_parts(self, orig_offs: int,
                         raw_type: int) -> tuple[int, list[np.ndarray], list[int], list[GGUFValueType]]:
        if raw_type != GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        itype, n, start = int(raw_itype[0]), int(alen[0]), orig_offs + 12
        if n > MAX_ARRAY_LEN:
            raise _Corrupt(f"an array at offset {orig_offs} claims {n} elements (the limit is {MAX_ARRAY_LEN})")
        scalar = self.gguf_scalar_to_np.get(itype)  # type: ignore[call-overload]
        if scalar is not None:
            values = self._get(start, scalar, n)
            return 12 + int(values.nbytes), [raw_itype, alen, values], [2], [GGUFValueType.ARRAY, GGUFValueType(itype)]
        if itype == GGUFValueType.STRING:
            parts = [raw_itype, alen]
            off = start
            plain = self._plain()
            size = plain.shape[0]
            unpack = struct.Struct("<Q").unpack_from  # big-endian files are refused before reading
            for _ in range(n):
                if off + 8 > size:
                    raise _Corrupt(f"truncated or corrupt: a string array at offset {orig_offs} runs past the end "
                                   "of the file")
                (length,) = unpack(plain, off)
                off += 8
                if length > size - off:
                    raise _Corrupt(f"a string at offset {off - 8} claims {length} bytes, but only {size - off} remain "
                                   "in the file")
                parts.append(plain[off:off + length])
                off += length
            return off - orig_offs, parts, list(range(2, 2 + n)), [GGUFValueType.ARRAY, GGUFValueType.STRING]
        if itype == GGUFValueType.ARRAY:
            raise _Corrupt(f"nested arrays (at offset {orig_offs}) are not supported")
        raise _Corrupt(f"unknown value type {itype} in an array at offset {orig_offs}")


def _check_header(path: Path) -> None:
    """The fixed 24-byte header: magic, version, and counts the file size can hold (each tensor info
    takes at least 24 bytes, each key/value 13), before any loop runs over them."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(24)
    if len(head) < 4 or head[:4] != GGUF_MAGIC:
        raise GGUFError(f"{path}: not a GGUF file (magic {head[:4]!r}, expected {GGUF_MAGIC!r})")
    if len(head) < 24:
        raise GGUFError(f"{path}: truncated GGUF file ({size} bytes, the header alone takes 24)")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", head, 4)
    if version & 0xFFFF == 0 and version:
        raise GGUFError(f"{path}: big-endian GGUF files are not supported")
    if version not in GGUF_VERSIONS:
        raise GGUFError(f"{path}: GGUF version {version} is not supported (supported: {GGUF_VERSIONS})")
    room = size - 24
    if n_tensors > room // 24 or n_kv > room // 13 or n_tensors * 24 + n_kv * 13 > room:
        raise GGUFError(f"{path}: corrupt GGUF header: {n_tensors} tensors and {n_kv} metadata entries "
                        f"cannot fit in a {size}-byte file")


def _type_name(raw: int) -> str:
    try:
        return QType(raw).name
    except ValueError:
        return f"unknown type {raw}"


def _check_tensors(path: Path, reader: GGUFReader, size: int, *, types: bool) -> None:
    """Shapes and data ranges within bounds; with `types`, only tensor types that MLX loads."""
    unsupported: list[str] = []
    for t in reader.tensors:
        if not t.name or not t.name.isprintable():
            raise GGUFError(f"{path}: a tensor has an invalid name {t.name!r}")
        dims = [int(d) for d in t.shape]
        if not 1 <= len(dims) <= MAX_DIMS or any(d < 0 or d > _MAX_DIM for d in dims):
            raise GGUFError(f"{path}: tensor {t.name!r} has an invalid shape {dims}")
        block, type_size = GGML_QUANT_SIZES.get(t.tensor_type, (1, 1))
        if dims[0] % block:
            raise GGUFError(f"{path}: tensor {t.name!r} ({t.tensor_type.name}) has {dims[0]} columns, "
                            f"not a multiple of its block size {block}")
        nbytes = math.prod(dims) // block * type_size
        if t.data_offset + nbytes > size:
            raise GGUFError(f"{path}: truncated or corrupt: tensor {t.name!r} needs bytes {t.data_offset} to "
                            f"{t.data_offset + nbytes}, the file has {size}")
        if types and t.tensor_type not in SUPPORTED_TYPES:
            unsupported.append(f"{t.name} ({t.tensor_type.name})")
    if unsupported:
        raise GGUFError(
            f"{path}: {len(unsupported)} tensor{'s have types' if len(unsupported) > 1 else ' has a type'} pymlxc "
            f"cannot load: {', '.join(unsupported[:8])}{' ...' if len(unsupported) > 8 else ''}; supported: "
            f"{', '.join(t.name for t in SUPPORTED_TYPES)}; {_RECIPES}")


def read_gguf(path: str | os.PathLike[str], *, check_types: bool = True) -> GGUFReader:
    """A validated reader of the GGUF file at `path` (metadata and tensor infos; tensor data stays
    memory-mapped). Raises GGUFError naming the file for anything malformed or, with `check_types`,
    for tensor types MLX cannot load."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"GGUF file not found: {p}")
    _check_header(p)
    try:
        reader = _CheckedReader(p)
    except _Corrupt as exc:
        raise GGUFError(f"{p}: {exc}") from None
    except (ValueError, KeyError, IndexError, OverflowError, TypeError, UnicodeDecodeError) as exc:
        # The reader's own complaints: an unknown value or tensor type, duplicate names, bad alignment.
        raise GGUFError(f"{p}: malformed GGUF file: {exc}") from exc
    if reader.byte_order != "I":
        raise GGUFError(f"{p}: GGUF files of the other byte order are not supported")
    _check_tensors(p, reader, p.stat().st_size, types=check_types)
    split = _scalar(reader, "split.count")
    if isinstance(split, int) and split > 1:
        raise GGUFError(f"{p}: part of a {split}-file split GGUF; merge it first (llama-gguf-split --merge)")
    return reader


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


def _scalar(reader: GGUFReader, key: str, default: Any = None) -> Any:
    value = metadata(reader, key, default)
    return default if isinstance(value, list) else value


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
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or value < 0:
        raise GGUFError(f"{key} must be a non-negative integer, got {value!r}")
    return int(value)


def _float(reader: GGUFReader, key: str, default: float | None = None) -> float | None:
    value = _scalar(reader, key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise GGUFError(f"{key} must be a finite number, got {value!r}")
    return float(value)


def architecture(reader: GGUFReader) -> str:
    arch = _scalar(reader, "general.architecture")
    if not isinstance(arch, str):
        raise GGUFError("the metadata key general.architecture is missing")
    return arch


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
    kv_heads = _int(reader, key("attention.head_count_kv"), heads) or heads
    head_dim = _int(reader, key("attention.key_length"), hidden // heads) or hidden // heads
    value_dim = _int(reader, key("attention.value_length"), head_dim)
    if value_dim != head_dim:
        raise GGUFError(f"key_length {head_dim} != value_length {value_dim}: not supported")
    rope_dims = _int(reader, key("rope.dimension_count"), head_dim)
    if rope_dims != head_dim:
        raise GGUFError(f"partial rotary embeddings ({rope_dims} of {head_dim} dimensions) are not supported")
    embed = shapes.get("token_embd.weight")
    if embed is None or len(embed) != 2:
        raise GGUFError("the token embedding tensor token_embd.weight is missing")
    vocab = embed[0]
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
        token = _scalar(reader, f"tokenizer.ggml.{name}")
        if isinstance(token, int) and not isinstance(token, bool):
            config[name] = token
    return config


def _check_against_tensors(config: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]]) -> None:
    """The hyperparameters must describe the tensors the file holds (a corrupt block count would
    otherwise build a model of millions of layers before any weight is matched)."""
    layers = config["num_hidden_layers"]
    blocks = {int(n.split(".")[1]) for n in shapes if n.startswith("blk.") and n.split(".")[1].isdigit()}
    if len(blocks) != layers or (blocks and (min(blocks) != 0 or max(blocks) != layers - 1)):
        raise GGUFError(f"block_count is {layers} but the file has tensors for {len(blocks)} blocks")
    hidden, head_dim = config["hidden_size"], config["head_dim"]
    expected = {
        "token_embd.weight": (config["vocab_size"], hidden),
        "blk.0.attn_q.weight": (config["num_attention_heads"] * head_dim, hidden),
        "blk.0.attn_k.weight": (config["num_key_value_heads"] * head_dim, hidden),
    }
    dense = [n for n in shapes if n.startswith("blk.") and n.endswith(".ffn_up.weight")]
    if dense or not any(n.endswith(".ffn_gate_inp.weight") for n in shapes):  # MoE files may have no dense MLP
        expected[dense[0] if dense else "blk.0.ffn_up.weight"] = (config["intermediate_size"], hidden)
    for name, shape in expected.items():
        if shapes.get(name) != shape:
            raise GGUFError(f"tensor {name} has shape {shapes.get(name)}, but the metadata implies {shape}")


_ARCH_CLASS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
               "qwen2moe": "Qwen2MoeForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM",
               "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}


def _moe_config(reader: GGUFReader, arch: str, base: Mapping[str, Any],
                shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
    """Experts from the `expert_*` keys, checked against the stacked tensors [E, ff, hidden]. Layers
    without a router are dense (`mlp_only_layers`). llama.cpp renormalises the top-k weights for
    qwen3moe and not for qwen2moe, unless `expert_weights_norm` says otherwise."""
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
        "norm_topk_prob": bool(norm) if isinstance(norm, bool) else arch == "qwen3moe",
    }
    if arch == "qwen2moe":
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
    # list of booleans, true for sliding-window layers).
    pattern = metadata(reader, key("attention.sliding_window_pattern"))
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise GGUFError(f"{key('attention.sliding_window_pattern')} has {len(pattern)} entries for {layers} layers")
        sliding = [bool(v) for v in pattern]
    else:
        period = int(pattern) if isinstance(pattern, int) and pattern > 0 else 6
        sliding = [(i + 1) % period != 0 for i in range(layers)]
        out["sliding_window_pattern"] = period
    out["layer_types"] = ["sliding_attention" if s else "full_attention" for s in sliding]
    out["rope_local_base_freq"] = _float(reader, key("rope.freq_base_swa"), 10000.0)
    return out


def _rope_scaling(reader: GGUFReader, arch: str, head_dim: int, base: float) -> dict[str, Any] | None:
    def key(name: str) -> str:
        return f"{arch}.{name}"

    kind = _scalar(reader, key("rope.scaling.type"))
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


def _llama3_factors(scaling: Mapping[str, float], wavelen: np.ndarray) -> np.ndarray:
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    smooth = (original / wavelen - low) / (high - low)
    blend = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, blend))


# ---------------------------------------------------------------------- loading

@contextlib.contextmanager
def _naming(path: Path) -> Iterator[None]:
    """Prefix the file name to GGUFErrors raised inside that do not name it yet."""
    try:
        yield
    except GGUFError as exc:
        if str(exc).startswith(str(path)):
            raise
        raise GGUFError(f"{path}: {exc}") from exc.__cause__
    except TensorError as exc:
        raise GGUFError(f"{path}: {exc}") from None


def _model_config(reader: GGUFReader) -> dict[str, Any]:
    config = gguf_config(reader)
    bits = {QUANT_BITS[t.tensor_type] for t in reader.tensors if t.tensor_type in QUANT_BITS}
    if bits:  # the report's default; each layer's own bits come from its tensors
        dominant, _ = quantization_of(reader)
        config["quantization"] = {"group_size": QUANT_GROUP, "bits": dominant or max(bits), "mode": "affine"}
    return config


def load_gguf_weights(path: str | os.PathLike[str], *, context_len: int = 131072,
                      progress: Callable[[int, int], None] | None = None, reader: GGUFReader | None = None) -> Any:
    """The `loader.LoadedModel` of the GGUF file at `path`: layers of repacked types quantized
    (`QuantizedLinear`, group 32), Q2_K/Q3_K/Q6_K layers as block layers, the others dense, dtypes
    as stored."""
    from .loader import build_model

    file = Path(path)
    reader = reader if reader is not None else read_gguf(file)
    with _naming(file):
        config = _model_config(reader)
        weights = read_tensors(reader, architecture(reader), config)
    blocks = weights.block_layers
    return build_model(config, weights.arrays, dict.fromkeys(weights.arrays, file), source=file, root=file,
                       context_len=context_len, progress=progress,
                       layers=(lambda model: use_block_layers(model, blocks)) if blocks else None)


def load_gguf_model(path: str | os.PathLike[str], *, context_len: int = 131072,
                    progress: Callable[[int, int], None] | None = None) -> tuple[Any, Any]:
    """(tokenizer, LoadedModel) of the GGUF file at `path`, reading its metadata once. The tokenizer
    comes first, so that a file without one fails before the weights are read."""
    from .gguf_tokenizer import load_gguf_tokenizer

    file = Path(path)
    reader = read_gguf(file)
    with _naming(file):
        tokenizer = load_gguf_tokenizer(file, reader, model_type_of(architecture(reader)))
    return tokenizer, load_gguf_weights(file, context_len=context_len, progress=progress, reader=reader)


# ---------------------------------------------------------------------- description

def quantization_of(reader: GGUFReader) -> tuple[int, int]:
    """(bits, group size) of the dominant quantized type, by number of weights; (0, 0) when the
    weights are mostly float. K-quants report their nominal bits and block size."""
    counts: dict[QType, int] = {}
    for t in reader.tensors:
        if len(t.shape) >= 2:
            counts[t.tensor_type] = counts.get(t.tensor_type, 0) + int(t.n_elements)
    if not counts:
        return 0, 0
    dominant = max(counts, key=lambda k: counts[k])
    if dominant not in GGML_QUANT_SIZES or GGML_QUANT_SIZES[dominant][0] == 1:  # F32, F16, BF16, F64, I8...
        return 0, 0
    return _nominal_bits(dominant), GGML_QUANT_SIZES[dominant][0]


def _nominal_bits(t: QType) -> int:
    if t in QUANT_BITS:
        return QUANT_BITS[t]
    digits = [c for c in t.name.split("_")[0] if c.isdigit()]
    return int(digits[0]) if digits else 0


def describe_gguf(path: str | os.PathLike[str]) -> tuple[str | None, int, int]:
    """(model_type, quant_bits, quant_group) for `discover`. Structure is checked, tensor types are
    not (an unsupported type is reported, not refused). A directory means its single GGUF file."""
    p = Path(path)
    file = find_gguf(p) if p.is_dir() else p
    if file is None:
        raise GGUFError(f"no GGUF model in {p}")
    reader = read_gguf(file, check_types=False)
    with _naming(file):
        arch = architecture(reader)
    bits, group = quantization_of(reader)
    return _MODEL_TYPE.get(arch, arch), bits, group


__all__ = ["GGUFError", "ARCHITECTURES", "SUPPORTED_TYPES", "find_gguf", "read_gguf", "metadata", "gguf_config",
           "load_gguf_weights", "load_gguf_model", "hf_name", "llama3_rope_scaling",
           "quantization_of", "describe_gguf"]

"""LoRA adapter files: mlx-lm's format (read and written) and PEFT's (read and written).

Inside pymlxc an adapter is a map `<module>.lora_a` (in, r) / `<module>.lora_b` (r, out) plus a
scale per module, where `<module>` is the flat name of the adapted linear (`model.layers.3.self_attn.q_proj`);
the update is `scale * x A B`.

mlx-lm (`mlx_lm.tuner`): `adapters.safetensors` holds exactly those names; `adapter_config.json` has
`fine_tune_type` ("lora"), `num_layers` (the last N blocks) and `lora_parameters` {rank, scale,
dropout, keys}; `scale` is the multiplier itself (mlx-lm's default is 20), not alpha.

PEFT: `adapter_model.safetensors` holds `base_model.model.<module>.lora_A.weight` (r, in) and
`...lora_B.weight` (out, r); `adapter_config.json` has `r`, `lora_alpha`, `target_modules`; the
scale is lora_alpha / r (lora_alpha / sqrt(r) with `use_rslora`), per module when `rank_pattern` /
`alpha_pattern` say so.
"""
from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pymlxc.core as mx
from pymlxc.core import Array
from pymlxc.files import JSON_LIMIT, read_text
from pymlxc.safetensors_check import checked_load

MLX_WEIGHTS = "adapters.safetensors"
PEFT_WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"
PEFT_PREFIX = "base_model.model."


class AdapterError(ValueError):
    """An adapter that cannot be read or does not fit the model; the message names the file."""


@dataclass(frozen=True)
class AdapterWeights:
    """An adapter read from disk, in pymlxc's layout whatever its format."""

    format: str  # "mlx" or "peft"
    path: Path
    tensors: dict[str, Array]  # "<module>.lora_a" (in, r), "<module>.lora_b" (r, out)
    scales: dict[str, float]  # per module
    dropout: float = 0.0
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def modules(self) -> list[str]:
        return list(self.scales)

    def rank(self, module: str) -> int:
        return int(self.tensors[f"{module}.lora_a"].shape[1])


def _read_config(path: Path) -> dict[str, Any]:
    file = path / CONFIG
    if not file.exists():
        raise AdapterError(f"{path}: no {CONFIG}")
    try:  # bounded, regular files only (pymlxc.files): a FIFO there would block the read
        config = json.loads(read_text(file, what="adapter config", max_bytes=JSON_LIMIT, error=AdapterError))
    except json.JSONDecodeError as exc:
        raise AdapterError(f"{file}: malformed JSON: {exc.msg} (line {exc.lineno})") from None
    except RecursionError:
        raise AdapterError(f"{file}: malformed JSON: nested too deeply") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{file}: the config must be a JSON object")
    return config


def _require(config: Mapping[str, Any], key: str, file: Path, kind: type | tuple[type, ...]) -> Any:
    if key not in config:
        raise AdapterError(f"{file}: missing required key {key!r}")
    value = config[key]
    if not isinstance(value, kind) or isinstance(value, bool):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise AdapterError(f"{file}: {key!r} must be {names}, not {value!r}")
    return value


def _rank(value: Any, what: str, file: Path) -> int:
    """`value` as a LoRA rank: an integer of at least 1 (0 would divide the scale by zero)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise AdapterError(f"{file}: {what} must be a positive integer rank, not {value!r:.40}")
    return value


def _number(value: Any, what: str, file: Path, *, low: float | None = None, positive: bool = False) -> float:
    """`value` as a finite float (at least `low`, above 0 with `positive`): a NaN or infinite scale
    would turn every output into NaN, a string or list is no number at all."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise AdapterError(f"{file}: {what} must be a number, not {value!r:.40}")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number) or (low is not None and number < low):
        bound = f" >= {low:g}" if low is not None else ""
        raise AdapterError(f"{file}: {what} must be a finite number{bound}, not {value!r:.40}")
    if positive and number <= 0:
        raise AdapterError(f"{file}: {what} must be a finite number > 0, not {value!r:.40}")
    return number


def _load_tensors(file: Path) -> dict[str, Array]:
    # The header is checked before MLX reads the file: MLX takes shapes it cannot hold (a
    # dimension of 2**32 + 4 loads as 4), and would block on a FIFO.
    tensors, _ = checked_load(file, AdapterError, "adapter weights file")
    if not tensors:
        raise AdapterError(f"{file}: holds no tensors")
    # A NaN or infinity in a LoRA weight would turn every output of the adapted model into NaN:
    # one reduction per floating tensor (others are refused by name in `_pairs`), one read.
    names = [name for name, a in tensors.items() if a.dtype.is_floating]
    finite = mx.stack([mx.all(mx.isfinite(tensors[name])) for name in names] or [mx.array(True)])
    mx.eval([finite, *(tensors[name] for name in names)])
    bad = [name for name, ok in zip(names, finite.tolist(), strict=False) if not ok]
    if bad:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise AdapterError(f"{file}: tensor {bad[0]!r}{more} holds NaN or infinite values")
    return tensors


def adapter_format(path: str | Path) -> str:
    """"mlx" or "peft", from the files in the adapter directory."""
    path = Path(path)
    if not path.is_dir():
        raise AdapterError(f"no such adapter directory: {path}")
    # exists(), not is_file(): a FIFO or directory under the name is refused by name when read.
    if (path / MLX_WEIGHTS).exists():
        return "mlx"
    if (path / PEFT_WEIGHTS).exists():
        return "peft"
    raise AdapterError(f"{path}: neither {MLX_WEIGHTS} (mlx-lm) nor {PEFT_WEIGHTS} (PEFT) is there")


def read_adapter(path: str | Path) -> AdapterWeights:
    """Read an mlx-lm or PEFT adapter directory (the format is recognised by its weight file)."""
    return read_mlx_adapter(path) if adapter_format(path) == "mlx" else read_peft_adapter(path)


# ---------------------------------------------------------------------- mlx-lm

def _pairs(tensors: Mapping[str, Array], file: Path, a_name: str, b_name: str) -> dict[str, tuple[Array, Array]]:
    """Group `<module>.<a_name>` / `<module>.<b_name>` tensors by module; other names are errors."""
    found: dict[str, dict[str, Array]] = {}
    for name, value in tensors.items():
        for kind in (a_name, b_name):
            if name.endswith("." + kind):
                found.setdefault(name[: -len(kind) - 1], {})[kind] = value
                break
        else:
            raise AdapterError(f"{file}: tensor {name!r} is not a LoRA weight (expected *.{a_name} / *.{b_name})")
    out = {}
    for module in sorted(found, key=natural_key):
        pair = found[module]
        if a_name not in pair or b_name not in pair:
            missing = a_name if a_name not in pair else b_name
            raise AdapterError(f"{file}: {module!r} has no {missing}")
        for kind in (a_name, b_name):
            if not pair[kind].dtype.is_floating:  # an integer or bool tensor is no trained weight
                raise AdapterError(f"{file}: {module}.{kind} is {pair[kind].dtype.name}, not a floating-point tensor")
        out[module] = (pair[a_name], pair[b_name])
    return out


def natural_key(name: str) -> list[Any]:
    """Sort key that puts `layers.2` before `layers.10`."""
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in name.split(".")]


def _most_common(values: Sequence[Any]) -> Any:
    counts: dict[Any, int] = {}
    for v in values:
        counts[v] = counts.get(v, 0) + 1
    return max(counts, key=lambda v: counts[v])  # ties: the first seen


def read_mlx_adapter(path: str | Path) -> AdapterWeights:
    path = Path(path)
    cfg_file = path / CONFIG
    config = _read_config(path)
    kind = config.get("fine_tune_type", "lora")
    if kind != "lora":
        raise AdapterError(f"{cfg_file}: fine_tune_type {kind!r} is not supported (only 'lora')")
    _require(config, "num_layers", cfg_file, int)
    params = _require(config, "lora_parameters", cfg_file, dict)
    rank = _rank(_require(params, "rank", cfg_file, int), "'rank'", cfg_file)
    # > 0: the attached adapter's LoRAConfig takes alpha = scale * rank > 0 only
    scale = _number(_require(params, "scale", cfg_file, (int, float)), "'scale'", cfg_file, positive=True)
    dropout = _number(params.get("dropout", 0.0) or 0.0, "'dropout'", cfg_file, low=0.0)
    tensors = _load_tensors(path / MLX_WEIGHTS)
    pairs = _pairs(tensors, path / MLX_WEIGHTS, "lora_a", "lora_b")
    scales = {}
    for module, (a, b) in pairs.items():
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
            raise AdapterError(f"{path / MLX_WEIGHTS}: {module!r} has lora_a {tuple(a.shape)} and lora_b "
                               f"{tuple(b.shape)}; expected (in, r) and (r, out)")
        if a.shape[1] != rank:
            raise AdapterError(f"{path / MLX_WEIGHTS}: {module!r} has rank {a.shape[1]}, the config says {rank}")
        scales[module] = scale
    return AdapterWeights("mlx", path, tensors, scales, dropout, config)


def _block_relative(module: str) -> str:
    """`model.layers.3.self_attn.q_proj` -> `self_attn.q_proj` (the key mlx-lm matches in a block)."""
    m = re.match(r"^(?:.*\.)?layers\.\d+\.(.+)$", module)
    return m.group(1) if m else module


def _layer_index(module: str) -> int | None:
    m = re.match(r"^(?:.*\.)?layers\.(\d+)\.", module)
    return int(m.group(1)) if m else None


def write_mlx_adapter(path: str | Path, tensors: Mapping[str, Array], scales: Mapping[str, float], *,
                      num_blocks: int, dropout: float = 0.0, extra: Mapping[str, Any] | None = None) -> Path:
    """Write `adapters.safetensors` and `adapter_config.json` that `mlx_lm.load(..., adapter_path=)`
    reads. mlx-lm has one rank and one scale per adapter: differing ones are an error. `num_layers`
    counts the blocks from the first adapted one to the last, as mlx-lm counts them."""
    path = Path(path)
    modules = list(scales)
    if not modules:
        raise AdapterError("no LoRA layers to save")
    ranks = {int(tensors[f"{m}.lora_a"].shape[1]) for m in modules}
    values = {round(float(s), 12) for s in scales.values()}
    if len(ranks) != 1 or len(values) != 1:
        raise AdapterError(f"mlx-lm's format has one rank and one scale; this adapter has ranks {sorted(ranks)} "
                           f"and scales {sorted(values)} (save it in PEFT's format instead)")
    indices = [i for i in (_layer_index(m) for m in modules) if i is not None]
    num_layers = num_blocks - min(indices) if indices else num_blocks
    keys = sorted({_block_relative(m) for m in modules})
    config: dict[str, Any] = {
        "fine_tune_type": "lora",
        "num_layers": num_layers,
        "lora_parameters": {"rank": ranks.pop(), "scale": float(next(iter(scales.values()))),
                            "dropout": float(dropout), "keys": keys},
        **(extra or {}),
    }
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(path / MLX_WEIGHTS, dict(tensors), {"format": "mlx"})
    (path / CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return path


# ---------------------------------------------------------------------- PEFT

def _pattern_value(module: str, patterns: Sequence[tuple[re.Pattern[str], Any]], default: Any) -> Any:
    for regex, value in patterns:
        if regex.match(module):
            return value
    return default


def _patterns(config: Mapping[str, Any], key: str, file: Path, *, rank: bool) -> list[tuple[re.Pattern[str], Any]]:
    """`rank_pattern` / `alpha_pattern`: an object of regular expressions to positive ranks
    (`rank`) or finite alphas, compiled as PEFT matches them (against the end of the module name,
    at a dot boundary); anything else is named here, not met later as a raw error."""
    patterns = config.get(key) or {}
    if not isinstance(patterns, dict):
        raise AdapterError(f"{file}: {key!r} must be an object of module patterns, not {patterns!r}")
    out: list[tuple[re.Pattern[str], Any]] = []
    for pattern, value in patterns.items():
        try:
            regex = re.compile(rf"(.*\.)?({pattern})$")
        except re.error as exc:
            raise AdapterError(f"{file}: {key!r} has an invalid pattern {pattern!r}: {exc}") from None
        what = f"{key}[{pattern!r}]"
        out.append((regex, _rank(value, what, file) if rank else _number(value, what, file, positive=True)))
    return out


def read_peft_adapter(path: str | Path) -> AdapterWeights:
    path = Path(path)
    cfg_file = path / CONFIG
    config = _read_config(path)
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise AdapterError(f"{cfg_file}: peft_type {peft_type!r} is not supported (only LORA)")
    r = _rank(_require(config, "r", cfg_file, int), "'r'", cfg_file)
    alpha = _number(_require(config, "lora_alpha", cfg_file, (int, float)), "'lora_alpha'", cfg_file, positive=True)
    _require(config, "target_modules", cfg_file, (list, str))
    for flag in ("use_dora", "fan_in_fan_out"):
        if config.get(flag):
            raise AdapterError(f"{cfg_file}: {flag}=true is not supported")
    if config.get("modules_to_save"):
        raise AdapterError(f"{cfg_file}: modules_to_save (fully trained layers) is not supported")
    rslora = config.get("use_rslora", False)
    if not isinstance(rslora, bool):  # bool("false") is True: a string would change every scale
        raise AdapterError(f"{cfg_file}: 'use_rslora' must be true or false, not {rslora!r}")
    rank_pattern = _patterns(config, "rank_pattern", cfg_file, rank=True)
    alpha_pattern = _patterns(config, "alpha_pattern", cfg_file, rank=False)
    dropout = _number(config.get("lora_dropout", 0.0) or 0.0, "'lora_dropout'", cfg_file, low=0.0)
    file = path / PEFT_WEIGHTS
    raw = _load_tensors(file)
    renamed: dict[str, Array] = {}
    for name, value in raw.items():
        if not name.startswith(PEFT_PREFIX):
            raise AdapterError(f"{file}: tensor {name!r} does not start with {PEFT_PREFIX!r}")
        short = name[len(PEFT_PREFIX):]
        short = re.sub(r"\.lora_([AB])(\.[^.]+)?\.weight$", r".lora_\1", short)  # drop an adapter name
        renamed[short] = value
    pairs = _pairs(renamed, file, "lora_A", "lora_B")
    tensors: dict[str, Array] = {}
    scales: dict[str, float] = {}
    for module, (a, b) in pairs.items():
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise AdapterError(f"{file}: {module!r} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; "
                               "expected (r, in) and (out, r)")
        rank = int(a.shape[0])
        want = int(_pattern_value(module, rank_pattern, r))
        if rank != want:
            raise AdapterError(f"{file}: {module!r} has rank {rank}, the config says {want}")
        mod_alpha = float(_pattern_value(module, alpha_pattern, alpha))
        scales[module] = mod_alpha / (math.sqrt(rank) if rslora else rank)
        tensors[f"{module}.lora_a"] = mx.transpose(a)
        tensors[f"{module}.lora_b"] = mx.transpose(b)
    return AdapterWeights("peft", path, tensors, scales, dropout, config)


def write_peft_adapter(path: str | Path, tensors: Mapping[str, Array], scales: Mapping[str, float], *,
                       dropout: float = 0.0, base_model: str | None = None,
                       extra: Mapping[str, Any] | None = None) -> Path:
    """Write `adapter_model.safetensors` and `adapter_config.json` that PEFT's `PeftModel.from_pretrained`
    reads (module names are the model's own, which are the Hugging Face ones). One lora_alpha is
    written (scale * r of the first module); modules with another rank or scale go in
    `rank_pattern` / `alpha_pattern`."""
    path = Path(path)
    modules = list(scales)
    if not modules:
        raise AdapterError("no LoRA layers to save")
    out: dict[str, Array] = {}
    ranks = {m: int(tensors[f"{m}.lora_a"].shape[1]) for m in modules}
    alphas = {m: float(scales[m]) * ranks[m] for m in modules}
    r0 = _most_common([ranks[m] for m in modules])
    a0 = _most_common([alphas[m] for m in modules])
    for m in modules:
        out[f"{PEFT_PREFIX}{m}.lora_A.weight"] = mx.contiguous(mx.transpose(tensors[f"{m}.lora_a"]))
        out[f"{PEFT_PREFIX}{m}.lora_B.weight"] = mx.contiguous(mx.transpose(tensors[f"{m}.lora_b"]))
    layers = sorted({i for i in (_layer_index(m) for m in modules) if i is not None})
    config: dict[str, Any] = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": r0,
        "lora_alpha": a0,
        "lora_dropout": float(dropout),
        "target_modules": sorted({m.rsplit(".", 1)[-1] for m in modules}),
        "layers_to_transform": layers or None,
        "rank_pattern": {m: ranks[m] for m in modules if ranks[m] != r0},
        "alpha_pattern": {m: alphas[m] for m in modules if not math.isclose(alphas[m], a0)},
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "inference_mode": True,
        **(extra or {}),
    }
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(path / PEFT_WEIGHTS, out, {"format": "pt"})
    (path / CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return path


def check_shapes(
    adapter: AdapterWeights, expected: Mapping[str, tuple[int, int]], model_name: str = "the model"
) -> None:
    """Every adapted module must exist in the model with (in, out) dims matching lora_a / lora_b."""
    errors = []
    for module in adapter.modules:
        a = adapter.tensors[f"{module}.lora_a"]
        b = adapter.tensors[f"{module}.lora_b"]
        dims = expected.get(module)
        if dims is None:
            errors.append(f"  {module}: no such linear layer in {model_name}")
        elif (a.shape[0], b.shape[1]) != tuple(dims):
            errors.append(f"  {module}: adapter maps {a.shape[0]} -> {b.shape[1]}, the layer {dims[0]} -> {dims[1]}")
    if errors:
        shown = errors[:10] + ([f"  ... and {len(errors) - 10} more"] if len(errors) > 10 else [])
        raise AdapterError(f"{adapter.path}: the adapter does not fit {model_name} (another architecture or size?):\n"
                           + "\n".join(shown))


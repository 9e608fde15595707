"""Fewer kernels in the whole-step decode graph (`decoder.py`) of models that declare
`decode_fusions` (Gemma 3): each block's q/k/v and gate/up projections as one matmul each, and on
CUDA each residual add with the norm after it as one kernel.

A Gemma-3-1B bf16 step on this graph was 688 CUDA kernels on an H100, about 8.6 us of host
encoding each, so the step was bound by their count, not by the device
(`benchmarks/profile/probe_cuda_graphs.py`). The projections are fused as the segments fuse
them (`segments.fuse`: the linears keep views of the joint weights, no extra memory; made again
when a linear gets new weights), and the add + norm is `kernels/add_rms_norm.py` with the offset
norm's 1 + w as its weight, bit for bit MLX's add and `rms_norm`. Both are installed on a trace's own
copy of the model (`Model.use_decode_fusions`), never on the model: the uncompiled loop and the
prefill run the model as it is. Settings: `PYMLXC_FUSE_PROJECTIONS` and `PYMLXC_FUSED_NORM`, as
for the segments.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pymlxc.core as mx
from pymlxc.core import Array

from .. import nn
from ..kernels import add_rms_norm as norm_kernel
from ..kernels import check as kernel_check
from ..nn import Module, arrays_of
from .segments import FusedProjection, Fusion, fusions_for


@dataclass(frozen=True)
class GraphFusions:
    """What a whole-step trace installs on its copy of the model: each block's (q/k/v, gate/up)
    fusion (None: that block's linears run apart) and whether the adds and norms are one kernel."""

    pairs: tuple[tuple[FusedProjection | None, FusedProjection | None], ...]
    fused_norm: bool

    def key(self) -> tuple[Any, ...]:
        """What a trace depends on besides the model's classes and shapes."""
        return tuple((q is not None, g is not None) for q, g in self.pairs), self.fused_norm

    def modules(self) -> list[FusedProjection]:
        """The fused projections, block by block, in the order `install` takes their copies."""
        return [f for pair in self.pairs for f in pair if f is not None]

    def arrays(self, held: Sequence[Array]) -> list[Array]:
        """The fusions' arrays not among `held` (the model's arrays): the trace's extra inputs."""
        seen = set(map(id, held))
        return [a for a in arrays_of(self.modules()) if id(a) not in seen]

    def install(self, model: Any, copies: Sequence[Module]) -> None:
        """Give `model` (a trace's copy) the fusions' copies (`copies`, as `modules()` orders them)."""
        it = iter(copies)
        pairs = [(next(it) if q is not None else None, next(it) if g is not None else None) for q, g in self.pairs]
        model.use_decode_fusions(pairs, self.fused_norm)


def plan(model: Any, known: dict[int, Any], fuse_projections: bool, fused_norm_setting: str) -> GraphFusions | None:
    """The fusions for `model`'s whole-step graph, made or remade (`known`: the decoder's fusions
    by block), or None where the model declares none or nothing applies."""
    blocks = blocks_of(model)
    if blocks is None:
        return None
    made: list[tuple[Fusion | None, Fusion | None]] = (fusions_for(blocks, known) if fuse_projections
                                                        else [(None, None)] * len(blocks))
    pairs = tuple((q.fused if q is not None else None, g.fused if g is not None else None) for q, g in made)
    fused_norm = use_fused_norm(model.decode_add_norms(), fused_norm_setting)
    if not fused_norm and all(p == (None, None) for p in pairs):
        return None
    return GraphFusions(pairs, fused_norm)


def blocks_of(model: Any) -> list[Any] | None:
    """The blocks of a model that declares `decode_fusions`, where all of them are its own (a
    pipeline's wrapped stages are not: None)."""
    if getattr(model, "decode_fusions", False) is not True:
        return None
    blocks = list(model.layers)
    return blocks if all(hasattr(b, "self_attn") and hasattr(b, "mlp") for b in blocks) else None


def use_fused_norm(norms: Sequence[Any], setting: str) -> bool:
    """Whether each residual add and the offset norm after it run as one kernel: `setting`
    (PYMLXC_FUSED_NORM: auto = on CUDA, 1 = also elsewhere, where the kernel fails its check, or 0)
    allows it, every such norm is an offset RMSNorm of one width and type the kernel takes (not
    float16: Gemma adds its float16 residuals in float32), and the kernel passes its check."""
    if setting == "0" or (setting == "auto" and not kernel_check.on_cuda()) or not norms:
        return False
    if any(type(n) is not nn.OffsetRMSNorm or n.scale is None or n.scale.dtype == mx.float16 for n in norms):
        return False
    return norm_kernel.serves([n.scale for n in norms], [n.eps for n in norms])


__all__ = ["GraphFusions", "blocks_of", "plan", "use_fused_norm"]

"""Trees of arrays (nested dicts and lists) addressed by dotted paths: `model.layers.0.self_attn.q_proj.lora_a`.

Checkpoint files and adapter files are flat name -> array maps; models and optimizers hold nested
trees. These helpers convert between the two and map functions over leaves.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from pymlxc.core import Array

Tree = Any


def tree_flatten(tree: Tree, prefix: str = "") -> list[tuple[str, Array]]:
    """(dotted path, leaf) pairs of a nested dict/list tree, depth first in insertion order."""
    out: list[tuple[str, Array]] = []

    def walk(node: Tree, path: str) -> None:
        if isinstance(node, Mapping):
            for k, v in node.items():
                walk(v, f"{path}.{k}" if path else str(k))
        elif isinstance(node, (list, tuple)):
            for i, v in enumerate(node):
                walk(v, f"{path}.{i}" if path else str(i))
        else:
            out.append((path, node))

    walk(tree, prefix)
    return out


def tree_unflatten(items: Iterable[tuple[str, Any]]) -> Tree:
    """Inverse of `tree_flatten`: numeric path parts become list indices (lists must be dense)."""
    root: dict[str, Any] = {}
    for path, value in items:
        parts = path.split(".")
        node = root
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"path {path!r} goes through a leaf")
        if parts[-1] in node:
            raise ValueError(f"path {path!r} appears twice")
        node[parts[-1]] = value
    return _listify(root)


def _listify(node: Any) -> Any:
    if not isinstance(node, dict):
        return node
    if node and all(k.isdigit() for k in node):
        idx = sorted(int(k) for k in node)
        if idx == list(range(len(idx))):
            return [_listify(node[str(i)]) for i in idx]
    return {k: _listify(v) for k, v in node.items()}


def tree_map(fn: Callable[..., Any], tree: Tree, *rest: Tree) -> Tree:
    """`fn` applied to each leaf of `tree` (and the matching leaves of `rest`, which share its structure)."""
    if isinstance(tree, Mapping):
        return {k: tree_map(fn, v, *(r[k] for r in rest)) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        seq = [tree_map(fn, v, *(r[i] for r in rest)) for i, v in enumerate(tree)]
        return seq if isinstance(tree, list) else tuple(seq)
    return fn(tree, *rest)


def tree_leaves(tree: Tree) -> list[Any]:
    return [leaf for _, leaf in tree_flatten(tree)]

"""The package's import graph, read with `ast` (nothing is imported): dependencies run one way.

Checked over `pymlxc/`, `backends/` and `bridge/` (installed as `pymlxc.backends` and
`pymlxc.bridge`):

* no import cycle, counting imports inside functions too (a lazy import cannot hide a cycle);
  imports under `if TYPE_CHECKING:` are left out (they never run);
* no `from X import _name` of a private name from another module of the project (a private
  submodule of the importer's own package, such as `pymlxc.core._loader`, is fine);
* `backends/metal/formats/` (a checkpoint -> config and tensors) imports nothing of the project
  outside itself but `pymlxc.core` and `pymlxc.files`: no model, layer, kernel or setting;
* `unexplained_lazy_imports` lists the imports inside functions without a comment on their line
  or the line above (`python tests/test_layers.py` prints them; the cycle check counts them anyway).

Debts still open elsewhere are listed by name in KNOWN_CYCLES and KNOWN_PRIVATE: each must still
be there (a paid debt fails the test until its entry goes), and nothing else may appear.

`python tests/test_layers.py` prints the graph's depth (its longest chain of imports) and cycles.
"""
from __future__ import annotations

import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path

from graphlib import CycleError, TopologicalSorter

ROOT = Path(__file__).resolve().parents[1]
# Source folder -> the package name it installs as.
PACKAGES = {"pymlxc": "pymlxc", "backends": "pymlxc.backends", "bridge": "pymlxc.bridge"}
# Cycles still open: none left.
KNOWN_CYCLES: set[frozenset[str]] = set()
# Private names taken from another module of the project: none left.
KNOWN_PRIVATE: set[str] = set()


@dataclass
class Import:
    target: str  # the module imported (a submodule where `from pkg import name` names one)
    names: tuple[str, ...]  # what a `from` import takes from it
    line: int
    in_function: bool
    commented: bool


@dataclass
class ModuleInfo:
    name: str
    path: Path
    is_package: bool
    imports: list[Import] = field(default_factory=list)


def module_files() -> dict[str, ModuleInfo]:
    """Every module of the project by its installed name."""
    out: dict[str, ModuleInfo] = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts = parts[:-1]
            name = ".".join([package, *parts])
            out[name] = ModuleInfo(name, path, is_package)
    return out


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _resolve(info: ModuleInfo, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = info.name.split(".")
    if not info.is_package:
        base = base[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def read_imports(info: ModuleInfo, modules: dict[str, ModuleInfo]) -> None:
    source = info.path.read_text(encoding="utf-8")
    lines = source.splitlines()
    tree = ast.parse(source, filename=str(info.path))

    def commented(line: int) -> bool:
        here = lines[line - 1]
        above = lines[line - 2].strip() if line >= 2 else ""
        return "#" in here or above.startswith("#")

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child.test):
                for other in child.orelse:
                    visit(other, in_function)
                continue
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                for alias in child.names:
                    info.imports.append(Import(alias.name, (), child.lineno, in_function, commented(child.lineno)))
            elif isinstance(child, ast.ImportFrom):
                base = _resolve(info, child)
                for alias in child.names:
                    sub = f"{base}.{alias.name}"
                    target = sub if sub in modules else base
                    names = () if sub in modules else (alias.name,)
                    info.imports.append(Import(target, names, child.lineno, in_function, commented(child.lineno)))
            visit(child, inner)

    visit(tree, False)


Graph = dict[str, set[str]]  # module -> the modules it imports


def import_graph() -> tuple[Graph, dict[str, ModuleInfo]]:
    """Edges importer -> imported between the project's modules."""
    modules = module_files()
    graph: Graph = {name: set() for name in modules}
    for info in modules.values():
        read_imports(info, modules)
        for imp in info.imports:
            if imp.target in modules and imp.target != info.name:
                graph[info.name].add(imp.target)
    return graph, modules


def cycles(graph: Graph) -> list[list[str]]:
    """Cycles of the graph, each as the modules along it: graphlib reports one at a time, and
    cutting its last edge lets the next one show (every cycle is broken by then, so the list is
    empty exactly when the graph has none)."""
    edges = {k: set(v) for k, v in graph.items()}
    found = []
    while True:
        try:
            TopologicalSorter(edges).prepare()
            return found
        except CycleError as exc:
            cycle = exc.args[1]  # [n0, n1, ..., n0]: each imported by the one after it
            found.append(cycle[:-1])
            edges[cycle[1]].discard(cycle[0])


def depth(graph: Graph) -> tuple[int, list[str]]:
    """The longest import chain (in edges) and its modules, for a graph without cycles."""
    longest: dict[str, list[str]] = {}
    for name in TopologicalSorter(graph).static_order():  # each module after what it imports
        below = [longest[t] for t in graph.get(name, ())]
        longest[name] = [name, *max(below, key=len, default=[])]
    chain = max(longest.values(), key=len, default=[])
    return max(len(chain) - 1, 0), chain


def private_imports(modules: dict[str, ModuleInfo]) -> list[str]:
    """'importer:line from X import _name' for each private name taken from another module."""
    out = []
    for info in modules.values():
        own_package = info.name if info.is_package else info.name.rpartition(".")[0]
        for imp in info.imports:
            if imp.target not in modules:
                continue
            for name in imp.names:
                if name.startswith("_") and not name.startswith("__"):
                    out.append(f"{info.name}:{imp.line} from {imp.target} import {name}")
            last = imp.target.rpartition(".")[2]
            parent = imp.target.rpartition(".")[0]
            if not imp.names and last.startswith("_") and not last.startswith("__") and parent != own_package:
                out.append(f"{info.name}:{imp.line} imports the private module {imp.target}")
    return sorted(out)


FORMATS = "pymlxc.backends.metal.formats"
# with their submodules; third-party packages too. safetensors_check: the header checks every reader of
# a user's safetensors file shares (it imports only core and files).
FORMATS_MAY_IMPORT = ("pymlxc.core", "pymlxc.files", "pymlxc.safetensors_check")


def formats_imports_above(modules: dict[str, ModuleInfo]) -> list[str]:
    """'importer:line imports X' for each project module X that a module of formats/ imports (inside
    functions too) outside formats/ and FORMATS_MAY_IMPORT."""
    def inside(name: str, package: str) -> bool:
        return name == package or name.startswith(package + ".")

    return sorted(f"{info.name}:{imp.line} imports {imp.target}" for info in modules.values()
                  if inside(info.name, FORMATS) for imp in info.imports
                  if inside(imp.target, "pymlxc") and not inside(imp.target, FORMATS)
                  and not any(inside(imp.target, ok) for ok in FORMATS_MAY_IMPORT))


def unexplained_lazy_imports(modules: dict[str, ModuleInfo]) -> list[str]:
    return sorted(f"{info.name}:{imp.line} import {imp.target}" for info in modules.values()
                  for imp in info.imports if imp.in_function and not imp.commented)


def cycle_groups(graph: Graph) -> set[frozenset[str]]:
    """The modules tied together by cycles, one set per group of cycles sharing a module."""
    groups: list[set[str]] = []
    for cycle in cycles(graph):
        joined = set(cycle)
        for g in [g for g in groups if g & joined]:
            joined |= g
            groups.remove(g)
        groups.append(joined)
    return {frozenset(g) for g in groups}


def test_no_import_cycle() -> None:
    graph, _ = import_graph()
    assert cycle_groups(graph) == KNOWN_CYCLES
    for cycle in [c for c in cycles(graph)]:
        graph[cycle[1]].discard(cycle[0])  # the known cycles cut, for the depth
    n, chain = depth(graph)
    print(f"import graph: {len(graph)} modules, {sum(map(len, graph.values()))} edges, depth {n}: "
          + " -> ".join(chain))


def test_no_private_name_across_modules() -> None:
    _, modules = import_graph()
    found = {line.split(":", 1)[0] + line.split(":", 1)[1][line.split(":", 1)[1].index(" "):]
             for line in private_imports(modules)}
    assert found == KNOWN_PRIVATE


def test_formats_import_nothing_above_them() -> None:
    _, modules = import_graph()
    assert any(name.startswith(FORMATS + ".") for name in modules)  # the folder is where the check looks
    assert formats_imports_above(modules) == []


def test_the_checks_see_what_they_look_for(tmp_path: Path) -> None:
    """The reader on a small made-up package: a cycle through an import inside a function, a
    private name and a silent lazy import are all found."""
    a = ModuleInfo("pymlxc.backends.metal.a", tmp_path / "a.py", False)
    b = ModuleInfo("pymlxc.backends.metal.b", tmp_path / "b.py", False)
    a.path.write_text("from .b import _hidden\n")
    b.path.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import c\n"
                      "def f():\n    from . import a\n    return a\n")
    modules = {m.name: m for m in (a, b)}
    graph: Graph = {}
    for info in modules.values():
        read_imports(info, modules)
        graph[info.name] = {i.target for i in info.imports if i.target in modules}
    assert sorted(cycles(graph)[0]) == [a.name, b.name] and len(cycles(graph)) == 1
    assert private_imports(modules) == [f"{a.name}:1 from {b.name} import _hidden"]
    assert unexplained_lazy_imports(modules) == [f"{b.name}:5 import {a.name}"]
    assert depth({"x": {"y", "z"}, "y": {"z"}, "z": set()}) == (2, ["x", "y", "z"])


def test_the_formats_check_sees_an_import_above(tmp_path: Path) -> None:
    """A formats module importing a layer module (inside a function too) is named; one importing
    pymlxc.core, pymlxc.files, a sibling or a third-party package is not."""
    names = ["pymlxc.backends.metal.formats.x", "pymlxc.backends.metal.formats.y", "pymlxc.backends.metal.nn",
             "pymlxc.backends.metal.kernels.check", "pymlxc.core.io", "pymlxc.files"]
    modules = {n: ModuleInfo(n, tmp_path / f"{i}.py", False) for i, n in enumerate(names)}
    modules[names[0]].path.write_text("import numpy\nimport pymlxc.core.io\nfrom pymlxc.files import read_json\n"
                                      "from .y import z\nfrom .. import nn\n"
                                      "def f():\n    from ..kernels.check import CheckedOnce\n")
    for info in list(modules.values())[1:]:
        info.path.write_text("")
    for info in modules.values():
        read_imports(info, modules)
    assert formats_imports_above(modules) == [f"{names[0]}:5 imports {names[2]}", f"{names[0]}:7 imports {names[3]}"]


if __name__ == "__main__":
    g, mods = import_graph()
    found = cycles(g)
    for cycle in found:
        print("cycle:", " <- ".join(cycle))
    if found:  # the depth of what is left once each cycle's last edge is cut
        for cycle in found:
            g[cycle[1]].discard(cycle[0])
    d, chain = depth(g)
    print(f"{len(g)} modules, {sum(map(len, g.values()))} edges, {len(found)} cycles; depth {d}: {' -> '.join(chain)}")
    for line in private_imports(mods):
        print("private:", line)
    for line in unexplained_lazy_imports(mods):
        print("lazy, unexplained:", line)
    for line in formats_imports_above(mods):
        print("formats/ imports above it:", line)
    sys.exit(0)

"""The package's import graph has no circle, counting every ``import`` statement (those inside
functions too, which run later but still tie two modules together).

An edge goes from a module to the module whose names it takes: ``from a.b import c`` is an edge to
``a.b.c`` when that is a module of the package, else to ``a.b`` (the package's ``__init__``);
``import a.b`` is an edge to ``a.b``. Names resolved from strings (the start-up hooks,
``importlib.import_module``) are not statements and not counted.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from support.subproc import ROOT

nx = pytest.importorskip("networkx", reason="the import graph's circles are found with networkx")


def modules(root: Path, package: str) -> dict[str, Path]:
    """Every module of ``package`` under ``root``, by dotted name (a package by its ``__init__``)."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _absolute(name: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = name.split(".")
    base = base[:len(base) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Module -> the package's modules it imports anywhere in its body."""
    mods = modules(root, package)
    graph: dict[str, set[str]] = {name: set() for name in mods}
    for name, path in mods.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(name, is_package, node)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            graph[name].update(t for t in targets if t in mods and t != name)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each strongly connected group of more than one module, as one shortest circle through it
    (enough to name the modules to untie), sorted."""
    g = nx.DiGraph([(a, b) for a, targets in graph.items() for b in targets])
    found = []
    for group in nx.strongly_connected_components(g):
        if len(group) > 1:
            start = min(group)
            back = min((a for a in group if g.has_edge(a, start)),
                       key=lambda a: nx.shortest_path_length(g.subgraph(group), start, a))
            found.append(nx.shortest_path(g.subgraph(group), start, back) + [start])
    return sorted(found)


def test_the_package_has_no_import_circle():
    graph = import_graph(ROOT, "drama3_patches")
    # the graph is the package's: the engine's rooms and the tools' are in it, with their edges
    assert {"drama3_patches.engine.core", "drama3_patches.tools.bench.playout"} <= graph.keys()
    assert "drama3_patches.engine.state" in graph["drama3_patches.engine.core"]
    found = circles(graph)
    assert not found, "import circles:\n" + "\n".join(" -> ".join(c) for c in found)


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_a_circle_through_an_import_inside_a_function_is_found(tmp_path):
    """Negative control: a throw-away package with two circles, one closed only by an import inside
    a function and one through a package's ``__init__``; a third module is imported by both sides
    without closing a circle."""
    _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from pkg import b\nfrom . import leaf\n",
        "pkg/b.py": "import pkg.leaf\n\ndef late():\n    from .a import x\n    return x\n",
        "pkg/leaf.py": "import os\n",
        "pkg/sub/__init__.py": "from .state import s\n",
        "pkg/sub/state.py": "def get():\n    from pkg.sub import engine\n    return engine\n",
    })
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.a"] == {"pkg.b", "pkg.leaf"} and graph["pkg.b"] == {"pkg.a", "pkg.leaf"}
    assert circles(graph) == [["pkg.a", "pkg.b", "pkg.a"], ["pkg.sub", "pkg.sub.state", "pkg.sub"]]


def test_a_graph_without_circles_gives_none(tmp_path):
    _write(tmp_path, {"pkg/__init__.py": "", "pkg/a.py": "from . import leaf\n", "pkg/leaf.py": "import os\n"})
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.a"] == {"pkg.leaf"} and circles(graph) == []

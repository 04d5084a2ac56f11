"""Tier 1: the package's import graph has no circle.

Every import statement counts, also those inside functions (they run as soon as the function
does). ``from pkg import name`` is an edge to the submodule ``pkg.name`` where there is one,
else to ``pkg`` itself; the implicit import of a parent package by its submodule is not counted.
Circles are the strongly connected components of that graph (more than one module).

The four circles issue 39 found (``_bootstrap``/``env``, ``engine.state``/``engine``, the fused
norms and their eager reference, the two bench modules and ``percentile``) are gone; any circle
fails the test, naming its modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

import drama3_patches

PACKAGE = Path(drama3_patches.__file__).parent


def _modules(package: Path) -> dict[str, Path]:
    out = {}
    for path in package.rglob("*.py"):
        parts = (package.name, *path.relative_to(package).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    mods = _modules(package)

    def owner(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                    base = ".".join(here[:len(here) - node.level + 1] + ([base] if base else []))
                subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in mods]
                targets = subs + ([base] if len(subs) < len(node.names) else [])
            else:
                continue
            deps.update(t for t in map(owner, targets) if t and t != name)
        graph[name] = deps
    return graph


def circles(graph: dict[str, set[str]]) -> set[frozenset]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index, low, on, stack, found = {}, {}, set(), [], set()
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on.add(start)
        while work:
            node, deps = work[-1]
            for dep in deps:
                if dep not in index:
                    index[dep] = low[dep] = len(index)
                    stack.append(dep)
                    on.add(dep)
                    work.append((dep, iter(sorted(graph[dep]))))
                    break
                if dep in on:
                    low[node] = min(low[node], index[dep])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = set()
                    while True:
                        member = stack.pop()
                        on.discard(member)
                        comp.add(member)
                        if member == node:
                            break
                    if len(comp) > 1:
                        found.add(frozenset(comp))
    return found


def test_the_finder_sees_a_circle_closed_inside_a_function(tmp_path):
    """The negative control: a package whose ``b`` imports ``a`` back only inside a function (as
    engine.state's lazy import of the engine package did) has a circle; without that line, none."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("import os\n\ndef f():\n    from pkg.sub import g\n    return g\n")
    graph = import_graph(pkg)
    assert graph["pkg.sub"] == {"pkg.sub.b"} and graph["pkg.sub.b"] == {"pkg.sub"}
    assert circles(graph) == {frozenset({"pkg.sub", "pkg.sub.b"})}
    (pkg / "sub" / "b.py").write_text("import os\n")
    assert circles(import_graph(pkg)) == set()


def test_the_package_has_no_import_circle():
    graph = import_graph()
    assert {"drama3_patches._bootstrap", "drama3_patches.env", "drama3_patches.engine.state"} <= set(graph)
    found = circles(graph)
    assert not found, [sorted(c) for c in found]
    for module, dep in (("drama3_patches.env", "drama3_patches._bootstrap"),
                        ("drama3_patches.engine.state", "drama3_patches.engine")):
        assert dep not in graph[module], f"{module} imports {dep}"

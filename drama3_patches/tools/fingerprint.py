"""A patch target's source fingerprint: whether upstream changed the code a patch was reviewed on.

The fingerprint is the first 16 hex digits of the SHA-256 of the target's syntax tree (node types
and fields, without positions or empty fields) with its docstrings removed, so comments, blank
lines, quoting and layout do not count and any change to the code does; the same on Python 3.10
to 3.13 (``ast.unparse`` is not: 3.10 writes some code differently). It is read from the
module's source file, never by importing it, so the drift report can read a source tree of
another vLLM than the one installed. The manifest's ``reviewed_source`` records it per target
and version (``drama3-patches drift`` compares a tree with it; ``status`` and ``doctor`` compare
the installed target).

Stdlib and ``reader`` only; the tools import it, no serving process does.
"""

from __future__ import annotations

import ast
import hashlib
import os

# A module file larger than this is not read (nothing the patches target comes near it).
MAX_SOURCE_BYTES = 4 * 1024 * 1024
# How many `from x import name` re-exports are followed to the definition.
MAX_HOPS = 4


def module_file(root: str, module: str) -> str | None:
    """``module``'s source file under ``root`` (a folder holding top-level packages), or None."""
    base = os.path.join(root, *module.split("."))
    for path in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.isfile(path):
            return path
    return None


def read_source(path: str) -> str | None:
    """The file's text (bounded, a regular file: reader.read_text), or None when it cannot be read."""
    from drama3_patches.reader import read_text

    try:
        return read_text(path, MAX_SOURCE_BYTES, "source file")
    except OSError:  # UnreadableFile is one: missing, not regular, too large, not UTF-8
        return None


def _body_lookup(body, name: str):
    """The statement of ``body`` that binds ``name`` last (a def, a class, an assignment or an
    import), as Python would see it at the end of the block."""
    found = None
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            found = node
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            found = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
            found = node
        elif isinstance(node, (ast.ImportFrom, ast.Import)):
            for alias in node.names:
                if (alias.asname or alias.name.split(".")[0]) == name:
                    found = (node, alias)
        elif isinstance(node, (ast.If, ast.Try)):  # version switches: the last branch that binds wins
            for block in (node.body, getattr(node, "orelse", []), *[h.body for h in getattr(node, "handlers", [])]):
                inner = _body_lookup(block, name)
                if inner is not None:
                    found = inner
    return found


def _resolve_from(root: str, module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    path = module_file(root, module) or ""
    up = node.level - 1 if path.endswith("__init__.py") else node.level  # a package is its own level
    base = parts[: len(parts) - up]
    return ".".join(base + ([node.module] if node.module else []))


def _parse(root: str, module: str):
    path = module_file(root, module)
    text = read_source(path) if path else None
    if text is None:
        return None
    try:
        return ast.parse(text).body
    except SyntaxError:
        return None


def find(root: str, module: str, qualname: str, hops: int = MAX_HOPS):
    """(definition node, module it was found in) for ``module:qualname`` under ``root``, following
    re-exports and, for a class member it does not define, the class's bases; or (None, why) with
    why one of 'module absent', 'name absent'."""
    body = _parse(root, module)
    if body is None:
        return None, "module absent"
    parts = qualname.split(".")
    node = _body_lookup(body, parts[0])
    if isinstance(node, tuple):  # an import: follow it
        imp, alias = node
        if isinstance(imp, ast.Import) or hops <= 0:
            return None, "name absent"
        source = _resolve_from(root, module, imp)
        if module_file(root, f"{source}.{alias.name}"):  # `from package import submodule`
            if len(parts) == 1:
                return None, "name absent"  # a submodule is not a definition
            return find(root, f"{source}.{alias.name}", ".".join(parts[1:]), hops - 1)
        return find(root, source, ".".join([alias.name, *parts[1:]]), hops - 1)
    if node is None and hops > 0:  # `from x import *`: the name may come from x
        for imp in body:
            if isinstance(imp, ast.ImportFrom) and any(a.name == "*" for a in imp.names):
                got, where = find(root, _resolve_from(root, module, imp), qualname, hops - 1)
                if got is not None:
                    return got, where
    for i, part in enumerate(parts[1:], start=1):
        if not isinstance(node, ast.ClassDef):
            return None, "name absent"
        member = _body_lookup(node.body, part)
        if member is None or isinstance(member, tuple):
            return _inherited(root, module, node, parts[i:], hops)
        node = member
    if node is None:
        return None, "name absent"
    return node, module


def _inherited(root: str, module: str, cls: ast.ClassDef, rest: list, hops: int):
    """``rest`` looked up in ``cls``'s bases, first base first (the method resolution order of a
    single-inheritance chain, which is what the targets use)."""
    if hops <= 0:
        return None, "name absent"
    for base in cls.bases:
        if isinstance(base, ast.Name):
            node, where = find(root, module, ".".join([base.id, *rest]), hops - 1)
            if node is not None:
                return node, where
    return None, "name absent"


def _strip_docstrings(node):
    for sub in ast.walk(node):
        if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)):
            body = sub.body
            if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
                    and isinstance(body[0].value.value, str):
                sub.body = body[1:] or [ast.Pass()]
    return node


def _canonical(value) -> str:
    """The tree as text: node names and fields, no positions, empty fields left out (so the fields
    later Pythons add, e.g. type_params=[], and ast.dump's changing defaults do not count)."""
    if isinstance(value, ast.AST):
        fields = []
        for name in value._fields:
            item = getattr(value, name, None)
            if item is None or (isinstance(item, list) and not item):
                continue
            fields.append(f"{name}={_canonical(item)}")
        return f"{type(value).__name__}({', '.join(fields)})"
    if isinstance(value, list):
        return "[" + ", ".join(_canonical(item) for item in value) + "]"
    return repr(value)


def of_node(node) -> str:
    """The fingerprint of one definition node (changed in place: docstrings dropped)."""
    text = _canonical(_strip_docstrings(node))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def of_target(root: str, spec: str) -> tuple[str | None, str]:
    """(fingerprint, where) of ``module:qualname`` under ``root``; (None, why) when it is not found."""
    module, _, qualname = spec.partition(":")
    node, where = find(root, module, qualname)
    if node is None:
        return None, where
    return of_node(node), where


def root_of(module: str) -> str | None:
    """The folder holding ``module``'s top-level package as installed here (no import of it)."""
    import importlib.util

    top = module.split(".")[0]
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return os.path.dirname(list(spec.submodule_search_locations)[0])


# Patch states under which the patch's code runs on the installed target (pending: it will, at import).
APPLIES = ("applied", "pending")
CHANGED = "target changed since review"


def review_changes(manifest, status: dict, root_for=root_of) -> dict[str, list[dict]]:
    """patch id -> the targets of a patch that applies (or will) here whose installed source differs
    from every fingerprint the manifest's ``reviewed_source`` records for it. A target without a
    record, or whose source cannot be read, says nothing; neither does an unchanged one."""
    out: dict[str, list[dict]] = {}
    states = {p["id"]: p.get("state") for p in status.get("patches", [])}
    for spec in manifest.patches:
        if states.get(spec.id) not in APPLIES:
            continue
        for target, recorded in spec.reviewed_source.items():
            root = root_for(target.split(":")[0])
            got = of_target(root, target)[0] if root else None
            if got is None or got in recorded.values():
                continue
            out.setdefault(spec.id, []).append({"target": target, "fingerprint": got, "reviewed": dict(recorded)})
    return out


def change_note(change: dict) -> str:
    """``target changed since review (reviewed on 0.31.0, 0.32.0)``."""
    return f"{CHANGED} (reviewed on {', '.join(sorted(change['reviewed']))})"

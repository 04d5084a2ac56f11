"""Target resolution and attribute surgery: resolve, install all or none, restore, rebind aliases.

Resolution follows ``wrapt.resolve_path``: on a class the raw ``__dict__`` entry
is read along the MRO, so an inherited ``classmethod``/``staticmethod``/``property``
reaches the patch as that descriptor and its replacement keeps the kind (a
``getattr`` would hand over a bound method or a bare function).  wrapt is imported
at the first resolution, never at interpreter start.

Which objects are ours is kept in an identity registry.  A plain replacement
also carries ``__drama3_patch__``; a wrapt proxy carries ``_self_drama3_patch``
instead, because wrapt writes every other attribute set through to the original.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Iterable

from drama3_patches.engine.state import APPLIED, PENDING, TargetRecord
from drama3_patches.logger import init_logger
from drama3_patches.manifest import Target
from drama3_patches.patchlib import is_proxy

logger = init_logger(__name__)

MARKER = "__drama3_patch__"
# Where the marker goes on a wrapt proxy: wrapt keeps `_self_` attributes on the proxy itself.
PROXY_MARKER = "_self_drama3_patch"


class TargetAbsent(LookupError):
    pass


@dataclass(frozen=True)
class Resolved:
    owner: Any  # the module or class the attribute is set on
    attr: str
    raw: Any  # the entry as stored (a classmethod stays a classmethod)
    had_own: bool  # defined on ``owner`` itself, not inherited: restore sets it back instead of deleting


def still_executing(module: Any) -> bool:
    """Whether importlib is still running ``module``'s body (in this thread or another).

    importlib puts a module in ``sys.modules`` before executing it and sets
    ``__spec__._initializing`` for the time of the execution (``_load_unlocked``);
    a name looked up meanwhile may simply not be defined yet.  Waiting on the
    module's import lock instead could deadlock: the thread executing it may be
    waiting for the patch lock this thread holds.
    """
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


def resolve(target: Target) -> Resolved:
    """Where ``target`` lives in the imported code; TargetAbsent naming what is missing."""
    from wrapt import resolve_path

    module = sys.modules.get(target.module)
    if module is None:
        raise TargetAbsent(f"module {target.module} is not imported")
    *path, attr = target.attr_path
    owner: Any = module
    if path:
        try:
            _, _, owner = resolve_path(module, ".".join(path))
        except AttributeError:  # wrapt 2 raises its PathResolutionError, an AttributeError
            raise TargetAbsent(f"{target.module} has no attribute {'.'.join(path)!r}") from None
    try:
        # Passing the object (not its name) keeps resolve_path from importing anything.
        _, _, raw = resolve_path(owner, attr)
    except AttributeError:
        raise TargetAbsent(f"{target.spec} does not exist in the installed code") from None
    had_own = attr in getattr(owner, "__dict__", {})
    return Resolved(owner, attr, raw, had_own)


class Installer:
    """Puts replacements in place and takes them out again; knows which objects are ours."""

    def __init__(self):
        self._ours: dict[int, tuple[str, Any]] = {}

    def mark(self, repl: Any, patch_id: str) -> None:
        self._ours[id(repl)] = (patch_id, repl)
        try:
            setattr(repl, PROXY_MARKER if is_proxy(repl) else MARKER, patch_id)
        except (AttributeError, TypeError):
            pass  # e.g. a property: the identity registry above still knows it

    def is_ours(self, obj: Any) -> str | None:
        """The patch id that produced ``obj`` (or wraps it), else None."""
        seen = 0
        while obj is not None and seen < 16:
            hit = self._ours.get(id(obj))
            if hit is not None and hit[1] is obj:
                return hit[0]
            if is_proxy(obj):
                mark = getattr(obj, PROXY_MARKER, None)
            else:
                try:
                    mark = obj.__dict__.get(MARKER) if hasattr(obj, "__dict__") else None
                except Exception:
                    mark = None
            if isinstance(mark, str):
                return mark
            obj = getattr(obj, "__wrapped__", None) or getattr(obj, "__func__", None)
            seen += 1
        return None

    def still_bound(self, tr: TargetRecord) -> bool:
        """Whether our replacement still sits where we put it (a reload puts a fresh original there)."""
        try:
            return resolve(tr.target).raw is tr.replacement
        except TargetAbsent:
            return False

    def install(self, patch_id: str, planned: Iterable[tuple[TargetRecord, Resolved, Any]]) -> list[TargetRecord]:
        """Set every replacement, or none: on an error the ones set are restored and it is raised again."""
        installed: list[TargetRecord] = []
        try:
            for tr, where, repl in planned:
                self.mark(repl, patch_id)
                setattr(where.owner, where.attr, repl)
                tr.owner, tr.attr, tr.original, tr.had_own = where.owner, where.attr, where.raw, where.had_own
                tr.replacement, tr.aliases = repl, []
                tr.state, tr.reason = APPLIED, "patched"
                installed.append(tr)
        except Exception:
            self.restore(patch_id, installed)
            raise
        return installed

    def restore(self, patch_id: str, trs: list[TargetRecord]) -> None:
        """Put the originals back (last installed first); a name someone else rebound is left alone."""
        for tr in reversed(trs):
            if tr.state != APPLIED or tr.replacement is None:
                continue
            current = getattr(tr.owner, "__dict__", {}).get(tr.attr)
            if current is tr.replacement:
                if tr.had_own:
                    setattr(tr.owner, tr.attr, tr.original)
                else:
                    delattr(tr.owner, tr.attr)
            elif current is not None:
                logger.warning(
                    "drama3-patches: %s was replaced by someone else after %s patched it; left as is",
                    tr.target.spec, patch_id,
                )
            if isinstance(tr.owner, type(sys)):
                # Names bound by `from x import f` after the patch (the importer
                # saw the replacement) go back to the original too.
                for module_name, name in bindings_of(tr.replacement, skip=tr.owner):
                    sys.modules[module_name].__dict__[name] = tr.original
            tr.state, tr.reason = PENDING, "restored"
            tr.replacement, tr.aliases = None, []

    def rebind_aliases(self, tr: TargetRecord) -> None:
        """Names bound by an earlier ``from x import f`` still point at the original: rebind them."""
        original = tr.original
        if not isinstance(tr.owner, type(sys)) or original is None:
            return  # only module-level objects are imported by name
        for module_name, name in bindings_of(original, skip=tr.owner):
            sys.modules[module_name].__dict__[name] = tr.replacement
            tr.aliases.append((module_name, name))
        if tr.aliases:
            logger.info(
                "drama3-patches: also rebound %s in %s",
                tr.target.spec, ", ".join(f"{m}.{n}" for m, n in tr.aliases),
            )


def bindings_of(obj: Any, skip: Any) -> list[tuple[str, str]]:
    """(module, name) of every module-level name bound to ``obj`` outside ``skip``."""
    found = []
    for module_name, module in list(sys.modules.items()):
        if module is None or module is skip:
            continue
        try:
            namespace = module.__dict__
        except Exception:
            continue
        for name, value in list(namespace.items()):
            if value is obj:
                found.append((module_name, name))
    return found

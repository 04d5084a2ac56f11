"""What a patch module may use: the context the engine hands it and small helpers.

A patch module (``drama3_patches/patches/<name>.py``) exposes one function,
named by the manifest's ``implementation`` field::

    def plan(ctx: PatchContext) -> dict[str, object]:
        ...

``ctx.targets`` are the manifest targets whose modules are imported and that
are not patched yet.  ``plan`` returns ``{target: replacement}`` for the ones it
changes; the engine installs them all or none, records the originals, and
restores them on ``unapply``.  A target left out of the dict is reported
``not-needed`` (with the reason given to ``ctx.leave``), or ``skipped`` when
``ctx.skip`` gave the reason (the target is there, but this process is not one
the patch serves).  Raising
:class:`NotNeeded` marks every target of this call ``not-needed``: that is how
feature detection says "the upstream fix is already there".

The engine knows nothing about any patch; a patch knows nothing about the
engine beyond this module.
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from drama3_patches.logger import init_logger

_logger = init_logger(__name__)

__all__ = [
    "NotNeeded",
    "PatchContext",
    "Skip",
    "accepts",
    "accepts_var_keyword",
    "call_accepting",
    "function_wrapper",
    "is_proxy",
    "names",
    "overridden",
    "replace_where_needed",
    "rewrap",
    "unwrap_descriptor",
    "wrap",
]


class NotNeeded(Exception):
    """Raised by ``plan`` when feature detection finds the upstream fix."""


class Skip(str):
    """A reason given to :meth:`PatchContext.skip`: the state room reports its target ``skipped``."""


@dataclass
class PatchContext:
    patch_id: str
    targets: tuple[str, ...]
    platform: str
    versions: Mapping[str, str | None]
    logger: logging.Logger
    _resolve: Callable[[str], Any] = field(repr=False, default=None)  # type: ignore[assignment]
    _owner: Callable[[str], tuple] = field(repr=False, default=None)  # type: ignore[assignment]
    left: dict[str, str] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)

    def original(self, target: str) -> Any:
        """The object now bound at ``target``, as stored.

        For a class attribute this is the raw ``__dict__`` entry, found along
        the MRO when the class inherits it (a ``classmethod``/``staticmethod``/
        ``property`` object stays one), so a replacement can keep the same kind.
        """
        if target not in self.targets:
            raise KeyError(f"{target!r} is not among this call's targets {self.targets}")
        return self._resolve(target)

    def owner(self, target: str) -> tuple[Any, str]:
        """(the class or module holding ``target``, the attribute name)."""
        if target not in self.targets:
            raise KeyError(f"{target!r} is not among this call's targets {self.targets}")
        return self._owner(target)

    def leave(self, target: str, reason: str) -> None:
        """Say why ``target`` is left as it is (reported as ``not-needed``)."""
        self.left[target] = reason

    def note(self, target: str, text: str) -> None:
        """One line ``status`` adds to ``target``'s reason once it is applied ("patched: text")."""
        self.notes[target] = " ".join(str(text).split())

    def callables(self, kind: str = "function"):
        """``(target, original)`` for each target that is callable; any other is left not-needed
        with the reason (what stands there is not a ``kind`` to wrap)."""
        for target in self.targets:
            original = self.original(target)
            if callable(original):
                yield target, original
            else:
                self.leave(target, f"{target} is {type(original).__name__}, not a {kind}")

    def skip(self, target: str, reason: str) -> None:
        """Leave ``target`` as it is because this process is not one the patch serves (reported
        ``skipped`` with ``reason``, not ``not-needed``: no upstream fix was found)."""
        self.left[target] = Skip(reason)


def wrap(original: Callable, *, signature: inspect.Signature | None = None):
    """Decorator: make ``wrapper`` look like ``original`` to introspection.

    Copies ``__name__``, ``__qualname__``, ``__module__``, ``__doc__``, sets
    ``__wrapped__``.  When the wrapper accepts more than the original (a new
    parameter), pass the new ``signature`` so that ``inspect.signature`` -- and
    the next feature detection -- sees what the wrapper really accepts.
    """

    def decorate(wrapper: Callable) -> Callable:
        if is_proxy(wrapper):
            # update_wrapper would set __name__, __doc__, __signature__ ... through the proxy onto
            # the object it wraps: the original would change.
            raise TypeError("wrap() decorates a plain function; a wrapt proxy already reads "
                            "through to its original (use function_wrapper alone)")
        functools.update_wrapper(wrapper, original)
        if signature is not None:
            wrapper.__signature__ = signature
        return wrapper

    return decorate


def replace_where_needed(ctx: PatchContext, needed: Callable[[Callable], bool],
                         build: Callable[[Callable], Any], *, kind: str, checking: str, fixed: str,
                         companions: dict | None = None) -> dict:
    """The plan of a patch whose feature detection runs the target itself on a probe.

    For each target: one that is not callable is left with the reason; ``needed(original)`` says
    whether the bug is there. A probe that raises means the target no longer looks like the code
    the patch fixes, so the patch fails (``RuntimeError`` naming ``checking``); a target that is
    already fixed makes the whole patch ``not-needed`` (``fixed``). ``checking`` and ``fixed`` are
    completed after the target's name. ``companions`` maps targets that go with the probed ones
    (a check the fix makes possible) to their own builders: they are built unprobed.
    """
    companions = companions or {}
    replacements = {}
    for target, original in ctx.callables(kind):
        if target in companions:
            replacements[target] = companions[target](original)
            continue
        try:
            is_needed = needed(original)
        except Exception as exc:
            raise RuntimeError(f"{target}: cannot check {checking}: {type(exc).__name__}: {exc}") from exc
        if not is_needed:
            raise NotNeeded(f"{target} {fixed}")
        replacements[target] = build(original)
    return replacements


def function_wrapper(raw: Any, wrapper: Callable) -> Any:
    """``wrapt.FunctionWrapper(raw, wrapper)``: ``wrapper(wrapped, instance, args, kwargs)`` runs
    in place of ``raw``.

    wrapt binds by descriptor kind, so ``raw`` may be the class-dict entry ``ctx.original``
    gives (function, ``classmethod``, ``staticmethod``): ``instance`` is the object, the class,
    or None as the kind says, and ``wrapped`` is already bound.  Introspection
    (``__name__``, ``__qualname__``, ``__doc__``, ``inspect.signature``, ``__wrapped__``) reads
    through to ``raw``.  Attribute sets on the proxy land on ``raw``, so a replacement that
    accepts more than ``raw`` (a new parameter, a new ``__signature__``) is a plain function
    made with :func:`wrap` instead.  wrapt is imported here, never at interpreter start.
    """
    import wrapt

    return wrapt.FunctionWrapper(raw, wrapper)


def is_proxy(obj: Any) -> bool:
    """Whether ``obj`` is a wrapt proxy (``FunctionWrapper`` included), which writes attribute
    sets through to what it wraps."""
    wrapt = sys.modules.get("wrapt")  # no proxy can exist before wrapt is imported
    # wrapt 2 puts FunctionWrapper under BaseObjectProxy, not under its public ObjectProxy.
    return wrapt is not None and isinstance(obj, getattr(wrapt, "BaseObjectProxy", wrapt.ObjectProxy))


def _signature(func: Callable) -> inspect.Signature | None:
    try:
        return inspect.signature(func)
    except (TypeError, ValueError):
        return None


def names(func: Callable, name: str) -> bool:
    """True when ``func``'s signature has a parameter called ``name`` (``**kwargs`` not counted)."""
    sig = _signature(func)
    return sig is not None and name in sig.parameters


def accepts(func: Callable, name: str) -> bool:
    """True when ``func`` takes a parameter ``name`` (or ``**kwargs``)."""
    sig = _signature(func)
    if sig is None:
        return False
    if name in sig.parameters:
        return sig.parameters[name].kind is not inspect.Parameter.POSITIONAL_ONLY
    return accepts_var_keyword(func)


def call_accepting(fn: Callable, *args, **kwargs):
    """``fn(*args, **kwargs)``, leaving out the trailing positionals and the keywords ``fn``'s
    signature has no room for (a caller that passes a newer argument to an older callee)."""
    sig = _signature(fn)
    if sig is None:
        return fn(*args, **kwargs)
    params = sig.parameters.values()
    if not accepts_var_keyword(fn):
        dropped = sorted(k for k in kwargs if not accepts(fn, k))
        if dropped:
            _logger.debug("%s takes no %s; not passed on", getattr(fn, "__qualname__", fn), dropped)
            kwargs = {k: v for k, v in kwargs.items() if k not in dropped}
    if not any(p.kind is p.VAR_POSITIONAL for p in params):
        room = sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name not in kwargs for p in params)
        args = args[:room]
    return fn(*args, **kwargs)


def unwrap_descriptor(raw: Any) -> Any:
    """The function inside a ``classmethod``/``staticmethod`` (a ``property``'s getter), else ``raw``."""
    if isinstance(raw, property):
        return raw.fget
    return raw.__func__ if isinstance(raw, (classmethod, staticmethod)) else raw


def rewrap(raw: Any, make: Callable[[Callable], Callable]) -> Any:
    """``make(function)`` wrapped again in the descriptor ``raw`` came in (class dict entries).

    A ``property`` gets ``make(getter)`` as its new getter; its setter, deleter and doc stay.
    """
    new = make(unwrap_descriptor(raw))
    if isinstance(raw, property):
        return type(raw)(new, raw.fset, raw.fdel, raw.__doc__)
    return type(raw)(new) if isinstance(raw, (classmethod, staticmethod)) else new


def accepts_var_keyword(func: Callable) -> bool:
    sig = _signature(func)
    return sig is not None and any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values()
    )


def overridden(cls: type, name: str):
    """The definition ``cls.name`` overrides: the next class in the MRO that defines it, else None."""
    for base in cls.__mro__[1:]:
        if name in base.__dict__:
            return getattr(base, name)
    return None

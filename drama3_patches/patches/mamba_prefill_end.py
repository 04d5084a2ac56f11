"""mamba-prefill-end: vLLM-Ascend's Mamba manager accepts the ``prefill_end`` vLLM passes.

Record: ``patches_manifest.yaml``, id ``mamba-prefill-end`` (why, how, upstream change,
remove-when; ``drama3-patches list --verbose`` prints it). Below: only what reading this code
needs.

Layout: ``needs_prefill_end`` compares the Ascend method's signature with the one it overrides
(``patchlib.overridden``); ``_build`` makes a plain function with the widened signature
(``wrap(signature=...)``, never set on the original or on a wrapt proxy), re-wrapped in the
target's descriptor kind by ``rewrap``; ``_warn_unlisted`` names other methods of the class that
would need the same.
"""

from __future__ import annotations

import inspect

from drama3_patches.logger import init_logger
from drama3_patches.patchlib import (
    PatchContext,
    accepts,
    names,
    overridden,
    rewrap,
    unwrap_descriptor,
    wrap,
)

logger = init_logger(__name__)

ARG = "prefill_end"


def needs_prefill_end(cls: type, name: str) -> str | None:
    """None when ``cls.name`` must be wrapped, else why it is fine as it is."""
    own = cls.__dict__.get(name)
    func = unwrap_descriptor(own)
    if not callable(func):
        return f"{cls.__qualname__}.{name} is not a method defined on the class"
    parent = overridden(cls, name)
    if parent is None or not names(parent, ARG):
        return f"the method it overrides takes no {ARG}, so vLLM does not pass it"
    if accepts(func, ARG):
        return f"{cls.__qualname__}.{name} already accepts {ARG} (or **kwargs)"
    return None


def _build(func, parent) -> callable:
    sig = inspect.signature(func)
    params = list(sig.parameters.values())
    positional = [
        p for p in params
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    has_var_positional = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params)
    default = inspect.signature(parent).parameters[ARG].default
    kind = inspect.Parameter.KEYWORD_ONLY if has_var_positional else inspect.Parameter.POSITIONAL_OR_KEYWORD
    new_sig = sig.replace(parameters=[*params, inspect.Parameter(ARG, kind, default=default)])
    # A positional prefill_end can only be the one argument past the original's positionals.
    max_positional = None if has_var_positional else len(positional)

    @wrap(func, signature=new_sig)
    def wrapper(*args, **kwargs):
        kwargs.pop(ARG, None)
        if max_positional is not None and len(args) == max_positional + 1:
            args = args[:-1]
        return func(*args, **kwargs)

    return wrapper


def plan(ctx: PatchContext) -> dict:
    out = {}
    for target in ctx.targets:
        cls, name = ctx.owner(target)
        why_not = needs_prefill_end(cls, name)
        if why_not is not None:
            ctx.leave(target, why_not)
            continue
        parent = overridden(cls, name)
        out[target] = rewrap(ctx.original(target), lambda func: _build(func, parent))
    _warn_unlisted(ctx)
    return out


def _warn_unlisted(ctx: PatchContext) -> None:
    """Name other methods of the patched classes that also drop prefill_end (manifest gap)."""
    listed = set(ctx.targets)
    seen = set()
    for target in ctx.targets:
        cls, _ = ctx.owner(target)
        if cls in seen:
            continue
        seen.add(cls)
        module_name = target.split(":")[0]
        for name, value in vars(cls).items():
            if not callable(value) or f"{module_name}:{cls.__qualname__}.{name}" in listed:
                continue
            if needs_prefill_end(cls, name) is None:
                logger.warning(
                    "drama3-patches: %s.%s also lacks %s that vLLM passes; it is not in the "
                    "manifest's mamba-prefill-end targets", cls.__qualname__, name, ARG,
                )

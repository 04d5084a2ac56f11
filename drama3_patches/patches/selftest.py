"""The engine's self-test patch: proves the machinery in a given process.

Not in the shipped manifest.  A test (or an operator checking an odd process
launcher) points ``DRAMA3_PATCHES_MANIFEST`` at a manifest whose entry uses
this implementation on a throw-away module; each callable target then returns
its original result with `` [patched]`` appended.  Feature detection: an
original carrying ``upstream_fixed = True`` is left alone (``not-needed``); a
target whose name contains ``broken`` makes ``plan`` fail, to exercise the
failure path.
"""

from __future__ import annotations

from drama3_patches.patchlib import NotNeeded, PatchContext, rewrap, wrap

SUFFIX = " [patched]"


def _wrapped(func):
    @wrap(func)
    def wrapper(*args, **kwargs):
        return f"{func(*args, **kwargs)}{SUFFIX}"

    return wrapper


def plan(ctx: PatchContext) -> dict:
    out = {}
    for target in ctx.targets:
        original = ctx.original(target)
        if "broken" in target:
            raise RuntimeError(f"self-test failure requested by target {target}")
        if getattr(original, "upstream_fixed", False):
            if len(ctx.targets) == 1:
                raise NotNeeded(f"{target} carries upstream_fixed")
            ctx.leave(target, "upstream_fixed is set")
            continue
        out[target] = rewrap(original, _wrapped)
    return out

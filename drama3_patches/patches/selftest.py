"""The engine's self-test patch: proves the machinery in a given process.

Not in the shipped manifest.  A test (or an operator checking an odd process
launcher) points ``DRAMA3_PATCHES_MANIFEST`` at a manifest whose entry uses
this implementation on a throw-away module; each callable target then returns
its original result with `` [patched]`` appended.  Feature detection: an
original carrying ``upstream_fixed = True`` is left alone (``not-needed``); a
target whose name contains ``broken`` makes ``plan`` fail, to exercise the
failure path.

Functions, methods, classmethods and staticmethods are wrapped with a wrapt
``FunctionWrapper`` around the raw entry (it binds by descriptor kind); a
property gets a wrapped getter.
"""

from __future__ import annotations

from drama3_patches.patchlib import NotNeeded, PatchContext, function_wrapper, rewrap, wrap

SUFFIX = " [patched]"


def _suffixed(wrapped, instance, args, kwargs):
    return f"{wrapped(*args, **kwargs)}{SUFFIX}"


def _getter(fget):
    @wrap(fget)
    def getter(self):
        return f"{fget(self)}{SUFFIX}"

    return getter


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
        if isinstance(original, property):
            out[target] = rewrap(original, _getter)
        else:
            out[target] = function_wrapper(original, _suffixed)
    return out

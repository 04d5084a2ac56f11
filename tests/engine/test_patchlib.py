"""Tier 1: patchlib's plan helper for patches whose feature detection runs the target on a probe."""

from __future__ import annotations

import logging

import pytest

from drama3_patches.patchlib import NotNeeded, PatchContext, replace_where_needed

TEXT = dict(kind="function", checking="whether it is broken", fixed="is fixed upstream")


def context(bound: dict) -> PatchContext:
    return PatchContext("demo", tuple(bound), "npu", {}, logging.getLogger("vllm.test"), _resolve=bound.__getitem__)


def broken(x):
    return -x


def fixed(x):
    return x


def needed(fn):
    return fn(1) != 1  # the probe: the bug answers -1


def build(fn):
    return lambda x: abs(fn(x))


def test_each_target_that_needs_it_is_replaced_through_build():
    ctx = context({"m:a": broken, "m:b": broken})
    out = replace_where_needed(ctx, needed, build, **TEXT)
    assert sorted(out) == ["m:a", "m:b"] and out["m:a"](5) == 5 and ctx.left == {}


def test_a_fixed_target_makes_the_patch_not_needed():
    with pytest.raises(NotNeeded, match="^m:b is fixed upstream$"):
        replace_where_needed(context({"m:a": broken, "m:b": fixed}), needed, build, **TEXT)


def test_a_probe_that_raises_fails_the_patch_naming_the_target_and_the_cause():
    def strange(x):
        raise KeyError("history")

    with pytest.raises(RuntimeError, match=r"^m:a: cannot check whether it is broken: KeyError: 'history'$"):
        replace_where_needed(context({"m:a": strange}), needed, build, **TEXT)


def test_a_target_that_is_not_callable_is_left_with_the_reason():
    ctx = context({"m:a": 3, "m:b": broken})
    out = replace_where_needed(ctx, needed, build, **TEXT)
    assert list(out) == ["m:b"] and ctx.left == {"m:a": "m:a is int, not a function"}

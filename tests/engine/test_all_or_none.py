"""Tier 1: a patch whose targets sit in several modules applies all or none, whatever the import order.

``plan`` runs once per target module, as each is imported. When one run fails, the targets the
earlier runs applied are restored and the targets of modules not imported yet fail alongside; a
module imported later must not patch its targets on its own. Only ``apply()`` re-plans a failed
patch, and then the whole of it.

Every case (two and three modules, every import order, the failing target in each position) is
its own patch entry on its own throw-away modules, so one fresh interpreter runs them all.
"""

from __future__ import annotations

import itertools

import pytest

from support.selftest import write_dist, write_manifest, write_target
from support.subproc import call

FUNC = "def f(x='x'):\n    return 'f ' + x\n\n\ndef broken(x='x'):\n    return 'broken ' + x\n"
CASES = [
    (n, order, bad)
    for n in (2, 3)
    for order in itertools.permutations(range(n))
    for bad in range(n)
]


def _case_id(n: int, order: tuple, bad: int) -> str:
    return f"{n}mod-order{''.join(map(str, order))}-fail{bad}"


def _modules(n: int, order: tuple, bad: int) -> list[str]:
    return [f"d3p_{_case_id(n, order, bad).replace('-', '_')}_m{i}" for i in range(n)]


def _targets(n: int, order: tuple, bad: int) -> list[str]:
    return [f"{m}:{'broken' if i == bad else 'f'}" for i, m in enumerate(_modules(n, order, bad))]


def every_order(cases: list) -> dict:
    """Runs in a fresh interpreter (the .pth line on): each case's modules imported in its order,
    then ``unapply``; per case what each target is and the patch's state, after each step."""
    import importlib
    import types

    import drama3_patches

    def look(pid: str, targets: list[str]) -> dict:
        out = {}
        for spec in targets:
            module, name = spec.split(":")
            fn = getattr(importlib.import_module(module), name)
            plain = type(fn) is types.FunctionType and fn("x") == f"{name} x"
            out[spec] = "original" if plain and not drama3_patches.is_patched(spec) else "patched"
        patch = next(p for p in drama3_patches.status()["patches"] if p["id"] == pid)
        return {"targets": out, "state": patch["state"], "reason": patch["reason"]}

    results = {}
    for pid, modules, targets in cases:
        for module in modules:
            importlib.import_module(module)
        imported = look(pid, targets)
        drama3_patches.unapply([pid])
        results[pid] = {"imported": imported, "unapplied": look(pid, targets)}
    return results


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    root = tmp_path_factory.mktemp("all_or_none")
    entries, cases = [], []
    for n, order, bad in CASES:
        pid = _case_id(n, order, bad)
        modules, targets = _modules(n, order, bad), _targets(n, order, bad)
        for m in modules:
            write_target(root, m, FUNC)
        entries.append({"id": pid, "targets": targets})
        cases.append([pid, [modules[i] for i in order], targets])
    manifest = write_manifest(root, *entries)
    env = {"DRAMA3_PATCHES": "1", "DRAMA3_PATCHES_MANIFEST": str(manifest)}
    return call(every_order, cases, env=env, pythonpath=[root])


@pytest.mark.parametrize("n,order,bad", CASES, ids=[_case_id(*c) for c in CASES])
def test_a_failure_in_any_module_leaves_every_target_original_in_any_import_order(outcomes, n, order, bad):
    got = outcomes[_case_id(n, order, bad)]
    targets = _targets(n, order, bad)
    cause = f"{targets[bad]}: RuntimeError: self-test failure requested by target {targets[bad]}"
    for step in ("imported", "unapplied"):
        assert got[step]["targets"] == {t: "original" for t in targets}, step
        assert (got[step]["state"], got[step]["reason"]) == ("failed", cause), step


def fix_then_apply() -> list:
    """The second module drifts (a target missing inside the version range); reloading the first
    does not patch it alone; once the target exists, ``apply()`` re-plans the whole patch."""
    import importlib

    import d3p_second
    import d3p_target

    import drama3_patches

    def state():
        return drama3_patches.status()["patches"][0]["state"]

    out = [d3p_target.greet("a"), state()]
    importlib.reload(d3p_target)
    out += [d3p_target.greet("b"), state()]
    d3p_second.gone = lambda: "gone"  # the cause fixed: the target exists now
    out += [d3p_target.greet("c"), state()]  # nothing re-plans a failed patch on its own
    drama3_patches.apply()
    return out + [d3p_target.greet("d"), d3p_second.gone(), state()]


def test_a_failed_patch_is_re_planned_whole_by_apply_only(tmp_path):
    write_target(tmp_path)
    write_target(tmp_path, "d3p_second", "def other():\n    return 'other'\n")
    write_dist(tmp_path, "d3p-upstream", "0.32.0rc1")
    manifest = write_manifest(tmp_path, {"targets": ["d3p_target:greet", "d3p_second:gone"],
                                         "requires": '{d3p-upstream: ">=0.32.0rc1,<0.33"}'})
    # d3p_second is imported first: its drift fails the patch before d3p_target is imported.
    env = {"DRAMA3_PATCHES": "1", "DRAMA3_PATCHES_MANIFEST": str(manifest)}
    assert call(fix_then_apply, env=env, pythonpath=[tmp_path]) == [
        "hello a!", "failed", "hello b!", "failed", "hello c!", "failed",
        "hello d! [patched]", "gone [patched]", "applied"]

"""Tier 1: the engine in real child interpreters, driven by the `selftest` patch.

Every scenario is a module-level function below, run by ``support.subproc.call`` in a fresh
interpreter started with the scenario's environment (the ``.pth`` line acts as in a deployed
process), so global state (import hooks, patched classes) never leaks between tests.
"""

from __future__ import annotations

import json
import os

import pytest

from support.selftest import write_dist, write_manifest, write_target
from support.subproc import ChildFailed, call, run_cli

T_GREET = "d3p_target:greet"
T_HI = "d3p_target:Greeter.hi"


@pytest.fixture
def sandbox(tmp_path):
    write_target(tmp_path)

    def make(*entries, **env):
        manifest = write_manifest(tmp_path, *(entries or [{"targets": [T_GREET, T_HI]}]))
        full = {"DRAMA3_PATCHES": "1", "DRAMA3_PATCHES_MANIFEST": str(manifest)}
        full.update(env)
        return {"env": full, "pythonpath": [tmp_path]}

    make.root = tmp_path
    return make


def run(func, ctx, *args, **kw):
    """``func(*args)`` in a fresh interpreter with the sandbox's environment."""
    return call(func, *args, env=ctx["env"], pythonpath=ctx["pythonpath"], **kw)


def first_patch():
    import drama3_patches

    return drama3_patches.status()["patches"][0]


# ----------------------------------------------------------------- the children


def names_bound_after_the_trigger():
    import sys

    assert "d3p_target" not in sys.modules
    from d3p_target import Greeter, greet

    st = first_patch()
    return [greet("x"), Greeter().hi(), st["state"], sorted(s["state"] for s in st["target_states"].values())]


def what_loads_when():
    import sys

    import drama3_patches._bootstrap as b

    b.activate()
    seen = ["drama3_patches.engine" in sys.modules, "yaml" in sys.modules]
    import d3p_target  # noqa: F401

    return seen + ["drama3_patches.engine" in sys.modules]


def late_start_with_an_alias():
    # A module-level name bound before the patch, as `from x import f` at the top of a module does.
    global early_alias
    import d3p_target  # noqa: F401
    from d3p_target import greet as early_alias

    import drama3_patches

    drama3_patches.apply()
    out = [early_alias("a")]
    out.append(drama3_patches.status()["patches"][0]["target_states"][T_GREET]["aliases"])
    drama3_patches.unapply()
    return out + [early_alias("b")]


def apply_twice_and_reload():
    import importlib

    import d3p_target

    import drama3_patches

    drama3_patches.apply()
    drama3_patches.apply()
    out = [d3p_target.greet("a")]
    importlib.reload(d3p_target)
    out.append(d3p_target.greet("b"))
    importlib.reload(d3p_target)
    drama3_patches.apply()
    return out + [d3p_target.greet("c"), d3p_target.Greeter().hi()]


def apply_then_unapply():
    import inspect

    import d3p_target as m

    def bound():
        return (m.greet, m.Greeter.__dict__["hi"], m.Greeter.__dict__["make"])

    before = bound()
    assert "inherited" not in m.Greeter.__dict__
    import drama3_patches

    drama3_patches.apply()
    assert m.greet is not before[0] and m.greet.__wrapped__ is before[0]
    assert drama3_patches.get_original(T_GREET) is before[0]
    out = [str(inspect.signature(m.greet)), m.greet.__qualname__, m.greet.__doc__,
           m.Greeter().inherited(), m.Greeter.make(), m.Base().inherited()]
    drama3_patches.unapply()
    return out + [all(a is b for a, b in zip(before, bound())), "inherited" in m.Greeter.__dict__,
                  first_patch()["state"], drama3_patches.is_patched(T_GREET)]


def import_and_report(module: str, call_name: str, arg):
    """Import ``module``, call ``module.call_name(*arg)``; the first patch's state and reason."""
    import importlib

    mod = importlib.import_module(module)
    st = first_patch()
    return [getattr(mod, call_name)(*arg), st["state"], st["reason"]]


def import_and_call(module: str, call_name: str, arg):
    import importlib

    return getattr(importlib.import_module(module), call_name)(*arg)


def bootstrap_then_greet(times: int):
    # The .pth line's own test of the value is covered in test_processes; here the bootstrap's.
    import drama3_patches._bootstrap as b

    for _ in range(times):
        b.activate()
    import d3p_target

    return d3p_target.greet("x")


def platform_and_first_patch():
    import d3p_target  # noqa: F401

    import drama3_patches

    st = drama3_patches.status()
    return [st["platform"], st["patches"][0]["state"], st["patches"][0]["reason"]]


def platform_alone():
    import drama3_patches

    return drama3_patches.status()["platform"]


def versions_and_first_patch():
    import d3p_target  # noqa: F401

    import drama3_patches

    st = drama3_patches.status()
    return [st["versions"]["vllm-ascend"], st["patches"][0]["state"], st["patches"][0]["reason"]]


def every_patch_then_greet():
    import d3p_target

    import drama3_patches

    return [[p["id"], p["state"], p["reason"]] for p in drama3_patches.status()["patches"]] + [d3p_target.greet("x")]


def drift_report():
    import d3p_target  # noqa: F401

    p = first_patch()
    return [p["state"], p["reason"], {t: s["state"] for t, s in p["target_states"].items()}]


def import_every_target():
    import drama3_patches.engine as e

    e.get_engine().import_targets()
    import drama3_patches

    drama3_patches.status()


def second_module_drifts():
    import d3p_target

    out = [d3p_target.greet("a")]
    import d3p_second  # noqa: F401

    return out + [d3p_target.greet("b"), first_patch()["state"]]


def second_module_fails_in_plan():
    import d3p_target

    out = [d3p_target.greet("a")]
    import d3p_second  # noqa: F401

    st = first_patch()
    return out + [d3p_target.greet("b"), st["state"], st["target_states"]["d3p_target:greet"]["reason"]]


def apply_one_id_then_import():
    import drama3_patches

    drama3_patches.apply(["p1"])
    import d3p_target
    import d3p_second

    states = {p["id"]: p["state"] for p in drama3_patches.status()["patches"]}
    return [d3p_target.greet("x"), d3p_second.other(), states]


def nothing_imported():
    st = first_patch()
    return [st["state"], st["reason"]]


def eight_threads_import_and_apply():
    import importlib
    import threading

    import drama3_patches

    barrier = threading.Barrier(8)

    def work():
        barrier.wait()
        importlib.import_module("d3p_target")
        drama3_patches.apply()

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    import d3p_target

    return d3p_target.greet("x")


def pid_and_argv():
    import os
    import sys

    import d3p_target  # noqa: F401

    return [os.getpid(), sys.argv]


# ----------------------------------------------------------------- the tests


def test_import_trigger_patches_before_names_are_bound(sandbox):
    assert run(names_bound_after_the_trigger, sandbox()) == [
        "hello x! [patched]", "hi [patched]", "applied", ["applied", "applied"]]


def test_engine_stays_unloaded_until_a_target_is_imported(sandbox):
    # engine loaded?, yaml loaded? before the target import; engine loaded? after it
    assert run(what_loads_when, sandbox()) == [False, False, True]


def test_late_start_patches_imported_targets_and_rebinds_aliases(sandbox):
    assert run(late_start_with_an_alias, sandbox(DRAMA3_PATCHES="0")) == [
        "hello a! [patched]", ["test_engine.early_alias"], "hello b!"]


def test_idempotent_apply_twice_and_reload_keep_one_layer(sandbox):
    assert run(apply_twice_and_reload, sandbox()) == [
        "hello a! [patched]", "hello b! [patched]", "hello c! [patched]", "hi [patched]"]


def test_unapply_restores_exact_originals_and_introspection_is_kept(sandbox):
    ctx = sandbox({"targets": [T_GREET, T_HI, "d3p_target:Greeter.inherited", "d3p_target:Greeter.make"]},
                  DRAMA3_PATCHES="0")
    assert run(apply_then_unapply, ctx) == [
        "(name, punctuation='!')", "greet", "Say hello.", "base [patched]", "made [patched]", "base",
        True, False, "skipped", False]


def test_all_or_none_when_installing_one_target_fails(sandbox):
    # Greeter's metaclass refuses to set `hi`: greet (installed first) must be rolled back.
    write_target(sandbox.root, "d3p_locked", """
        class NoSet(type):
            def __setattr__(cls, name, value):
                if name == "hi":
                    raise AttributeError("read-only class")
                super().__setattr__(name, value)

        def greet(name):
            return "hello " + name

        class Greeter(metaclass=NoSet):
            def hi(self):
                return "hi"
    """)
    ctx = sandbox({"targets": ["d3p_locked:greet", "d3p_locked:Greeter.hi"]})
    got = run(import_and_report, ctx, "d3p_locked", "greet", ["x"], with_output=True)
    greeting, state, reason = got["result"]
    assert (greeting, state) == ("hello x", "failed")
    assert "read-only class" in reason
    assert "original code is left in place" in got["stderr"]


def test_strict_mode_raises_naming_patch_and_cause(sandbox):
    write_target(sandbox.root, "d3p_broken", "def broken():\n    return 1\n")
    ctx = sandbox({"targets": ["d3p_broken:broken"]}, DRAMA3_PATCHES_STRICT="1")
    with pytest.raises(ChildFailed) as failed:
        run(import_and_call, ctx, "d3p_broken", "broken", [])
    assert "PatchError: drama3-patches: patch 'selftest' failed to apply" in failed.value.proc.stderr
    assert "self-test failure requested" in failed.value.proc.stderr
    assert run(import_and_call, sandbox({"targets": ["d3p_broken:broken"]}), "d3p_broken", "broken", []) == 1


def test_disable_list_and_unknown_ids(sandbox):
    got = run(import_and_report, sandbox(DRAMA3_PATCHES_DISABLE="selftest, nosuch"), "d3p_target", "greet", ["x"],
              with_output=True)
    assert got["result"] == ["hello x!", "skipped", "disabled by DRAMA3_PATCHES_DISABLE"]
    assert "nosuch" in got["stderr"] and "DRAMA3_PATCHES_DISABLE" in got["stderr"]


@pytest.mark.parametrize("value,enabled", [
    ("1", True), ("true", True), ("YES", True), (" on ", True),
    ("0", False), ("false", False), ("no", False), ("off", False), ("", False),
])
def test_enable_variable_values(sandbox, value, enabled):
    got = run(bootstrap_then_greet, sandbox(DRAMA3_PATCHES=value), 1, with_output=True)
    assert got["result"] == ("hello x! [patched]" if enabled else "hello x!")
    assert got["stderr"] == ""


def test_bad_enable_value_warns_once_and_disables(sandbox):
    got = run(bootstrap_then_greet, sandbox(DRAMA3_PATCHES="maybe"), 2, with_output=True)
    assert got["result"] == "hello x!"
    lines = [ln for ln in got["stderr"].splitlines() if ln.strip()]
    assert len(lines) == 1
    assert "DRAMA3_PATCHES='maybe'" in lines[0] and "1/true/yes/on" in lines[0]


def test_platform_guard_and_override(sandbox):
    ctx = sandbox({"targets": [T_GREET], "platforms": "[npu]"}, DRAMA3_PATCHES_PLATFORM="cuda")
    assert run(platform_and_first_patch, ctx) == ["cuda", "skipped", "platform cuda not in ['npu']"]
    ctx = sandbox({"targets": [T_GREET], "platforms": "[npu]"}, DRAMA3_PATCHES_PLATFORM="npu")
    assert run(import_and_call, ctx, "d3p_target", "greet", ["x"]) == "hello x! [patched]"
    got = run(platform_alone, sandbox(DRAMA3_PATCHES_PLATFORM="tpu"), with_output=True)
    assert "DRAMA3_PATCHES_PLATFORM='tpu'" in got["stderr"]


@pytest.mark.parametrize("installed,spec,state,reason", [
    ("0.32.0rc2.dev17+g1234abc", ">=0.32.0rc0,<0.33", "applied", "patched"),
    ("0.32.0rc2.dev17+g1234abc", ">=0.33", "skipped", "vllm-ascend 0.32.0rc2.dev17+g1234abc is outside >=0.33"),
    ("0.31.0", ">=0.31,<0.33", "applied", "patched"),
    (None, ">=0.31", "skipped", "vllm-ascend is not installed"),
])
def test_version_guards(sandbox, installed, spec, state, reason):
    if installed:
        # Installed under the underscore spelling, asked for with the dash.
        write_dist(sandbox.root, "vllm_ascend", installed, folder_name="vllm_ascend")
    ctx = sandbox({"targets": [T_GREET], "requires": f'{{vllm-ascend: "{spec}"}}'})
    assert run(versions_and_first_patch, ctx) == [installed, state, reason]


def test_target_absent_and_feature_detection(sandbox):
    ctx = sandbox(
        {"id": "absent", "targets": [T_GREET, "d3p_target:Greeter.nope"]},
        {"id": "fixed", "targets": ["d3p_target:fixed"]},
    )
    absent, fixed, greeting = run(every_patch_then_greet, ctx)
    assert absent == ["absent", "failed", "d3p_target:Greeter.nope: target absent: "
                      "d3p_target:Greeter.nope does not exist in the installed code"]
    assert fixed == ["fixed", "not-needed", "upstream fix detected: d3p_target:fixed carries upstream_fixed"]
    assert greeting == "hello x!"  # all or none: the present target was left alone too


@pytest.mark.parametrize("installed,spec,expect", [
    # Installed inside the range: a missing target is drift, loud.
    ("0.32.0rc1", ">=0.32.0rc1,<0.33", "failed"),
    # Outside the range or not installed: the patch is not for this host, quiet.
    ("0.33.0", ">=0.32.0rc1,<0.33", "skipped"),
    (None, ">=0.32.0rc1,<0.33", "skipped"),
])
def test_drift_inside_the_version_range_fails_loudly(sandbox, installed, spec, expect):
    if installed:
        write_dist(sandbox.root, "d3p-upstream", installed)
    ctx = sandbox({"targets": [T_GREET, "d3p_target:Greeter.renamed"], "requires": f'{{d3p-upstream: "{spec}"}}'})
    state, reason, targets = run(drift_report, ctx)
    assert state == expect
    if expect == "failed":
        assert reason.startswith("d3p_target:Greeter.renamed: target absent:")
        assert targets == {T_GREET: "failed", "d3p_target:Greeter.renamed": "failed"}
    else:
        assert "failed" not in targets.values()


def test_drift_of_a_target_module_fails_status_and_strict_raises(sandbox, tmp_path):
    write_dist(sandbox.root, "d3p-upstream", "0.32.0rc1")
    ctx = sandbox({"targets": [T_GREET, "d3p_moved.model_state:State.preempt"],
                   "requires": '{d3p-upstream: ">=0.32.0rc1,<0.33"}'})
    proc = run_cli("status", "--json", "--import-targets", env=ctx["env"], pythonpath=ctx["pythonpath"])
    assert proc.returncode == 1, proc.stdout + proc.stderr
    patch = json.loads(proc.stdout)["patches"][0]
    assert patch["state"] == "failed"
    assert "d3p_moved.model_state" in patch["reason"] and "ModuleNotFoundError" in patch["reason"]
    assert "d3p-upstream 0.32.0rc1" in proc.stderr  # the warning names the installed version
    # The present target is not left half-patched: all or none.
    assert patch["target_states"][T_GREET]["state"] == "failed"

    strict = dict(ctx, env=dict(ctx["env"], DRAMA3_PATCHES_STRICT="1"))
    with pytest.raises(ChildFailed) as failed:
        run(import_every_target, strict)
    assert "PatchError" in failed.value.proc.stderr and "d3p_moved.model_state" in failed.value.proc.stderr


def test_late_drift_restores_targets_already_applied(sandbox):
    # The first module was patched on import; the second arrives without its target.
    write_dist(sandbox.root, "d3p-upstream", "0.32.0rc1")
    write_target(sandbox.root, "d3p_second", "def other():\n    return 'other'\n")
    ctx = sandbox({"targets": [T_GREET, "d3p_second:gone"], "requires": '{d3p-upstream: ">=0.32.0rc1,<0.33"}'})
    assert run(second_module_drifts, ctx) == ["hello a! [patched]", "hello b!", "failed"]


def test_plan_failing_in_a_later_module_restores_the_earlier_module(sandbox):
    """greet, patched when d3p_target was imported, is restored once plan() fails on d3p_second."""
    write_target(sandbox.root, "d3p_second", "def broken():\n    return 'broken'\n")
    ctx = sandbox({"targets": [T_GREET, "d3p_second:broken"]})
    got = run(second_module_fails_in_plan, ctx, with_output=True)
    greeting_a, greeting_b, state, reason = got["result"]
    assert (greeting_a, greeting_b, state) == ("hello a! [patched]", "hello b!", "failed")
    assert reason.startswith("not applied: selftest failed on d3p_second:broken")
    assert "restored the originals of d3p_target:greet" in got["stderr"]


def test_apply_with_ids_applies_only_those_ids(sandbox):
    """apply(["p1"]) outside DRAMA3_PATCHES: p2's target stays original and p2 is skipped."""
    write_target(sandbox.root, "d3p_second", "def other():\n    return 'other'\n")
    ctx = sandbox({"id": "p1", "targets": [T_GREET]}, {"id": "p2", "targets": ["d3p_second:other"]},
                  DRAMA3_PATCHES="0")
    assert run(apply_one_id_then_import, ctx) == ["hello x! [patched]", "other", {"p1": "applied", "p2": "skipped"}]


def test_pending_until_imported(sandbox):
    assert run(nothing_imported, sandbox()) == ["pending", "waiting for import of d3p_target"]


def test_thread_safety_concurrent_imports_and_applies(sandbox):
    assert run(eight_threads_import_and_apply, sandbox()) == "hello x! [patched]"


def test_report_dir_written_on_change(sandbox):
    reports = sandbox.root / "reports"
    pid, argv = run(pid_and_argv, sandbox(DRAMA3_PATCHES_REPORT_DIR=str(reports)))
    # Imported here: children load this module, and some must not load the engine.
    from drama3_patches.engine.state import host_label

    data = json.loads((reports / f"{host_label()}-{pid}.json").read_text())
    assert data["host"] == host_label()
    assert data["patches"][0]["id"] == "selftest"
    assert data["patches"][0]["state"] == "applied"
    # The program name stays; every argument value is redacted (a command line can carry an API key).
    assert data["argv"] == [os.path.basename(argv[0])] + ["*"] * (len(argv) - 1)
    assert (reports / f"{host_label()}-{pid}.json").stat().st_mode & 0o777 == 0o600
    assert reports.stat().st_mode & 0o777 == 0o700
    # Without the variable nothing is written.
    before = sorted(reports.iterdir())
    run(import_and_call, sandbox(), "d3p_target", "greet", ["x"])
    assert sorted(reports.iterdir()) == before

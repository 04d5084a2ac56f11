"""Tier 1: the engine in real child interpreters, driven by the `selftest` patch.

Every test runs its scenario in a fresh ``python -c`` so global state (import
hooks, patched classes) never leaks between tests.
"""

from __future__ import annotations

import json

import pytest

from support.selftest import write_dist, write_manifest, write_target
from support.subproc import run_cli, run_python

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


def run(code, ctx, **kw):
    return run_python(code, env=ctx["env"], pythonpath=ctx["pythonpath"], **kw)


def test_import_trigger_patches_before_names_are_bound(sandbox):
    out = run("""
        import sys
        assert "d3p_target" not in sys.modules
        from d3p_target import greet, Greeter
        print(greet("x")); print(Greeter().hi())
        import drama3_patches
        st = drama3_patches.status()["patches"][0]
        print(st["state"], sorted(s["state"] for s in st["target_states"].values()))
    """, sandbox()).stdout.splitlines()
    assert out == ["hello x! [patched]", "hi [patched]", "applied ['applied', 'applied']"]


def test_engine_stays_unloaded_until_a_target_is_imported(sandbox):
    out = run("""
        import sys
        import drama3_patches._bootstrap as b
        b.activate()
        print("engine" if "drama3_patches.engine" in sys.modules else "no-engine")
        print("yaml" if "yaml" in sys.modules else "no-yaml")
        import d3p_target
        print("engine" if "drama3_patches.engine" in sys.modules else "no-engine")
    """, sandbox()).stdout.split()
    assert out == ["no-engine", "no-yaml", "engine"]


def test_late_start_patches_imported_targets_and_rebinds_aliases(sandbox):
    out = run("""
        import d3p_target
        from d3p_target import greet as early_alias
        import drama3_patches
        drama3_patches.apply()
        print(early_alias("a"))
        st = drama3_patches.status()["patches"][0]["target_states"]["d3p_target:greet"]
        print(st["aliases"])
        drama3_patches.unapply()
        print(early_alias("b"))
    """, sandbox(DRAMA3_PATCHES="0")).stdout.splitlines()
    assert out[0] == "hello a! [patched]"
    assert out[1] == "['__main__.early_alias']"
    assert out[2] == "hello b!"


def test_idempotent_apply_twice_and_reload_keep_one_layer(sandbox):
    out = run("""
        import importlib
        import drama3_patches
        import d3p_target
        drama3_patches.apply(); drama3_patches.apply()
        print(d3p_target.greet("a"))
        importlib.reload(d3p_target)
        print(d3p_target.greet("b"))
        importlib.reload(d3p_target); drama3_patches.apply()
        print(d3p_target.greet("c")); print(d3p_target.Greeter().hi())
    """, sandbox()).stdout.splitlines()
    assert out == ["hello a! [patched]", "hello b! [patched]", "hello c! [patched]", "hi [patched]"]


def test_unapply_restores_exact_originals_and_introspection_is_kept(sandbox):
    ctx = sandbox({"targets": [T_GREET, T_HI, "d3p_target:Greeter.inherited", "d3p_target:Greeter.make"]},
                  DRAMA3_PATCHES="0")
    out = run("""
        import inspect
        import d3p_target as m
        before = (m.greet, m.Greeter.__dict__["hi"], m.Greeter.__dict__["make"])
        assert "inherited" not in m.Greeter.__dict__
        import drama3_patches
        drama3_patches.apply()
        assert m.greet is not before[0]
        assert m.greet.__wrapped__ is before[0]
        assert drama3_patches.get_original("d3p_target:greet") is before[0]
        print(inspect.signature(m.greet), m.greet.__qualname__, m.greet.__doc__)
        print(m.Greeter().inherited(), m.Greeter.make(), m.Base().inherited())
        drama3_patches.unapply()
        after = (m.greet, m.Greeter.__dict__["hi"], m.Greeter.__dict__["make"])
        print(all(a is b for a, b in zip(before, after)), "inherited" in m.Greeter.__dict__)
        print(drama3_patches.status()["patches"][0]["state"], drama3_patches.is_patched("d3p_target:greet"))
    """, ctx).stdout.splitlines()
    assert out[0] == "(name, punctuation='!') greet Say hello."
    assert out[1] == "base [patched] made [patched] base"
    assert out[2] == "True False"
    assert out[3] == "skipped False"


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
    proc = run("""
        import d3p_locked, drama3_patches
        st = drama3_patches.status()["patches"][0]
        print(d3p_locked.greet("x")); print(st["state"]); print(st["reason"])
    """, ctx)
    out = proc.stdout.splitlines()
    assert out[0] == "hello x"
    assert out[1] == "failed"
    assert "read-only class" in out[2]
    assert "original code is left in place" in proc.stderr


def test_strict_mode_raises_naming_patch_and_cause(sandbox):
    write_target(sandbox.root, "d3p_broken", "def broken():\n    return 1\n")
    ctx = sandbox({"targets": ["d3p_broken:broken"]}, DRAMA3_PATCHES_STRICT="1")
    proc = run("import d3p_broken", ctx, check=False)
    assert proc.returncode != 0
    assert "PatchError: drama3-patches: patch 'selftest' failed to apply" in proc.stderr
    assert "self-test failure requested" in proc.stderr
    lenient = run("import d3p_broken; print(d3p_broken.broken())", sandbox({"targets": ["d3p_broken:broken"]}))
    assert lenient.stdout.strip() == "1"


def test_disable_list_and_unknown_ids(sandbox):
    ctx = sandbox(DRAMA3_PATCHES_DISABLE="selftest, nosuch")
    proc = run("""
        import d3p_target, drama3_patches
        st = drama3_patches.status()["patches"][0]
        print(d3p_target.greet("x")); print(st["state"], "|", st["reason"])
    """, ctx)
    assert proc.stdout.splitlines() == ["hello x!", "skipped | disabled by DRAMA3_PATCHES_DISABLE"]
    assert "nosuch" in proc.stderr and "DRAMA3_PATCHES_DISABLE" in proc.stderr


@pytest.mark.parametrize("value,enabled", [
    ("1", True), ("true", True), ("YES", True), (" on ", True),
    ("0", False), ("false", False), ("no", False), ("off", False), ("", False),
])
def test_enable_variable_values(sandbox, value, enabled):
    # The .pth line's own test of the value is covered in test_processes; here the bootstrap's.
    code = "import drama3_patches._bootstrap as b; b.activate(); import d3p_target; print(d3p_target.greet('x'))"
    proc = run(code, sandbox(DRAMA3_PATCHES=value))
    assert proc.stdout.strip() == ("hello x! [patched]" if enabled else "hello x!")
    assert proc.stderr == ""


def test_bad_enable_value_warns_once_and_disables(sandbox):
    code = "import drama3_patches._bootstrap as b; b.activate(); b.activate(); import d3p_target; print(d3p_target.greet('x'))"
    proc = run(code, sandbox(DRAMA3_PATCHES="maybe"))
    assert proc.stdout.strip() == "hello x!"
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1
    assert "DRAMA3_PATCHES='maybe'" in lines[0] and "1/true/yes/on" in lines[0]


def test_platform_guard_and_override(sandbox):
    ctx = sandbox({"targets": [T_GREET], "platforms": "[npu]"}, DRAMA3_PATCHES_PLATFORM="cuda")
    out = run("""
        import d3p_target, drama3_patches
        st = drama3_patches.status()
        print(st["platform"], st["patches"][0]["state"], st["patches"][0]["reason"])
    """, ctx).stdout.strip()
    assert out == "cuda skipped platform cuda not in ['npu']"
    ctx = sandbox({"targets": [T_GREET], "platforms": "[npu]"}, DRAMA3_PATCHES_PLATFORM="npu")
    assert run("import d3p_target; print(d3p_target.greet('x'))", ctx).stdout.strip() == "hello x! [patched]"
    proc = run("import drama3_patches; print(drama3_patches.status()['platform'])",
               sandbox(DRAMA3_PATCHES_PLATFORM="tpu"))
    assert "DRAMA3_PATCHES_PLATFORM='tpu'" in proc.stderr


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
    out = run("""
        import d3p_target, drama3_patches
        st = drama3_patches.status()
        print(st["versions"]["vllm-ascend"]); print(st["patches"][0]["state"]); print(st["patches"][0]["reason"])
    """, ctx).stdout.splitlines()
    assert out == [str(installed), state, reason]


def test_target_absent_and_feature_detection(sandbox):
    ctx = sandbox(
        {"id": "absent", "targets": [T_GREET, "d3p_target:Greeter.nope"]},
        {"id": "fixed", "targets": ["d3p_target:fixed"]},
    )
    out = run("""
        import d3p_target, drama3_patches
        for p in drama3_patches.status()["patches"]:
            print(p["id"], p["state"], p["reason"])
        print(d3p_target.greet("x"))
    """, ctx).stdout.splitlines()
    assert out[0] == ("absent failed d3p_target:Greeter.nope: target absent: "
                      "d3p_target:Greeter.nope does not exist in the installed code")
    assert out[1] == "fixed not-needed upstream fix detected: d3p_target:fixed carries upstream_fixed"
    assert out[2] == "hello x!"  # all or none: the present target was left alone too


DRIFT = """
    import json, d3p_target, drama3_patches
    p = drama3_patches.status()["patches"][0]
    print(json.dumps([p["state"], p["reason"], {t: s["state"] for t, s in p["target_states"].items()}]))
"""


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
    state, reason, targets = json.loads(run(DRIFT, ctx).stdout)
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

    strict = dict(ctx["env"], DRAMA3_PATCHES_STRICT="1")
    proc = run_python("import drama3_patches.engine as e; e.get_engine().import_targets(); "
                      "import drama3_patches; drama3_patches.status()",
                      env=strict, pythonpath=ctx["pythonpath"], check=False)
    assert proc.returncode != 0
    assert "PatchError" in proc.stderr and "d3p_moved.model_state" in proc.stderr


def test_late_drift_restores_targets_already_applied(sandbox):
    # The first module was patched on import; the second arrives without its target.
    write_dist(sandbox.root, "d3p-upstream", "0.32.0rc1")
    write_target(sandbox.root, "d3p_second", "def other():\n    return 'other'\n")
    ctx = sandbox({"targets": [T_GREET, "d3p_second:gone"], "requires": '{d3p-upstream: ">=0.32.0rc1,<0.33"}'})
    out = run("""
        import d3p_target
        print(d3p_target.greet("a"))
        import d3p_second
        print(d3p_target.greet("b"))
        import drama3_patches
        print(drama3_patches.status()["patches"][0]["state"])
    """, ctx).stdout.splitlines()
    assert out == ["hello a! [patched]", "hello b!", "failed"]


def test_pending_until_imported(sandbox):
    out = run("""
        import drama3_patches
        st = drama3_patches.status()["patches"][0]
        print(st["state"], st["reason"])
    """, sandbox()).stdout.strip()
    assert out == "pending waiting for import of d3p_target"


def test_thread_safety_concurrent_imports_and_applies(sandbox):
    out = run("""
        import threading, importlib, drama3_patches
        barrier = threading.Barrier(8)
        def work():
            barrier.wait()
            importlib.import_module("d3p_target")
            drama3_patches.apply()
        ts = [threading.Thread(target=work) for _ in range(8)]
        [t.start() for t in ts]; [t.join() for t in ts]
        import d3p_target
        print(d3p_target.greet("x"))
    """, sandbox()).stdout.strip()
    assert out == "hello x! [patched]"


def test_report_dir_written_on_change(sandbox):
    reports = sandbox.root / "reports"
    proc = run("""
        import os, d3p_target
        print(os.getpid())
    """, sandbox(DRAMA3_PATCHES_REPORT_DIR=str(reports)))
    pid = proc.stdout.strip()
    data = json.loads((reports / f"{pid}.json").read_text())
    assert data["patches"][0]["id"] == "selftest"
    assert data["patches"][0]["state"] == "applied"
    assert data["argv"] == ["-c"]
    # Without the variable nothing is written.
    before = sorted(reports.iterdir())
    run("import d3p_target", sandbox())
    assert sorted(reports.iterdir()) == before

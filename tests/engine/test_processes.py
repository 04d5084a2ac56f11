"""Tier 1: activation in every kind of process, through the installed ``.pth`` line.

These run against the interpreter the suite runs in, where the project is
installed (``pip install -e .[test]``): children start with only the
environment variable set and must come up patched.
"""

from __future__ import annotations

import site
import sys
from pathlib import Path

import pytest

from support.selftest import write_manifest, write_target
from support.subproc import call, run_python

PTH = "drama3_patches.pth"


def _installed_pth() -> Path:
    for d in [*site.getsitepackages(), site.getusersitepackages()]:
        if (Path(d) / PTH).exists():
            return Path(d) / PTH
    raise AssertionError(
        f"{PTH} is not in this interpreter's site-packages ({sys.prefix}); "
        "install the project first: pip install -e '.[test]'"
    )


@pytest.fixture
def ctx(tmp_path):
    _installed_pth()
    write_target(tmp_path)
    manifest = write_manifest(tmp_path, {"targets": ["d3p_target:greet"]})
    return {"env": {"DRAMA3_PATCHES": "1", "DRAMA3_PATCHES_MANIFEST": str(manifest)},
            "pythonpath": [tmp_path], "root": tmp_path}


def test_pth_line_is_cheap_when_disabled(ctx):
    for value in (None, "0", "off"):
        env = dict(ctx["env"])
        if value is None:
            env.pop("DRAMA3_PATCHES")
        else:
            env["DRAMA3_PATCHES"] = value
        out = run_python("""
            import sys
            print(sorted(m for m in sys.modules if m.startswith("drama3")))
            print(any(type(f).__name__ == "TriggerFinder" for f in sys.meta_path))
        """, env=env, pythonpath=ctx["pythonpath"]).stdout.split("\n")
        assert out[:2] == ["[]", "False"], value


def test_python_c_child_is_patched_by_the_pth_line(ctx):
    out = run_python("import d3p_target; print(d3p_target.greet('c'))",
                     env=ctx["env"], pythonpath=ctx["pythonpath"]).stdout.strip()
    assert out == "hello c! [patched]"


def what_a_patched_process_loaded() -> dict:
    """Runs in a fresh interpreter started with DRAMA3_PATCHES=1, as a serving process is."""
    import sys

    def ours(*prefixes):
        return sorted(m for m in sys.modules if m.split(".")[0] in prefixes or m.startswith(prefixes))

    idle = ours("drama3_patches", "wrapt", "yaml")
    import d3p_target

    return {"idle": idle, "greet": d3p_target.greet("x"), "tools": ours("drama3_patches.tools"),
            "wrapt": "wrapt" in sys.modules, "engine": "drama3_patches.engine" in sys.modules}


def test_a_serving_process_never_imports_the_tools_and_loads_wrapt_only_at_a_target(ctx):
    # A cache folder of its own: this first start scans the manifest (the cached start is
    # test_startup_cache's, which loads only the package and _bootstrap).
    env = {**ctx["env"], "DRAMA3_PATCHES_CACHE_DIR": str(ctx["root"] / "cache")}
    got = call(what_a_patched_process_loaded, env=env, pythonpath=ctx["pythonpath"])
    # Before any target import: the stdlib-only trigger and its bounded reader, nothing heavy.
    assert got["idle"] == ["drama3_patches", "drama3_patches._bootstrap", "drama3_patches.reader"]
    # The target import patched it through the engine (which brought wrapt), and no tool came along.
    assert got["greet"] == "hello x! [patched]" and got["engine"] and got["wrapt"]
    assert got["tools"] == []


@pytest.mark.parametrize("method", ["spawn", "forkserver", "fork"])
def test_multiprocessing_children_are_patched(ctx, method):
    # The child function lives in a module: spawn and forkserver pickle it by name.
    (ctx["root"] / "d3p_mp_child.py").write_text(
        "import sys\n"
        "def child(q):\n"
        "    import d3p_target\n"
        "    q.put((d3p_target.greet('mp'), 'drama3_patches._bootstrap' in sys.modules))\n"
    )
    out = run_python(f"""
        import multiprocessing as mp
        from d3p_mp_child import child

        if __name__ == "__main__":
            mp_ctx = mp.get_context({method!r})
            q = mp_ctx.Queue()
            p = mp_ctx.Process(target=child, args=(q,))
            p.start(); print(q.get(timeout=60)); p.join(60)
            print(p.exitcode)
    """, env=ctx["env"], pythonpath=ctx["pythonpath"]).stdout.splitlines()
    assert out == ["('hello mp! [patched]', True)", "0"]


@pytest.mark.ray
def test_ray_worker_is_patched_through_runtime_env(ctx):
    pytest.importorskip("ray", reason="ray is a test dependency (pip install -e '.[test]')")
    # The driver itself is not enabled: only the worker gets the variable, through runtime_env.
    env = {k: v for k, v in ctx["env"].items() if k != "DRAMA3_PATCHES"}
    env.update({"RAY_DISABLE_USAGE_STATS": "1", "RAY_USAGE_STATS_ENABLED": "0"})
    proc = run_python(f"""
        import ray, sys
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False,
                 runtime_env={{"env_vars": {{"DRAMA3_PATCHES": "1",
                                            "DRAMA3_PATCHES_MANIFEST": {ctx["env"]["DRAMA3_PATCHES_MANIFEST"]!r},
                                            "PYTHONPATH": {str(ctx["root"])!r}}}}})

        @ray.remote
        def probe():
            import d3p_target
            return d3p_target.greet("ray")

        print(ray.get(probe.remote(), timeout=240))
        import d3p_target
        print(d3p_target.greet("driver"))
        ray.shutdown()
    """, env=env, pythonpath=ctx["pythonpath"], timeout=400)
    out = proc.stdout.splitlines()
    assert out[-2:] == ["hello ray! [patched]", "hello driver!"], proc.stderr[-2000:]


def test_vllm_general_plugin_entry_point_applies(ctx):
    out = run_python("""
        import sys
        from importlib.metadata import entry_points
        eps = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "drama3_patches"]
        print(len(eps), eps[0].value)
        # Simulate a process where .pth files were not processed: no trigger yet.
        sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != "TriggerFinder"]
        import d3p_target
        eps[0].load()()
        eps[0].load()()
        print(d3p_target.greet("plugin"))
    """, env=ctx["env"], pythonpath=ctx["pythonpath"]).stdout.splitlines()
    assert out == ["1 drama3_patches.plugin:register", "hello plugin! [patched]"]

"""Tier 1: concurrent first imports and fork.

A target module still executing (in ``sys.modules``, its names not defined yet) is not drift:
the patch waits for it.  A fork while another thread holds one of the engine's locks leaves
the child able to take it (the locks are made anew in the child).
"""

from __future__ import annotations

import pytest

from support.selftest import write_manifest, write_target
from support.subproc import call

INNER = "def inner():\n    return 'inner'\n"
# Imports another target module before defining its own target, as vLLM's modules do.
OUTER = "import d3p_inner\n\n\ndef outer():\n    return 'outer'\n"
# A module whose body takes a while: other threads see it in sys.modules, half executed.
SLOW = "import time\n\ntime.sleep(0.3)\n\n\ndef slow():\n    return 'slow'\n"
FAST = "def fast():\n    return 'fast'\n"


@pytest.fixture
def modules(tmp_path):
    for name, source in (("d3p_inner", INNER), ("d3p_outer", OUTER), ("d3p_slow", SLOW), ("d3p_fast", FAST)):
        write_target(tmp_path, name, source)

    def env(*targets, **extra):
        manifest = write_manifest(tmp_path, {"targets": list(targets)})
        return {"env": {"DRAMA3_PATCHES": "1", "DRAMA3_PATCHES_MANIFEST": str(manifest), **extra},
                "pythonpath": [tmp_path]}

    return env


def _patch_state() -> list:
    import drama3_patches

    st = drama3_patches.status()["patches"][0]
    return [st["state"], st["reason"]]


def nested_import() -> list:
    import d3p_outer

    import d3p_inner

    return [d3p_outer.outer(), d3p_inner.inner(), *_patch_state()]


def eight_threads_import() -> list:
    import importlib
    import threading

    barrier = threading.Barrier(8)
    names = ["d3p_slow", "d3p_fast"] * 4

    def work(name):
        barrier.wait()
        importlib.import_module(name)

    threads = [threading.Thread(target=work, args=(n,)) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    import d3p_fast
    import d3p_slow

    return [d3p_slow.slow(), d3p_fast.fast(), *_patch_state()]


def test_a_target_module_importing_another_is_not_drift(modules):
    ctx = modules("d3p_inner:inner", "d3p_outer:outer")
    assert call(nested_import, **ctx) == ["outer [patched]", "inner [patched]", "applied", "patched"]


def test_eight_threads_importing_targets_at_once_apply_the_patch(modules):
    # Before: the fast module's trigger found the slow one half executed and failed the patch as drift.
    ctx = modules("d3p_slow:slow", "d3p_fast:fast")
    assert call(eight_threads_import, **ctx) == ["slow [patched]", "fast [patched]", "applied", "patched"]


def fork_while_locks_are_held(report_dir: str) -> list:
    """Fork while other threads hold the engine's lock, a patch's lock and the report lock."""
    import os
    import threading

    import d3p_fast  # noqa: F401 (patched: the engine and its records exist)

    import drama3_patches
    import drama3_patches.engine as engine
    from drama3_patches.engine import state

    eng = engine.get_engine()
    locks = [engine._ENGINE_LOCK, eng._init_lock, next(iter(eng.records.values())).lock, state._report_lock]
    release = threading.Event()
    held = []
    for lock in locks:
        ready = threading.Event()

        def hold(lock=lock, ready=ready):
            with lock:
                ready.set()
                release.wait(60)

        threading.Thread(target=hold, daemon=True).start()
        held.append(ready.wait(10))
    pid = os.fork()
    if pid == 0:
        done = threading.Event()

        def child():
            engine._ENGINE = None
            engine.get_engine()  # the engine lock
            engine._ENGINE = eng
            drama3_patches.apply()  # the patch lock
            state.write_report(eng)  # the report lock
            done.set()

        threading.Thread(target=child, daemon=True).start()
        os._exit(0 if done.wait(20) else 3)
    _, status = os.waitpid(pid, 0)
    release.set()
    return [all(held), os.waitstatus_to_exitcode(status), f"{state.host_label()}-{pid}.json" in os.listdir(report_dir)]


def test_a_fork_while_other_threads_hold_the_engine_locks_does_not_deadlock_the_child(modules, tmp_path):
    # exit 3: the child was still waiting for a lock after 20 s
    reports = tmp_path / "reports"
    ctx = modules("d3p_fast:fast", DRAMA3_PATCHES_REPORT_DIR=str(reports))
    assert call(fork_while_locks_are_held, str(reports), timeout=120, **ctx) == [True, 0, True]

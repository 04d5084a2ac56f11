"""Tier 1: what a process's report says about the process, and that its last counts reach it.

Reports name the process (multiprocessing's name, vLLM's log name, parent pid, start) and the
role, stage and rank those names tell, so that ``/metrics`` and ``status --collect`` can tell a
stage-0 worker of rank 1 from the engine core of stage 1. A child started by fork or forkserver
ends through ``os._exit`` (after ``multiprocessing.util._exit_function``), which skips ``atexit``:
its last counts, still waiting for their flush, must be written there too.
"""

from __future__ import annotations

import pytest

from support.exits import EVENT, multiprocessing_child, named_tree, plain_fork_child
from support.selftest import write_manifest, write_target
from support.subproc import call


@pytest.fixture
def enabled(tmp_path):
    write_target(tmp_path)
    manifest = write_manifest(tmp_path, {"targets": ["d3p_target:greet"]})
    return {"env": {"DRAMA3_PATCHES": "1", "DRAMA3_PATCHES_MANIFEST": str(manifest),
                    "DRAMA3_PATCHES_REPORT_DIR": str(tmp_path / "reports")},
            "pythonpath": [tmp_path]}


@pytest.mark.parametrize("method", ["fork", "forkserver", "spawn"])
def test_a_multiprocessing_childs_last_counts_reach_its_report(enabled, method):
    """The child counts and returns at once, well inside the flush delay. fork and forkserver
    children leave through os._exit: before the exit flush their report kept no counts."""
    counts = call(multiprocessing_child, method, 5, **enabled, timeout=120)
    assert counts == {EVENT: 5}


def test_a_child_that_ends_while_the_flush_timer_writes_waits_for_that_write(enabled):
    """The timer thread is a daemon: os._exit would end it half way through its write. The exit
    flush waits for it (the write is slowed by a second, so the child returns inside it)."""
    counts = call(multiprocessing_child, "fork", 3, True, **enabled, timeout=120)
    assert counts == {EVENT: 3}


@pytest.mark.parametrize("how, written", [("sys.exit", True), ("flush-then-os._exit", True), ("os._exit", False)])
def test_a_plain_fork_child_keeps_its_counts_unless_it_ends_by_os_exit_unflushed(enabled, how, written):
    """An os.fork() child outside multiprocessing: sys.exit runs atexit (the counts are written);
    os._exit runs nothing of Python's, so only a flush_counts() before it saves the last counts:
    the one way out that loses them, shown here as the known limit."""
    counts = call(plain_fork_child, how, 4, **enabled, timeout=120)
    assert counts == ({EVENT: 4} if written else {})


TREE = [
    ("StageEngineCoreProc_stage0_replica0", [("VllmWorker-0", [], "fork"), ("VllmWorker-1", [], "fork")], "spawn"),
    ("StageEngineCoreProc_stage1_replica0", [("VllmWorker-0", [], "spawn")], "fork"),
    ("ApiServer_1", [], "spawn"),
    ("OmniCoordinator", [], "forkserver"),
]


def test_each_report_names_its_process_role_stage_rank_and_parent(enabled):
    got = call(named_tree, TREE, **enabled, timeout=240)
    reports = {int(pid): proc for pid, proc in got["reports"].items()}
    seen = {int(pid): (ppid, name) for pid, (ppid, name) in got["seen"].items()}
    assert set(reports) == set(seen), "every process of the tree wrote a report"
    me = got["me"]
    shapes = {}
    for pid, proc in reports.items():
        ppid, name = seen[pid]
        # multiprocessing's name and the parent pid, as the process itself saw them
        assert (proc["name"], proc["ppid"]) == (name, ppid), proc
        assert isinstance(proc["start_ticks"], int) and proc["vllm_name"] is None
        parent = "me" if ppid == me else seen[ppid][1] if ppid in seen else "?"
        shapes.setdefault((name, parent), []).append((proc["role"], proc["stage"], proc["rank"]))
    assert shapes == {
        ("MainProcess", "?"): [("other", None, None)],
        ("StageEngineCoreProc_stage0_replica0", "me"): [("engine-core", 0, None)],
        ("StageEngineCoreProc_stage1_replica0", "me"): [("engine-core", 1, None)],
        # a worker knows its rank from its name; its stage is its engine core's (through ppid)
        ("VllmWorker-0", "StageEngineCoreProc_stage0_replica0"): [("worker", None, 0)],
        ("VllmWorker-1", "StageEngineCoreProc_stage0_replica0"): [("worker", None, 1)],
        ("VllmWorker-0", "StageEngineCoreProc_stage1_replica0"): [("worker", None, 0)],
        ("ApiServer_1", "me"): [("api-server", None, None)],
        # forkserver: the parent is multiprocessing's fork server, which writes no report
        ("OmniCoordinator", "?"): [("other", None, None)],
    }, shapes


def vllm_named() -> dict:
    """vLLM's log name set through vLLM's own function, in a process multiprocessing calls MainProcess."""
    from vllm.logger import set_vllm_process_name

    from drama3_patches.engine.state import process_identity

    out = {}
    for name in ("APIServer", "Worker_TP1", "Worker_DP0_TP1_EP1", "StageEngineCoreProc_stage1_replica0_DP0",
                 "DPCoordinator"):
        set_vllm_process_name(name)
        ident = process_identity()
        out[name] = [ident["vllm_name"], ident["role"], ident["stage"]]
    return out


@pytest.mark.vllm
def test_vllms_log_name_tells_the_role_where_multiprocessing_does_not():
    got = call(vllm_named, timeout=120)
    assert got == {
        "APIServer": ["APIServer", "api-server", None],
        "Worker_TP1": ["Worker_TP1", "worker", None],
        "Worker_DP0_TP1_EP1": ["Worker_DP0_TP1_EP1", "worker", None],
        "StageEngineCoreProc_stage1_replica0_DP0": ["StageEngineCoreProc_stage1_replica0_DP0", "engine-core", 1],
        "DPCoordinator": ["DPCoordinator", "other", None],
    }

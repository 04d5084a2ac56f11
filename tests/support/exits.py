"""Children that count and end at once, each way a serving process can end; and small process
trees named as vLLM names its processes. Module-level, so spawn and forkserver children find them
(as ``support.exits``: ``subproc.call`` loads this file by path, under another name).

They run with ``DRAMA3_PATCHES=1``, the self-test manifest and target (``support.selftest``) and a
report folder: importing ``d3p_target`` applies the self-test patch, which writes the report.
"""

from __future__ import annotations

import json
import os
import sys

EVENT = "preemptions"


def count_and_return(n: int) -> None:
    """A multiprocessing child: count ``n`` and return, well inside the counts' flush delay."""
    import d3p_target  # noqa: F401 (patched here: the report is written, without counts)

    from drama3_patches.engine import state

    state.count(EVENT, n)


def count_and_return_while_the_timer_writes(n: int) -> None:
    """Count, then return while the flush timer is writing the report: a slow disk, made here by a
    writer that waits a second before the engine's own write."""
    import time

    import d3p_target  # noqa: F401

    from drama3_patches.engine import state

    real = state.write_report

    def slow(engine):
        time.sleep(1.0)
        real(engine)

    state.write_report = slow
    state.count(EVENT, n)
    time.sleep(state.FLUSH_DELAY_S + 0.3)  # the timer has fired and is inside the slow write


def report_counts(reports: str, pid: int) -> dict | None:
    """The counts of process ``pid``'s report, None when it wrote none."""
    from drama3_patches.engine.state import host_label

    path = os.path.join(reports, f"{host_label()}-{pid}.json")
    if not os.path.exists(path):
        return None
    with open(path) as fh:
        return json.load(fh).get("counts")


def multiprocessing_child(method: str, n: int, during_write: bool = False) -> dict | None:
    """The counts a multiprocessing child of start method ``method`` left in its report (with
    ``during_write``, it ends while the flush timer is writing)."""
    import multiprocessing

    from support.exits import count_and_return, count_and_return_while_the_timer_writes

    target = count_and_return_while_the_timer_writes if during_write else count_and_return

    ctx = multiprocessing.get_context(method)
    child = ctx.Process(target=target, args=(n,))
    child.start()
    child.join(120)
    assert child.exitcode == 0, child.exitcode
    return report_counts(os.environ["DRAMA3_PATCHES_REPORT_DIR"], child.pid)


def plain_fork_child(how: str, n: int) -> dict | None:
    """The counts an ``os.fork()`` child left when it ended by ``how``: ``sys.exit``, ``os._exit``,
    or ``flush_counts()`` then ``os._exit``."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        try:
            count_and_return(n)
            if how == "flush-then-os._exit":
                from drama3_patches.engine import state

                state.flush_counts()
        except BaseException:
            os._exit(3)
        if how == "sys.exit":
            sys.exit(0)  # unwinds this copy of the parent's stack, then the interpreter exits: atexit runs
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, status
    return report_counts(os.environ["DRAMA3_PATCHES_REPORT_DIR"], pid)


def named_member(children: list, done) -> None:
    """A process of a named tree: import the target and count one event (a spawned process writes
    its report at the import, a forked one, whose parent had patched already, when it ends with a
    count to write), start the children ``[(name, grandchildren, method)]``, wait for them."""
    import multiprocessing

    import d3p_target  # noqa: F401

    from drama3_patches.engine import state

    from support.exits import named_member as target

    state.count(EVENT)
    kids = []
    for name, grandchildren, method in children:
        kid = multiprocessing.get_context(method).Process(target=target, name=name,
                                                          args=(grandchildren, done))
        kid.start()
        kids.append(kid)
    for kid in kids:
        kid.join(120)
    done.put([os.getpid(), os.getppid(), multiprocessing.current_process().name])


def named_tree(tree: list) -> dict:
    """Start ``tree`` (``[(name, children, method)]``) under this process; returns every report's
    ``process`` block by pid, and each member's (parent pid, name) as the member saw them."""
    import multiprocessing

    from drama3_patches.engine import state
    from drama3_patches.report_dir import collect

    done = multiprocessing.get_context("spawn").Queue()
    named_member(tree, done)
    seen = {}
    for _ in range(_size(tree) + 1):
        pid, ppid, name = done.get(timeout=60)
        seen[pid] = [ppid, name]
    state.flush_counts()
    collected = collect(os.environ["DRAMA3_PATCHES_REPORT_DIR"])
    return {"reports": {p["pid"]: p["process"] for p in collected.processes}, "seen": seen, "me": os.getpid()}


def _size(tree: list) -> int:
    return sum(1 + _size(children) for _, children, _ in tree)

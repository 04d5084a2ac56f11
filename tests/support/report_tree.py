"""A serving deployment's process tree in miniature, each process writing its real report.

multiprocessing children (fork) named as vLLM-Omni and vLLM name theirs: an engine core per stage
(``StageEngineCoreProc_stage0_replica0``) starting its workers (``VllmWorker-0``, ...), vLLM's log
name set through vLLM's own ``vllm.logger.set_vllm_process_name`` where given (``Worker_TP1``).
Each runs the real engine: ``drama3_patches.status()`` settles the manifest's patches, which
writes the process's report, and ``engine.state.count`` counts its events. The parent of the tree
plays the API server (it is the process that serves ``/metrics`` in the tests).

A node is ``(process name, vLLM log name or None, {event: n}, [child nodes], stays)``: ``stays``
False makes it end (normally) once its report is written.
"""

from __future__ import annotations

import os

# Stage 0 at tensor parallel 2 and stage 1 at 1, as the rehearsal serves Drama 3.
STAGE0_COUNTS = {"preemptions": 3, "resumes": 3, "resumes_verified": 2, "tp_steps_checked": 40}
TREE = [
    ("StageEngineCoreProc_stage0_replica0", None, {}, [
        ("VllmWorker-0", "Worker_TP0", STAGE0_COUNTS, [], True),
        ("VllmWorker-1", "Worker_TP1", STAGE0_COUNTS, [], True),
    ], True),
    ("StageEngineCoreProc_stage1_replica0", None, {}, [
        ("VllmWorker-0", "Worker", {}, [], True),
    ], True),
]


def count_nodes(tree) -> int:
    return sum(1 + count_nodes(node[3]) for node in tree)


def member(ready, stop, counts: dict, vllm_name, children, stays: bool) -> None:
    """One process of the tree (multiprocessing gave it its name). ``stop`` is a pipe's read end and,
    in the tree's first level, its write end (None below: closed before they fork): a staying
    process waits for the read end's end of file, which comes when the tree's parent closes its
    write end, or dies (so a killed test leaves no process behind)."""
    import multiprocessing

    import drama3_patches
    from drama3_patches.engine import get_engine, state

    if stop[1] is not None:
        os.close(stop[1])  # the tree's parent's copy is the only one left open

    if vllm_name:
        from vllm.logger import set_vllm_process_name

        set_vllm_process_name(vllm_name)
    drama3_patches.status()  # the patches settle here (skipped, pending)
    # A fork of a process whose patches had settled changes no state, which is what writes a report:
    # written here, by the engine's own writer, as at the first change of a real process.
    state.write_report(get_engine())
    for name, n in counts.items():
        state.count(name, n)
    state.flush_counts()  # the counts are in the report before the tree says it is ready
    kids = start(children, ready, (stop[0], None), multiprocessing.get_context("fork"))
    ready.put([os.getpid(), multiprocessing.current_process().name])
    if stays:
        while os.read(stop[0], 1):
            pass
    for kid in kids:
        kid.join(60)


def start(tree, ready, stop, ctx) -> list:
    kids = []
    for name, vllm_name, counts, children, stays in tree:
        kid = ctx.Process(target=member, name=name, args=(ready, stop, counts, vllm_name, children, stays))
        kid.start()
        kids.append(kid)
    return kids


class Tree:
    """The started processes; :meth:`stop` ends the staying ones and waits for them."""

    def __init__(self, tree, extra=()):
        import multiprocessing

        ctx = multiprocessing.get_context("fork")
        ready = ctx.Queue()
        self._stop = os.pipe()
        self.kids = start([*tree, *extra], ready, self._stop, ctx)
        self.pids = {}  # pid -> multiprocessing name, once each process wrote its report
        for _ in range(count_nodes([*tree, *extra])):
            pid, name = ready.get(timeout=120)
            self.pids[pid] = name
        os.close(self._stop[0])

    def stop(self) -> None:
        if self._stop is not None:
            os.close(self._stop[1])
            self._stop = None
        for kid in self.kids:
            kid.join(60)


def grow(tree=TREE, extra=()) -> Tree:
    """Start ``tree`` (and the ``extra`` nodes) under this process."""
    return Tree(tree, extra)

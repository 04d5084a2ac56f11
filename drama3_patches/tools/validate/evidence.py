"""What the deployment's own processes say: their patch reports, runtime counts and log lines.

Reports are read through ``tools.report.collect`` (regular files of this user or root, bounded,
checked field by field) and only those of this run count: written on this host, after the run
began; a process's role is what its report says it is (``engine.state.process_identity``), else
what the server's log told (``logscan.Roles``).
"""

from __future__ import annotations

from dataclasses import dataclass

from drama3_patches.engine.state import EVENTS

# Runtime counters the patches keep per process (engine.state.count), read by the checks.
COUNTERS = EVENTS

# Applied in every stage-0 worker of an Ascend deployment (and of the CPU rehearsal, whose
# platform is forced to npu); the tensor-parallel pair too where stage 0 spans ranks.
STAGE0_PATCHES = ("tower-sampler-eager", "preemption-host-copy", "gdn-backbone-ascend")
TP_PATCHES = ("fish-omni-tensor-parallel", "fish-omni-tower-tp-split", "fish-omni-tp-frames-check")

@dataclass
class Process:
    pid: int
    role: str
    enabled: bool
    states: dict  # patch id -> state
    counts: dict  # counter -> int


def processes(report_dir: str, roles: dict, since: float | None = None,
              host: str | None = None) -> tuple[list[Process], list[str]]:
    """Every readable process report of this run, with its role; and the notes on reports that were
    skipped. ``since``/``host``: a report last written before the run began, or on another host,
    is an earlier run's or another machine's, and is skipped with a note."""
    import os

    from drama3_patches.tools import report

    if not os.path.isdir(report_dir):  # no process enabled the patches, so none made the folder
        return [], []
    from drama3_patches.report_dir import inherit_stages

    collected = report.collect(report_dir)
    out, notes = [], []
    for data in inherit_stages(collected.processes):
        written = data.get("written_at")
        if host is not None and data.get("host") != host:
            notes.append(f"pid {data['pid']}: a report of host {data.get('host')!r}, not this one ({host})")
            continue
        if since is not None and (not isinstance(written, (int, float)) or written < since):
            notes.append(f"pid {data['pid']}: written before this run began (an earlier run's)")
            continue
        counts = data.get("counts") if isinstance(data.get("counts"), dict) else {}
        out.append(Process(
            pid=data["pid"], role=_role(data, roles.get(data["pid"])), enabled=bool(data.get("enabled")),
            states={p["id"]: p["state"] for p in data["patches"]},
            counts={k: v for k, v in counts.items() if isinstance(v, int) and not isinstance(v, bool)},
        ))
    notes = [f"{path}: {why}" for path, why in collected.skipped] + list(collected.notes) + notes
    return out, notes


def _role(data: dict, from_log: str | None) -> str:
    """The process's role: what its own report says it is (its names, its engine core's stage),
    else what the log's prefixes and loading lines told."""
    ident = data.get("process") if isinstance(data.get("process"), dict) else {}
    role, stage, rank = ident.get("role"), ident.get("stage"), ident.get("rank")
    if role == "api-server":
        return role
    if role == "engine-core" and stage is not None:
        return f"engine-core stage {stage}"
    if role == "worker" and stage is not None:
        return f"worker stage {stage} rank {rank or 0}"
    return from_log or "other (no log prefix)"


def stage0_count(procs: list[Process], name: str) -> int:
    """A counter of stage 0's model: every rank runs the same steps, so the smallest rank's figure
    (a rank that counted less is the one to look at). ``resumes_verified`` is judged per rank,
    not per counter: the smallest resume count less the largest number of resumes any one rank
    left unverified (at least 0), so it equals ``resumes`` only where every rank verified every
    resume it made, and a rank's unverified resume is not hidden by another rank's fewer resumes."""
    workers = [p for p in procs if p.role.startswith("worker stage 0")]
    if not workers:
        return 0
    if name == "resumes_verified":
        unverified = max(p.counts.get("resumes", 0) - p.counts.get("resumes_verified", 0) for p in workers)
        return max(0, min(p.counts.get("resumes", 0) for p in workers) - max(0, unverified))
    return min(p.counts.get(name, 0) for p in workers)


def patch_table(procs: list[Process], tp: int) -> tuple[bool, list[str]]:
    """(all as expected, problem lines): each role reported, no patch failed anywhere, and each
    stage-0 worker applied what an Ascend stage 0 needs."""
    problems = []
    roles = [p.role for p in procs]
    if not procs:
        return False, ["no process wrote a report: is DRAMA3_PATCHES=1 exported for the server?"]
    for want in ("api-server", "engine-core stage 0", "engine-core stage 1"):
        if want not in roles:
            problems.append(f"no report from the {want}")
    workers0 = [p for p in procs if p.role.startswith("worker stage 0")]
    if len(workers0) != tp:
        problems.append(f"{len(workers0)} stage-0 worker report(s), {tp} expected (tensor parallel {tp})")
    if not any(r.startswith("worker stage 1") for r in roles):
        problems.append("no report from a stage-1 worker")
    for p in procs:
        failed = sorted(i for i, s in p.states.items() if s == "failed")
        if failed:
            problems.append(f"pid {p.pid} ({p.role}): failed {', '.join(failed)}")
        if not p.enabled:
            problems.append(f"pid {p.pid} ({p.role}): patches not enabled")
    need = STAGE0_PATCHES + (TP_PATCHES if tp > 1 else ())
    for p in workers0:
        missing = [i for i in need if p.states.get(i) != "applied"]
        if missing:
            problems.append(f"pid {p.pid} ({p.role}): not applied: "
                            + ", ".join(f"{i} ({p.states.get(i, 'absent')})" for i in missing))
    return not problems, problems

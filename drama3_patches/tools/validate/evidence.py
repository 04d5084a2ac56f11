"""What the deployment's own processes say: their patch reports, runtime counts and log lines.

Reports are read through ``tools.report.collect`` (regular files of this user or root, bounded,
checked field by field); roles come from the server's log (``server.process_roles``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Runtime counters the patches keep per process (engine.state.count), read by the checks.
COUNTERS = ("preemptions", "resumes", "resumes_verified", "tp_steps_checked")

# Applied in every stage-0 worker of an Ascend deployment (and of the CPU rehearsal, whose
# platform is forced to npu); the tensor-parallel pair too where stage 0 spans ranks.
STAGE0_PATCHES = ("tower-sampler-eager", "preemption-host-copy", "gdn-backbone-ascend")
TP_PATCHES = ("fish-omni-tensor-parallel", "fish-omni-tower-tp-split", "fish-omni-tp-frames-check")

# A line of the server's log that no healthy run prints: (what, pattern). The first two count
# wherever they appear; the others only outside INFO / WARNING / DEBUG records, whose advice
# ("... will cause a CUDA array out-of-bounds error") names failures that did not happen.
ANYWHERE = (
    ("traceback", re.compile(r"Traceback \(most recent call last\)")),
    ("runtime check", re.compile(r"TensorParallelDrift|ResumedHistoryMismatch")),
)
BAD_LINES = (
    ("device error", re.compile(r"\b(ACL|aclnn|AclNN|CANN|NPU|CUDA|HBM)\b.*\b(error|failed|fault)\b|"
                                r"\bE[ZEHLKRJ]\d{4}\b|device-side assert|RuntimeError: .*(npu|NPU|device)")),
    ("collective error", re.compile(r"\b(HCCL|NCCL|hccl|nccl|gloo|Gloo)\b.*\b(error|timeout|timed out|failed)\b|"
                                    r"Connection reset by peer|DistBackendError|DistNetworkError")),
    ("out of memory", re.compile(r"out of memory|OutOfMemoryError", re.IGNORECASE)),
    ("engine died", re.compile(r"EngineDeadError|Engine core.*(died|failed)|worker.*died unexpectedly",
                               re.IGNORECASE)),
)


@dataclass
class Process:
    pid: int
    role: str
    enabled: bool
    states: dict  # patch id -> state
    counts: dict  # counter -> int


def processes(report_dir: str, roles: dict) -> tuple[list[Process], list[str]]:
    """Every readable process report, with its role; and the notes on reports that were skipped."""
    import os

    from drama3_patches.tools import report

    if not os.path.isdir(report_dir):  # no process enabled the patches, so none made the folder
        return [], []
    collected = report.collect(report_dir)
    out = []
    for data in collected.processes:
        counts = data.get("counts") if isinstance(data.get("counts"), dict) else {}
        out.append(Process(
            pid=data["pid"], role=roles.get(data["pid"], "other (no log prefix)"), enabled=bool(data.get("enabled")),
            states={p["id"]: p["state"] for p in data["patches"]},
            counts={k: v for k, v in counts.items() if isinstance(v, int) and not isinstance(v, bool)},
        ))
    notes = [f"{path}: {why}" for path, why in collected.skipped] + list(collected.notes)
    return out, notes


def stage0_count(procs: list[Process], name: str) -> int:
    """A counter of stage 0's model: every rank runs the same steps, so the smallest rank's figure
    (a rank that counted less is the one to look at)."""
    ranks = [p.counts.get(name, 0) for p in procs if p.role.startswith("worker stage 0")]
    return min(ranks) if ranks else 0


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


_ADVICE = re.compile(r"^\s*(\([\w.-]+ pid=\d+\)\s*)?(INFO|WARNING|DEBUG)\b")


def bad_lines(text: str, limit: int = 12) -> tuple[int, list[str]]:
    """(how many lines match ANYWHERE or, outside advice records, BAD_LINES; the first ``limit``
    of them with what they are)."""
    count, shown = 0, []
    for line in text.splitlines():
        for what, pattern in ANYWHERE + (() if _ADVICE.match(line) else BAD_LINES):
            if pattern.search(line):
                count += 1
                if len(shown) < limit:
                    shown.append(f"{what}: {line.strip()[:300]}")
                break
    return count, shown

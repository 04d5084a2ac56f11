"""Render status as a table, and collect the per-process report files."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [len(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))
    # The last column is free text: do not pad it.
    def line(cells):
        return "  ".join(c.ljust(widths[i]) if i < len(cells) - 1 else c for i, c in enumerate(cells)).rstrip()

    out = [line(headers), line(["-" * w for w in widths])]
    out.extend(line(r) for r in rows)
    return "\n".join(out)


def _guard(patch: dict) -> str:
    req = ", ".join(f"{d}{s}" for d, s in patch.get("requires", {}).items()) or "-"
    return f"{'/'.join(patch.get('platforms', [])) or '-'}; {req}"


def render_status(data: dict) -> str:
    versions = ", ".join(f"{d} {v or '(not installed)'}" for d, v in data["versions"].items())
    head = [
        f"drama3-patches: {'enabled' if data['enabled'] else 'disabled'}; platform {data['platform']}; pid {data.get('pid', '?')}",
        f"installed: {versions}",
        "",
    ]
    rows = []
    for p in data["patches"]:
        rows.append([p["id"], p["state"], _guard(p), p["reason"]])
        for target in p["targets"]:
            ts = p.get("target_states", {}).get(target, {})
            note = ts.get("state", "")
            if ts.get("aliases"):
                note += f" (also rebound: {', '.join(ts['aliases'])})"
            rows.append(["", "", "  " + target, note])
    return "\n".join(head) + _table(["PATCH", "STATE", "GUARD / TARGETS", "REASON"], rows)


@dataclass
class Collected:
    processes: list = field(default_factory=list)
    skipped: list = field(default_factory=list)  # (file, why)


def _valid_report(data) -> str | None:
    if not isinstance(data, dict):
        return "not a JSON object"
    if not isinstance(data.get("patches"), list):
        return "no 'patches' list"
    for p in data["patches"]:
        if not isinstance(p, dict) or not {"id", "state", "reason"} <= set(p):
            return "a patch entry lacks id/state/reason"
    return None


def collect(directory: str) -> Collected:
    """Read every ``<pid>.json`` of a report directory; a corrupt file is skipped with the reason.

    Raises OSError when the directory itself cannot be read.
    """
    names = sorted(os.listdir(directory))
    result = Collected()
    for name in names:
        if not name.endswith(".json"):
            continue
        path = os.path.join(directory, name)
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, UnicodeDecodeError) as exc:
            result.skipped.append((path, f"unreadable: {exc}"))
            continue
        except json.JSONDecodeError as exc:
            result.skipped.append((path, f"not valid JSON: {exc}"))
            continue
        problem = _valid_report(data)
        if problem:
            result.skipped.append((path, problem))
            continue
        data.setdefault("pid", name[:-5])
        result.processes.append(data)
    result.processes.sort(key=lambda d: str(d.get("pid")))
    return result


def render_collected(c: Collected, directory: str) -> str:
    if not c.processes:
        return f"no process reports in {directory}"
    rows = []
    for proc in c.processes:
        argv = proc.get("argv") or []
        what = " ".join(str(a) for a in argv)[:60] if argv else "?"
        for p in proc["patches"]:
            rows.append([str(proc.get("pid")), str(proc.get("platform", "?")), p["id"], p["state"], p["reason"]])
        rows.append([" ", "", f"(process: {what})", "", ""])
    summary = {}
    for proc in c.processes:
        for p in proc["patches"]:
            if p["state"] == "applied":
                summary.setdefault(p["id"], []).append(str(proc.get("pid")))
    lines = [_table(["PID", "PLATFORM", "PATCH", "STATE", "REASON"], rows), ""]
    lines.append(f"{len(c.processes)} process report(s) in {directory}")
    for pid_list_id, pids in summary.items():
        lines.append(f"  {pid_list_id}: applied in pid {', '.join(pids)}")
    return "\n".join(lines)

"""Rendering for the operator tools: tables, byte sizes, check lines; and the per-process status reports.

``status``, ``list``, ``plan`` and ``doctor`` print through the helpers here, so
a table or a size reads the same in every command.
"""

from __future__ import annotations

import json
import os
import textwrap
from dataclasses import dataclass, field

GIB = 1024 ** 3
MIB = 1024 ** 2


def table(rows: list[list[str]], headers: list[str] | None = None, indent: str = "") -> str:
    """Columns two spaces apart; a header row is underlined with dashes. The last column is free
    text and is not padded."""
    every = ([headers] if headers else []) + [list(r) for r in rows]
    widths: list[int] = []
    for row in every:
        for i, cell in enumerate(row):
            if i == len(widths):
                widths.append(0)
            widths[i] = max(widths[i], len(cell))

    def line(cells):
        return (indent + "  ".join(c.ljust(widths[i]) if i < len(cells) - 1 else c
                                   for i, c in enumerate(cells))).rstrip()

    out = [line(headers), line(["-" * w for w in widths[:len(headers)]])] if headers else []
    out.extend(line(r) for r in rows)
    return "\n".join(out)


def format_bytes(n: float, width: int = 8) -> str:
    """GiB, or MiB below 1 GiB so that small figures do not print as 0.00."""
    if abs(n) < GIB:
        return f"{n / MIB:{width}.2f} MiB"
    return f"{n / GIB:{width}.2f} GiB"


def check_lines(checks) -> list[str]:
    """``[ok]`` / ``[FAIL]`` lines of objects with ``ok``, ``name``, ``detail``, ``fix``; a fix under
    its failure."""
    out = []
    for c in checks:
        out.append(f"  [{'ok' if c.ok else 'FAIL'}] {c.name}: {c.detail}")
        if not c.ok and c.fix:
            out.append(f"         fix: {c.fix}")
    return out


def field_lines(label: str, text: str, indent: int = 4, width: int = 96) -> str:
    """``label: text`` wrapped, continuation lines under the text."""
    return textwrap.fill(text, width=width, initial_indent=f"{' ' * indent}{label}: ",
                         subsequent_indent=" " * (len(label) + indent + 2))


def _guard(patch: dict) -> str:
    req = ", ".join(f"{d}{s}" for d, s in patch.get("requires", {}).items()) or "-"
    return f"{'/'.join(patch.get('platforms', [])) or '-'}; {req}"


def render_status(data: dict) -> str:
    by = data.get("provided_by", {})
    versions = ", ".join(f"{d} {v or '(not installed)'}" + (f" (distribution {by[d]})" if d in by else "")
                         for d, v in data["versions"].items())
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
    return "\n".join(head) + table(rows, ["PATCH", "STATE", "GUARD / TARGETS", "REASON"])


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
    lines = [table(rows, ["PID", "PLATFORM", "PATCH", "STATE", "REASON"]), ""]
    lines.append(f"{len(c.processes)} process report(s) in {directory}")
    for pid_list_id, pids in summary.items():
        lines.append(f"  {pid_list_id}: applied in pid {', '.join(pids)}")
    return "\n".join(lines)

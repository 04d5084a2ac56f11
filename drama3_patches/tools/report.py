"""Rendering for the operator tools: tables, byte sizes, check lines; and the per-process status reports.

``status``, ``list``, ``plan`` and ``doctor`` print through the helpers here, so
a table or a size reads the same in every command.
"""

from __future__ import annotations

import textwrap

# The folder's reader lives outside tools/ (the /metrics collector uses it in the API server);
# ``collect`` stays importable from here for the commands.
from drama3_patches.report_dir import Collected, collect, liveness  # noqa: F401 (collect)


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
    """``[ok]`` / ``[FAIL]`` / ``[warn]`` lines of objects with ``ok``, ``name``, ``detail``, ``fix``
    (and optionally ``warning``); a fix under its failure."""
    out = []
    for c in checks:
        mark = "ok" if c.ok else "warn" if getattr(c, "warning", False) else "FAIL"
        out.append(f"  [{mark}] {c.name}: {c.detail}")
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
        f"drama3-patches: {'enabled' if data['enabled'] else 'disabled'}; platform {data['platform']}; pid {data.get('pid', '?')}"
        f"; activated by {data.get('activated_by') or 'nothing'}",
        f"installed: {versions}",
        "",
    ]
    from drama3_patches.tools.fingerprint import change_note

    rows = []
    for p in data["patches"]:
        rows.append([p["id"], p["state"], _guard(p), p["reason"]])
        changed = {c["target"]: c for c in p.get("changed_since_review", [])}
        for target in p["targets"]:
            ts = p.get("target_states", {}).get(target, {})
            note = ts.get("state", "")
            if ts.get("aliases"):
                note += f" (also rebound: {', '.join(ts['aliases'])})"
            if target in changed:
                note = "; ".join(filter(None, [note, change_note(changed[target])]))
            rows.append(["", "", "  " + target, note])
    return "\n".join(head) + table(rows, ["PATCH", "STATE", "GUARD / TARGETS", "REASON"])


def _liveness(proc: dict, here: str) -> str:
    """" (gone)" only for a process of this host that is not running (or whose pid another process
    now has): a pid of another host (or of a report that names no host) says nothing here."""
    if proc.get("host") is None:
        return " (host?)"
    return " (gone)" if liveness(proc, here) == "gone" else ""


def render_collected(c: Collected, directory: str) -> str:
    """The collected reports as a table grouped by host; every piece of report text shown without
    control characters."""
    from drama3_patches.engine.state import host_label
    from drama3_patches.tools.files import printable

    if not c.processes:
        return f"no process reports in {printable(directory)}"
    here = host_label()
    rows = []
    hosts: dict[str, list[str]] = {}
    for proc in c.processes:
        host = printable(proc.get("host") or "?")
        if host not in hosts:
            hosts[host] = []
            rows.append([f"host {host}" + (" (this host)" if host == here else ""), "", "", "", ""])
        hosts[host].append(str(proc["pid"]))
        argv = proc.get("argv") or []
        what = printable(" ".join(argv))[:60] if argv else "?"
        ident = proc.get("process") or {}
        if ident.get("role"):  # validated by the reader: text and whole numbers
            where = "".join(f" {k} {ident[k]}" for k in ("stage", "rank") if ident.get(k) is not None)
            what = f"{printable(ident['role'])}{where}, ppid {ident.get('ppid', '?')}: {what}"
        pid = "  " + str(proc["pid"]) + _liveness(proc, here)
        for p in proc["patches"]:
            rows.append([pid, printable(proc.get("platform", "?")), printable(p["id"]), printable(p["state"]),
                         printable(p["reason"])])
        rows.append([" ", "", f"(process: {what})", "", ""])
    summary = {}
    for proc in c.processes:
        for p in proc["patches"]:
            if p["state"] == "applied":
                summary.setdefault(printable(p["id"]), []).append(f"{printable(proc.get('host') or '?')}:{proc['pid']}")
    lines = [table(rows, ["HOST / PID", "PLATFORM", "PATCH", "STATE", "REASON"]), ""]
    lines.append(f"{len(c.processes)} process report(s) from {len(hosts)} host(s) in {printable(directory)}")
    for host, pids in hosts.items():
        lines.append(f"  host {host}: {len(pids)} process(es), pid {', '.join(pids)}")
    for pid_list_id, pids in summary.items():
        lines.append(f"  {pid_list_id}: applied in {', '.join(pids)}")
    return "\n".join(lines)

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


MAX_REPORT_BYTES = 1024 ** 2  # a report is a few kilobytes per patch
MAX_REPORT_FILES = 10000
MAX_PATCHES = 1000
HOST_MAX = 64  # as drama3_patches.engine.state.HOST_MAX


@dataclass
class Collected:
    processes: list = field(default_factory=list)
    skipped: list = field(default_factory=list)  # (file, why): why names the owner when known
    notes: list = field(default_factory=list)  # about the folder itself


def owner_name(uid: int) -> str:
    try:
        import pwd

        return pwd.getpwuid(uid).pw_name
    except (ImportError, KeyError):
        return "?"


def _owner(uid: int) -> str:
    return f"owner {owner_name(uid)}, uid {uid}"


def _is_str(value) -> bool:
    return isinstance(value, str)


def parse_name(stem: str) -> tuple[str | None, int] | None:
    """``(host, pid)`` of a report name's stem: ``<host>-<pid>`` as processes write it, or the
    older ``<pid>`` (host None); None for anything else. The host part has the characters
    ``host_label`` keeps."""
    host, _, pid = stem.rpartition("-")
    if not (pid.isascii() and pid.isdigit()) or len(pid) > 10:
        return None
    if not _:
        return None, int(pid)
    if not host or len(host) > HOST_MAX or not all(c.isascii() and (c.isalnum() or c in "._") for c in host):
        return None
    return host, int(pid)


def _valid_report(data, stem: str) -> str | None:
    """Why a parsed report cannot be shown (a wrong type where the renderer expects one), or None."""
    if not isinstance(data, dict):
        return "not a JSON object"
    if not isinstance(data.get("patches"), list):
        return "no 'patches' list"
    if len(data["patches"]) > MAX_PATCHES:
        return f"more than {MAX_PATCHES} patch entries"
    for p in data["patches"]:
        if not isinstance(p, dict) or not {"id", "state", "reason"} <= set(p):
            return "a patch entry lacks id/state/reason"
        if not all(_is_str(p[k]) for k in ("id", "state", "reason")):
            return "a patch entry's id, state or reason is not text"
    host, named_pid = parse_name(stem)
    pid = data.get("pid")
    if pid is not None and (isinstance(pid, bool) or not isinstance(pid, int) or pid < 1):
        return f"pid is {type(pid).__name__}, not a process id"
    if pid is not None and pid != named_pid:
        return f"says pid {pid} but is named {stem}.json"
    if "host" in data and (not _is_str(data["host"]) or (host is not None and data["host"] != host)):
        return f"says host {data['host']!r} but is named {stem}.json"
    if "platform" in data and not _is_str(data["platform"]):
        return "platform is not text"
    argv = data.get("argv")
    if argv is not None and (not isinstance(argv, list) or not all(_is_str(a) for a in argv)):
        return "argv is not a list of text"
    if "enabled" in data and not isinstance(data["enabled"], bool):
        return "enabled is not true or false"
    versions = data.get("versions")
    if versions is not None and (not isinstance(versions, dict)
                                 or not all(v is None or _is_str(v) for v in versions.values())):
        return "versions is not a mapping of versions"
    return None


def _folder_notes(directory: str, st) -> list[str]:
    import stat

    notes = []
    me = os.geteuid()
    if st.st_uid not in (me, 0):
        notes.append(f"the folder is {_owner(st.st_uid)}, not you or root")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        notes.append(f"the folder is writable by others (mode {stat.S_IMODE(st.st_mode):o}): only reports of "
                     "trusted owners are shown")
    return notes


def collect(directory: str, trust: tuple = ()) -> Collected:
    """Read every ``<host>-<pid>.json`` (or older ``<pid>.json``) of a report directory; anything
    else is skipped with the reason.

    Fail closed: a report is shown only when it is a regular file (no link followed, no FIFO
    or device opened blocking) of at most ``MAX_REPORT_BYTES``, owned by the user running this,
    by root, or by a uid in ``trust``, whose JSON has the expected field types. A file owned by
    anyone else could have been planted by any local user who can write the folder: it is
    skipped and its owner named. Raises OSError when the directory itself cannot be read.
    """
    from drama3_patches.tools.files import InputError, read_regular

    result = Collected(notes=_folder_notes(directory, os.stat(directory)))
    names = sorted(n for n in os.listdir(directory) if n.endswith(".json"))
    if len(names) > MAX_REPORT_FILES:
        result.notes.append(f"{len(names)} .json files: only the first {MAX_REPORT_FILES} are read")
        names = names[:MAX_REPORT_FILES]
    trusted = {os.geteuid(), 0, *trust}
    for name in names:
        path = os.path.join(directory, name)
        stem = name[:-5]
        try:
            raw, st = read_regular(path, MAX_REPORT_BYTES, "report", follow=False)
        except InputError as exc:
            try:
                who = f" ({_owner(os.lstat(path).st_uid)})"
            except OSError:
                who = ""
            result.skipped.append((path, f"{str(exc).removeprefix(path + ': ')}{who}"))
            continue
        who = _owner(st.st_uid)
        if st.st_uid not in trusted:
            result.skipped.append((path, f"{who}: not you or root, so possibly planted; "
                                         f"--trust {owner_name(st.st_uid)} shows it"))
            continue
        if parse_name(stem) is None:
            result.skipped.append((path, f"not a <host>-<pid>.json name ({who})"))
            continue
        try:
            data = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as exc:
            result.skipped.append((path, f"unreadable: not UTF-8 ({exc.reason}) ({who})"))
            continue
        except (ValueError, RecursionError) as exc:
            result.skipped.append((path, f"not valid JSON: {exc} ({who})"))
            continue
        problem = _valid_report(data, stem)
        if problem:
            result.skipped.append((path, f"{problem} ({who})"))
            continue
        host, pid = parse_name(stem)
        data.setdefault("pid", pid)
        if host is not None:
            data["host"] = host
        result.processes.append(data)
    # A report of the older name says no host (unless its text does): it sorts first, as "?".
    result.processes.sort(key=lambda d: (d.get("host") or "", d["pid"]))
    return result


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, OSError):
        return True
    return True


def _liveness(proc: dict, here: str) -> str:
    """" (gone)" only for a process of this host that is not running: a pid of another host (or of
    a report that names no host) says nothing here."""
    host = proc.get("host")
    if host is None:
        return " (host?)"
    if host != here:
        return ""
    return "" if _running(proc["pid"]) else " (gone)"


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

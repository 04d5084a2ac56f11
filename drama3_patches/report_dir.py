"""The report folder, read: every process's ``<host>-<pid>.json``, bounded, owner-checked, cached.

``drama3-patches status --collect`` and the ``/metrics`` collector (``drama3_patches.metrics``,
which runs in the API server) read the folder through :func:`collect`, so it lives outside
``tools/``: standard library and the package's bounded reader only.

Fail closed: a report is used only when it is a regular file (no link followed, no FIFO or
device opened blocking) of at most ``MAX_REPORT_BYTES``, owned by the user reading, by root, or
by a trusted uid, whose JSON has the expected field types; type, owner and size are checked from
the entry's ``lstat`` before it is opened (a foreign file costs no open and no read) and again
from ``fstat`` before a byte is read. Anything else is skipped with the reason (for people) and
its kind (``SKIP_KINDS``, for counting). Another user who can write the folder can fill it, so a
collection is bounded: entries looked at, reports and bytes read, newest first; the rest is
counted (``over-limit``, ``unlisted``).

:func:`liveness` says whether a report's process still runs: on this host, by pid and by the
process's start (``/proc/<pid>/stat``), so a pid the kernel handed to a later process does not
keep a dead process's report alive.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass, field
from functools import lru_cache

# _kind, _size: the reader's words for the refusals the lstat screen makes before it would
from drama3_patches.reader import UnreadableFile, _kind, _size, read_regular

MAX_REPORT_BYTES = 1024 ** 2  # a report is a few kilobytes per patch
MAX_REPORT_FILES = 10000  # reports read at most per collection, the newest first
# Folder entries looked at per collection (each ``.json`` one is lstat'ed): another user who can
# write the folder can fill it without bound; beyond this the listing stops.
MAX_LISTED = 2 * MAX_REPORT_FILES
# Bytes of reports read (not from the cache) per /metrics scrape: the collector runs on the API
# server's event loop. Bytes, not seconds: the same files are read whatever the load, so a scrape's
# series do not flap with it. 4 MiB is about 200 processes' reports (~20 KB each) read and parsed
# in some tens of milliseconds; what is left is read at the next scrapes (the cache keeps what was).
SCRAPE_MAX_BYTES = 4 << 20
MAX_PATCHES = 1000
HOST_MAX = 64  # as drama3_patches.engine.state.HOST_MAX

# Why a file was skipped, as a fixed enumeration (a metric label; the text reason is for people).
# over-limit: listed but not read at this collection (past MAX_REPORT_FILES or the byte budget);
# unlisted: 1 when the listing stopped at MAX_LISTED entries (the rest neither looked at nor counted).
SKIP_KINDS = ("link", "not-regular", "too-large", "foreign-owner", "bad-name", "invalid", "unreadable",
              "over-limit", "unlisted")


@dataclass
class Collected:
    processes: list = field(default_factory=list)
    skipped: list = field(default_factory=list)  # (file, why): why names the owner when known
    notes: list = field(default_factory=list)  # about the folder itself
    kinds: dict = field(default_factory=dict)  # SKIP_KINDS entry -> files skipped for it


@lru_cache(maxsize=64)  # one password-database lookup per owner, not per file
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


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


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


def _valid_process(proc) -> str | None:
    """Why a report's ``process`` block (engine.state.process_identity) cannot be used, or None."""
    if not isinstance(proc, dict):
        return "process is not a mapping"
    for key in ("name", "vllm_name", "role"):
        if proc.get(key) is not None and not _is_str(proc[key]):
            return f"process {key} is not text"
    for key in ("ppid", "stage", "rank", "start_ticks"):
        if proc.get(key) is not None and not _is_int(proc[key]):
            return f"process {key} is not a whole number"
    return None


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
    if pid is not None and (not _is_int(pid) or pid < 1):
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
    # counts and written_at are read value by value where they are used (a bad one is ignored there)
    if "process" in data:
        return _valid_process(data["process"])
    return None


def folder_notes(st) -> list[str]:
    notes = []
    me = os.geteuid()
    if st.st_uid not in (me, 0):
        notes.append(f"the folder is {_owner(st.st_uid)}, not you or root")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        notes.append(f"the folder is writable by others (mode {stat.S_IMODE(st.st_mode):o}): only reports of "
                     "trusted owners are shown")
    return notes


class Cache:
    """What :func:`collect` made of each file, kept while the file is the same: same inode, size,
    mtime and ctime (a chown or chmod changes the ctime, so an owner check is never reused across
    one). For one set of trusted owners; entries of files no longer listed are dropped."""

    def __init__(self) -> None:
        self._entries: dict[str, tuple] = {}
        self._trusted: frozenset = frozenset()
        self.hits = 0

    @staticmethod
    def key(st) -> tuple:
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def get(self, name: str, key: tuple, trusted: frozenset):
        if trusted != self._trusted:
            self._entries.clear()
            self._trusted = trusted
        entry = self._entries.get(name)
        if entry is not None and entry[0] == key:
            self.hits += 1
            return entry[1]
        return None

    def put(self, name: str, key: tuple, outcome: tuple) -> None:
        self._entries[name] = (key, outcome)

    def keep_only(self, names) -> None:
        for gone in set(self._entries) - set(names):
            del self._entries[gone]


def _screen(lst, stem: str, trusted: frozenset) -> tuple | None:
    """The skip a file's ``lstat`` already decides, with nothing opened; None when it may be read."""
    if stat.S_ISLNK(lst.st_mode):
        return "skip", f"a symbolic link; not followed ({_owner(lst.st_uid)})", "link", lst
    if not stat.S_ISREG(lst.st_mode):
        return ("skip", f"not a regular file ({_kind(lst.st_mode)}); a report must be one ({_owner(lst.st_uid)})",
                "not-regular", lst)
    if lst.st_uid not in trusted:
        return "skip", (f"{_owner(lst.st_uid)}: not you or root, so possibly planted; "
                        f"--trust {owner_name(lst.st_uid)} shows it"), "foreign-owner", lst
    if lst.st_size > MAX_REPORT_BYTES:
        return ("skip", f"{_size(lst.st_size)}, over the {_size(MAX_REPORT_BYTES)} limit for a report "
                f"({_owner(lst.st_uid)})", "too-large", lst)
    if parse_name(stem) is None:
        return "skip", f"not a <host>-<pid>.json name ({_owner(lst.st_uid)})", "bad-name", lst
    return None


def _read_one(path: str, stem: str, trusted: frozenset, limit: int = MAX_REPORT_BYTES) -> tuple:
    """``("ok", data, stat)`` or ``("skip", why, kind, stat-or-None)`` for one file. Type, size and
    owner are checked again on the open descriptor before a byte is read: the file may have been
    swapped since its ``lstat``."""
    try:
        raw, st = read_regular(path, limit, "report", follow=False, owners=trusted)
    except UnreadableFile as exc:
        why = str(exc).removeprefix(path + ": ")
        if exc.st is None:
            return "skip", why, exc.kind, None
        if exc.kind == "foreign-owner":  # swapped since its lstat: the same words as the screen's
            return _screen(exc.st, stem, trusted)
        return "skip", f"{why} ({_owner(exc.st.st_uid)})", exc.kind, exc.st
    who = _owner(st.st_uid)
    if parse_name(stem) is None:
        return "skip", f"not a <host>-<pid>.json name ({who})", "bad-name", st
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        return "skip", f"unreadable: not UTF-8 ({exc.reason}) ({who})", "invalid", st
    except (ValueError, RecursionError) as exc:
        return "skip", f"not valid JSON: {exc} ({who})", "invalid", st
    problem = _valid_report(data, stem)
    if problem:
        return "skip", f"{problem} ({who})", "invalid", st
    host, pid = parse_name(stem)
    data.setdefault("pid", pid)
    if host is not None:
        data["host"] = host
    return "ok", data, st


def _listing(directory: str, result: Collected) -> list:
    """``(name, path, lstat)`` of the folder's ``.json`` entries, at most ``MAX_LISTED`` entries
    looked at: the rest is counted as one ``unlisted``."""
    found = []
    seen = 0
    with os.scandir(directory) as entries:
        for entry in entries:
            if seen >= MAX_LISTED:
                result.notes.append(f"more than {MAX_LISTED} entries: the rest were not looked at")
                result.kinds["unlisted"] = 1
                break
            seen += 1
            if not entry.name.endswith(".json"):
                continue
            try:
                found.append((entry.name, entry.path, entry.stat(follow_symlinks=False)))
            except OSError:  # gone since listed
                continue
    return found


def collect(directory: str, trust: tuple = (), cache: Cache | None = None, max_bytes: int | None = None) -> Collected:
    """Read every ``<host>-<pid>.json`` (or older ``<pid>.json``) of a report directory; anything
    else is skipped with the reason and its kind.

    Only a regular file of at most ``MAX_REPORT_BYTES`` owned by the user running this, by root,
    or by a uid in ``trust`` is used: a file owned by anyone else could have been planted by any
    local user who can write the folder. Type, owner and size are checked from ``lstat`` before
    the file is opened and again from ``fstat`` before a byte is read. With a :class:`Cache`, a
    file unchanged since the last call is not read again (its parsed report, or the reason it was
    skipped, is reused; the reports returned are then the same objects: treat them as read-only).

    Bounded: at most ``MAX_LISTED`` folder entries looked at, ``MAX_REPORT_FILES`` reports and
    (``max_bytes``) that many bytes read, the newest files first; the rest is counted
    (``over-limit``, ``unlisted``). Raises OSError when the directory itself cannot be read.
    """
    result = Collected(notes=folder_notes(os.stat(directory)))
    listed = _listing(directory, result)
    trusted = frozenset({os.geteuid(), 0, *trust})
    readable = []
    for name, path, lst in listed:
        outcome = _screen(lst, name[:-5], trusted)
        if outcome is None:
            readable.append((name, path, lst))
        else:
            result.skipped.append((path, outcome[1]))
            result.kinds[outcome[2]] = result.kinds.get(outcome[2], 0) + 1
    readable.sort(key=lambda item: (-item[2].st_mtime_ns, item[0]))  # the newest first, when bounded
    budget = max_bytes
    over = 0
    kept = []
    for name, path, lst in readable:
        outcome = cache.get(name, Cache.key(lst), trusted) if cache is not None else None
        if outcome is None:
            if len(kept) >= MAX_REPORT_FILES or (budget is not None and lst.st_size > budget):
                over += 1
                continue
            outcome = _read_one(path, name[:-5], trusted, MAX_REPORT_BYTES if budget is None
                                else min(MAX_REPORT_BYTES, budget))
            st = outcome[-1]
            if budget is not None and (outcome[0] == "ok" or outcome[2] == "invalid"):  # read whole
                budget -= min(st.st_size, budget)
            if cache is not None and st is not None:
                # Keyed by what was read (the open file's fstat), not by the lstat before it.
                cache.put(name, Cache.key(st), outcome)
        if outcome[0] == "ok":
            if len(kept) >= MAX_REPORT_FILES:
                over += 1
                continue
            kept.append(outcome[1])
        else:
            result.skipped.append((path, outcome[1]))
            result.kinds[outcome[2]] = result.kinds.get(outcome[2], 0) + 1
    if over:
        result.kinds["over-limit"] = over
        bound = f"the newest {MAX_REPORT_FILES}" + (f" or {max_bytes} bytes" if max_bytes is not None else "")
        result.notes.append(f"{over} report(s) not read at this collection: past {bound}")
    result.processes = kept
    result.skipped.sort()
    if cache is not None:
        cache.keep_only(name for name, _, _ in readable)
    # A report of the older name says no host (unless its text does): it sorts first, as "?".
    result.processes.sort(key=lambda d: (d.get("host") or "", d["pid"]))
    return result


def start_ticks(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (``/proc/<pid>/stat``), or None where
    that cannot be read. A pid and its start tell one process apart from a later one of the same pid
    (the writer records its own in the report's ``process`` block)."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as fh:
            raw = fh.read(4096)
        # The command name (field 2) is in parentheses and may hold spaces or ')': split after the last.
        return int(raw[raw.rindex(b")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, OSError):
        return True
    return True


# A writer writes its report after it started; a measured start later than the write by more
# than this (the clock-tick and uptime rounding) is another process that got the pid since.
START_SLACK_S = 0.1


def _started_at(ticks: int) -> float | None:
    """The wall-clock time of a start ``ticks`` clock ticks after boot (``/proc/uptime``)."""
    import time

    try:
        with open("/proc/uptime", "rb") as fh:
            uptime = float(fh.read(128).split()[0])
        hz = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - uptime + ticks / hz


def liveness(proc: dict, here: str) -> str:
    """``live``, ``gone`` or ``remote`` for a collected report, seen from host ``here``.

    ``remote``: another host's report (or an older one that names no host): nothing here says
    whether it runs. ``gone``: this host's pid is not running, or the process running under it
    is not the writer: its start differs from the ``start_ticks`` the report recorded, or (a
    report without them) it started after the report was written.
    """
    host = proc.get("host")
    if host is None or host != here:
        return "remote"
    pid = proc["pid"]
    if not running(pid):
        return "gone"
    now = start_ticks(pid)
    if now is None:  # no /proc here, or the process just ended
        return "live" if running(pid) else "gone"
    recorded = (proc.get("process") or {}).get("start_ticks")
    if _is_int(recorded):
        return "live" if recorded == now else "gone"
    written = proc.get("written_at")
    if isinstance(written, (int, float)) and not isinstance(written, bool):
        started = _started_at(now)
        if started is not None and started > written + START_SLACK_S:
            return "gone"
    return "live"


PARENT_HOPS = 3  # a worker, its engine core, (at most) one process between


def inherit_stages(procs: list) -> list:
    """``procs``, where a process that knows no stage takes its nearest ancestor's (a vLLM worker is
    started by its stage's engine core, whose name carries the stage). The reports themselves (the
    reader's cache holds them) are not changed: a changed one is a copy."""
    by_pid = {p["pid"]: p for p in procs}
    out = []
    for proc in procs:
        ident = proc.get("process")
        parent = by_pid.get(ident.get("ppid")) if isinstance(ident, dict) and ident.get("stage") is None else None
        for _ in range(PARENT_HOPS):
            if parent is None:
                break
            stage = (parent.get("process") or {}).get("stage")
            if stage is not None:
                proc = {**proc, "process": {**ident, "stage": stage}}
                break
            parent = by_pid.get((parent.get("process") or {}).get("ppid"))
        out.append(proc)
    return out

"""Retention in the report folder: reports of processes long gone, and temporary files of writers
killed mid-write, removed by the processes that write there.

Each process that writes a report tidies the folder once, right after its first report
(``engine.state``), through the folder's checked descriptor. It removes only:

* a report of this host (``<host>-<pid>.json`` with this host's label in the name and the
  report) whose process is gone (:func:`drama3_patches.report_dir.liveness`: the pid is not
  running, or runs a later process than the start the report recorded), last written more than
  the retention ago. Another host's report, or an older one that names no host, is kept: nothing
  here says whether its process runs.
* a temporary file (``.<pid>.<hex>.tmp``, as ``_bootstrap.replace_file`` names them) last written
  more than the retention ago.

Both only when they are regular files of this user (what it may remove; the folder itself is
private to it), and only if the name still holds the very file checked. The work is bounded per
start: at most ``MAX_NAMES`` names looked at (the collector's own cap), ``MAX_READS`` reports
opened, each at most ``report_dir.MAX_REPORT_BYTES``.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import stat
import time

from drama3_patches import report_dir

MAX_NAMES = report_dir.MAX_REPORT_FILES
MAX_READS = 32
TEMPORARY = re.compile(r"\.\d+\.[0-9a-f]+\.tmp")
_O_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)


def _same(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino, a.st_mtime_ns) == (b.st_dev, b.st_ino, b.st_mtime_ns)


def _remove(dir_fd: int, name: str, checked: os.stat_result) -> bool:
    """Unlink ``name`` if it still is the file checked (a writer may have renamed a new one over it)."""
    try:
        if not _same(os.stat(name, dir_fd=dir_fd, follow_symlinks=False), checked):
            return False
        os.unlink(name, dir_fd=dir_fd)
    except OSError:
        return False
    return True


def _report(dir_fd: int, name: str, checked: os.stat_result):
    """The parsed report ``name`` if it is still the file checked and valid; None otherwise."""
    try:
        fd = os.open(name, _O_READ, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        if not _same(os.fstat(fd), checked):
            return None
        data = os.read(fd, report_dir.MAX_REPORT_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > report_dir.MAX_REPORT_BYTES:
        return None
    try:
        parsed = json.loads(data)
    except ValueError:
        return None
    return None if report_dir._valid_report(parsed, name[:-len(".json")]) else parsed


def sweep(dir_fd: int, host: str, retention_s: float, now: float | None = None) -> dict:
    """Tidy the report folder ``dir_fd`` (checked private) as host ``host``; ``retention_s`` 0 keeps
    everything. Returns what it did: names looked at, reports read, reports and temporaries removed."""
    done = {"names": 0, "read": 0, "reports": 0, "temporaries": 0}
    if retention_s <= 0:
        return done
    cutoff = (time.time() if now is None else now) - retention_s
    me = os.geteuid()
    with os.scandir(dir_fd) as entries:
        for entry in itertools.islice(entries, MAX_NAMES):
            done["names"] += 1
            name = entry.name
            temporary = TEMPORARY.fullmatch(name) is not None
            if not temporary:
                parsed_name = report_dir.parse_name(name[:-len(".json")]) if name.endswith(".json") else None
                if parsed_name is None or parsed_name[0] != host:
                    continue
            try:
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode) or st.st_uid != me or st.st_mtime >= cutoff:
                continue
            if temporary:
                done["temporaries"] += _remove(dir_fd, name, st)
                continue
            if done["read"] >= MAX_READS:
                continue
            done["read"] += 1
            proc = _report(dir_fd, name, st)
            if proc is None or proc.get("host") != host or proc.get("pid") != parsed_name[1]:
                continue
            if report_dir.liveness(proc, host) == "gone":
                done["reports"] += _remove(dir_fd, name, st)
    return done

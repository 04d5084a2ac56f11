"""Tier 1: retention in the report folder (drama3_patches.retention).

A report of this host whose process is gone (pid not running, or running a later process than the
start the report recorded), last written more than the retention ago, is removed, and so is a
writer's old temporary file; everything else stays: live processes, other hosts' and host-less
reports, young files, files of other owners. Each case is one folder, one sweep, and the names
left compared with those expected.
"""

from __future__ import annotations

import json
import os

import pytest

from drama3_patches import retention
from drama3_patches.engine.state import host_label, start_ticks
from support.subproc import call

DAY = 86400.0
OLD = 2 * DAY  # seconds before now an "old" file was last written


def _dead_pid() -> int:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


def _report(folder, name: str, *, host: str | None, pid: int, ticks: int | None, age: float = OLD) -> str:
    data = {"pid": pid, "patches": [], "process": {"name": "x", "vllm_name": None, "role": "other",
                                                   "ppid": 1, "stage": None, "rank": None, "start_ticks": ticks}}
    if host is not None:
        data["host"] = host
    path = os.path.join(folder, name)
    with open(path, "w") as fh:
        json.dump(data, fh)
    _age(path, age)
    return name


def _age(path: str, age: float) -> None:
    then = os.stat(path).st_mtime - age
    os.utime(path, (then, then))


def _sweep(folder, retention_s: float = DAY) -> dict:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return retention.sweep(fd, host_label(), retention_s)
    finally:
        os.close(fd)


@pytest.fixture
def folder(tmp_path):
    d = tmp_path / "reports"
    d.mkdir(mode=0o700)
    return d


def test_a_gone_process_report_older_than_the_retention_is_removed_and_a_live_one_kept(folder):
    here, me = host_label(), os.getpid()
    dead = _dead_pid()
    gone = _report(folder, f"{here}-{dead}.json", host=here, pid=dead, ticks=12345)
    # This process's pid, but another start recorded: the pid was reused by this (later) process.
    reused = _report(folder, f"{here}-{me}.json", host=here, pid=me, ticks=start_ticks(me) - 1)
    done = _sweep(folder)
    assert sorted(os.listdir(folder)) == [], done
    assert done["reports"] == 2, (gone, reused)
    # The negative control: the same report, recording this process's own start, is live and stays.
    live = _report(folder, f"{here}-{me}.json", host=here, pid=me, ticks=start_ticks(me))
    assert _sweep(folder)["reports"] == 0 and os.listdir(folder) == [live]


def test_young_reports_other_hosts_and_hostless_reports_stay(folder):
    here, dead = host_label(), _dead_pid()
    kept = [
        _report(folder, f"{here}-{dead}.json", host=here, pid=dead, ticks=1, age=60.0),  # gone, but young
        _report(folder, f"elsewhere-{dead}.json", host="elsewhere", pid=dead, ticks=1),  # another host
        _report(folder, f"{dead}.json", host=None, pid=dead, ticks=1),  # an older report naming no host
    ]
    done = _sweep(folder)
    assert sorted(os.listdir(folder)) == sorted(kept) and done["reports"] == 0
    # The young one goes once the retention is shorter than its age: the age was what kept it.
    assert _sweep(folder, retention_s=30.0)["reports"] == 1
    assert sorted(os.listdir(folder)) == sorted(kept[1:])


def test_retention_zero_keeps_everything(folder):
    here, dead = host_label(), _dead_pid()
    name = _report(folder, f"{here}-{dead}.json", host=here, pid=dead, ticks=1)
    tmp = folder / f".{dead}.{'ab' * 8}.tmp"
    tmp.write_bytes(b"half")
    _age(str(tmp), OLD)
    assert _sweep(folder, retention_s=0) == {"names": 0, "read": 0, "reports": 0, "temporaries": 0}
    assert sorted(os.listdir(folder)) == sorted([name, tmp.name])


def test_old_temporaries_are_removed_young_ones_and_other_names_kept(folder):
    old = folder / f".{_dead_pid()}.{'cd' * 8}.tmp"
    young = folder / f".{os.getpid()}.{'ef' * 8}.tmp"
    other = folder / "notes.txt"
    for path in (old, young, other):
        path.write_bytes(b"x")
    _age(str(old), OLD)
    _age(str(other), OLD)
    assert _sweep(folder)["temporaries"] == 1
    assert sorted(os.listdir(folder)) == sorted([young.name, other.name])


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another owner needs root (chown)")
def test_files_of_another_owner_stay(folder):
    here, dead = host_label(), _dead_pid()
    theirs = _report(folder, f"{here}-{dead}.json", host=here, pid=dead, ticks=1)
    tmp = folder / f".{dead}.{'01' * 8}.tmp"
    tmp.write_bytes(b"x")
    _age(str(tmp), OLD)
    for name in (theirs, tmp.name):
        os.chown(folder / name, 65534, 65534)
    done = _sweep(folder)
    assert sorted(os.listdir(folder)) == sorted([theirs, tmp.name]) and done["reports"] == done["temporaries"] == 0
    # The negative control: given back to this user, both go.
    for name in (theirs, tmp.name):
        os.chown(folder / name, os.geteuid(), os.getegid())
    assert _sweep(folder)["reports"] == 1 and os.listdir(folder) == []


def test_one_sweep_reads_at_most_max_reads_reports(folder, monkeypatch):
    here = host_label()
    dead = [_dead_pid() for _ in range(3)]
    for pid in dead:
        _report(folder, f"{here}-{pid}.json", host=here, pid=pid, ticks=1)
    monkeypatch.setattr(retention, "MAX_READS", 2)
    first = _sweep(folder)
    assert (first["read"], first["reports"], len(os.listdir(folder))) == (2, 2, 1)
    assert _sweep(folder)["reports"] == 1 and os.listdir(folder) == []


def write_first_report() -> list:
    """Runs in a fresh interpreter: this process's first report; the folder's names afterwards."""
    from drama3_patches.engine import get_engine, state

    state.write_report(get_engine())
    return sorted(os.listdir(os.environ["DRAMA3_PATCHES_REPORT_DIR"]))


def test_a_process_tidies_the_folder_at_its_first_report(folder):
    here, dead = host_label(), _dead_pid()
    gone = _report(folder, f"{here}-{dead}.json", host=here, pid=dead, ticks=1)
    left = call(write_first_report, env={"DRAMA3_PATCHES_REPORT_DIR": str(folder)})
    assert gone not in left and len(left) == 1 and left[0].startswith(f"{here}-"), left
    # The negative control: with retention 0 the same report stays beside the new one.
    gone = _report(folder, f"{here}-{dead}.json", host=here, pid=dead, ticks=1)
    left = call(write_first_report, env={"DRAMA3_PATCHES_REPORT_DIR": str(folder),
                                         "DRAMA3_PATCHES_REPORT_RETENTION": "0"})
    assert gone in left and len(left) == 3, left

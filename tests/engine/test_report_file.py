"""Tier 1: the report file (``$DRAMA3_PATCHES_REPORT_DIR/<pid>.json``) on a shared host.

The folder is created private and refused (one warning, no report) when another user owns it
or can write to it; the report goes through a temporary file of random name, created
exclusively without following links (mode 0600), then renamed; the command line is redacted.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from support.hostile import hostile_user  # noqa: F401 (a fixture)
from support.selftest import write_manifest, write_target
from drama3_patches.engine.state import host_label
from support.subproc import call

SECRET = "root-only contents"


@pytest.fixture
def served(tmp_path):
    write_target(tmp_path)
    manifest = write_manifest(tmp_path, {"targets": ["d3p_target:greet"]})
    victim = tmp_path / "victim"
    victim.write_text(SECRET)
    victim.chmod(0o600)

    def run(reports: Path, func=None, *args):
        env = {"DRAMA3_PATCHES": "1", "DRAMA3_PATCHES_MANIFEST": str(manifest),
               "DRAMA3_PATCHES_REPORT_DIR": str(reports)}
        # A generous bound: the old writer blocked forever on a planted FIFO.
        got = call(func or serve, *args, env=env, pythonpath=[tmp_path], timeout=60, with_output=True)
        return got["result"], got["stderr"]

    run.victim = victim
    return run


def serve(*argv) -> int:
    """Runs in a fresh interpreter: a serving process whose command line carries a secret."""
    import sys

    sys.argv[1:] = list(argv)
    import d3p_target  # noqa: F401 (patched: a report is written)

    return os.getpid()


def plant_then_serve(reports: str, kind: str, victim: str) -> int:
    """Plant at this process's old fixed temporary name, then serve."""
    path = os.path.join(reports, f"{os.getpid()}.json.tmp")
    if kind == "symlink":
        os.symlink(victim, path)
    else:
        os.mkfifo(path)
    return serve()


def test_the_report_is_private_and_the_command_line_redacted(served, tmp_path):
    reports = tmp_path / "made" / "reports"
    pid, stderr = served(reports, serve, "serve", "/models/drama3", "--api-key", "sk-SECRET", "--token=T0K3N", "-v")
    assert stderr == ""
    report = reports / f"{host_label()}-{pid}.json"
    text = report.read_text()
    assert json.loads(text)["argv"] == ["subproc.py", "*", "*", "--api-key", "*", "--token=*", "-v"]
    assert "SECRET" not in text and "T0K3N" not in text
    assert report.stat().st_mode & 0o777 == 0o600
    assert reports.stat().st_mode & 0o777 == 0o700
    assert os.listdir(reports) == [report.name]  # no temporary file left behind


@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_a_link_or_fifo_at_the_old_temporary_name_is_never_opened(served, tmp_path, kind):
    reports = tmp_path / "reports"
    reports.mkdir(mode=0o700)
    pid, stderr = served(reports, plant_then_serve, str(reports), kind, str(served.victim))
    assert served.victim.read_text() == SECRET
    assert json.loads((reports / f"{host_label()}-{pid}.json").read_text())["pid"] == pid


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o775])
def test_a_report_folder_open_to_others_is_refused_with_one_warning(served, tmp_path, mode):
    reports = tmp_path / "shared"
    reports.mkdir()
    reports.chmod(mode)
    pid, stderr = served(reports)
    assert os.listdir(reports) == []
    (line,) = stderr.splitlines()
    assert f"cannot write the status report to {reports}" in line and "writable by others" in line


@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_another_users_report_folder_is_refused(served, hostile_user, kind):
    # The attacker makes the report folder in a shared place first and plants, for the pids
    # the kernel hands out next, a link to a root-only file (or a FIFO) at the old temporary name.
    reports = hostile_user.shared / "reports"
    hostile_user.sh('mkdir -m 777 "$1"', reports)
    pids = hostile_user.plant_for_next_pids(reports, ".json.tmp", 300,
                                            served.victim if kind == "symlink" else None)
    pid, stderr = served(reports)
    assert pid in pids, "the guess missed: the test proves nothing this time"
    assert served.victim.read_text() == SECRET
    assert not (reports / f"{host_label()}-{pid}.json").exists()
    (line,) = stderr.splitlines()
    assert f"belongs to uid {hostile_user.uid}" in line


def count_then_wait(name: str, n: int) -> dict:
    """Runs in a fresh interpreter: serve, count ``n`` events, read the report before and after the flush."""
    import time

    from drama3_patches.engine import state

    serve()
    reports = os.environ["DRAMA3_PATCHES_REPORT_DIR"]
    path = os.path.join(reports, f"{state.host_label()}-{os.getpid()}.json")
    for _ in range(n):
        state.count(name)
    right_after = json.loads(Path(path).read_text()).get("counts")
    time.sleep(state.FLUSH_DELAY_S + 1.0)
    later = json.loads(Path(path).read_text())["counts"]
    child = os.fork()
    if child == 0:  # a forked child starts its own counts
        os._exit(0 if state.counters() == {} else 1)
    _, status = os.waitpid(child, 0)
    return {"right_after": right_after, "later": later, "child_clean": os.waitstatus_to_exitcode(status) == 0}


def test_runtime_counts_reach_the_report_once_shortly_after_and_a_fork_starts_at_zero(served, tmp_path):
    got, _ = served(tmp_path / "reports", count_then_wait, "resumes_verified", 5)
    # written when the patch applied (no counts yet), then once by the flush after the five increments
    assert got["right_after"] == {} and got["later"] == {"resumes_verified": 5}
    assert got["child_clean"]

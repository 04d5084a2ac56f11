"""validate's output folder is validate's own: another user's folder, or one others can write, is
refused before anything runs; what validate writes goes into the folder it checked (through its
descriptor), private (0700 folders, 0600 files), never through a path another user swapped; the
server is never handed a swapped checkpoint; the log is read only as the regular file it is.

Each attack is another local user's (a throwaway account, ``support.hostile``), so these run as
root and are skipped with the reason elsewhere; the modes test needs no second user.
"""

from __future__ import annotations

import json
import os
import stat
import threading
from pathlib import Path

import pytest

from drama3_patches.tools.validate import logscan
from support import validate_attack
from support.hostile import hostile_user  # noqa: F401 (a fixture)
from support.subproc import call


def _validate(fake: Path, out: Path, attack: dict | None = None, stop_at_host_check: bool = False) -> dict:
    return call(validate_attack.run_validate, str(fake), validate_attack.argv(fake, out), attack, stop_at_host_check,
                False, env={"FAKE_DIR": str(fake)}, timeout=300, with_output=True)


def _runs_folder(hostile) -> Path:
    """A folder the hostile user may rename entries of (mode 0777, not sticky), as a group-writable
    share would be; root's ``--out`` is made inside it."""
    runs = hostile.shared / "runs"
    runs.mkdir()
    runs.chmod(0o777)
    return runs


@pytest.mark.parametrize("case", ["another user's, 0777", "another user's, 0755", "root's, group-writable"])
def test_an_out_folder_others_own_or_can_write_is_refused_before_anything_runs(tmp_path, hostile_user, case):
    validate_attack.setup(tmp_path)
    out = hostile_user.shared / "out"
    if case.startswith("another"):
        hostile_user.sh('mkdir "$1" && chmod "$2" "$1"', out, "777" if "0777" in case else "755")
    else:
        out.mkdir()
        out.chmod(0o770)
    done = _validate(tmp_path, out, stop_at_host_check=True)
    lines = done["stderr"].strip().splitlines()
    assert done["result"]["exit"] == 2 and done["result"]["reached"] == [], done["stderr"]
    mode = stat.S_IMODE(out.stat().st_mode)
    assert len(lines) == 1 and "owned by" in lines[0] and f"{mode:04o}" in lines[0], lines
    assert (hostile_user.name if case.startswith("another") else "root") in lines[0], lines
    assert list(out.iterdir()) == []


def test_writes_go_into_the_checked_folder_not_through_a_swapped_path(tmp_path, hostile_user):
    validate_attack.setup(tmp_path)
    runs = _runs_folder(hostile_user)
    victim = tmp_path / "victim"  # root's own folder elsewhere, which the attacker's link names
    victim.mkdir()
    (victim / "root.conf").write_text("root's")
    attack = {"when": "model", "uid": hostile_user.uid, "gid": hostile_user.gid,
              "script": f'mv "{runs}/out" "{runs}/out.old" && ln -s "{victim}" "{runs}/out"'}
    done = _validate(tmp_path, runs / "out", attack=attack)
    assert "attacked at model" in done["result"]["reached"], done["output"]
    assert sorted(p.name for p in victim.iterdir()) == ["root.conf"], done["output"]
    assert (victim / "root.conf").read_text() == "root's"
    # what the run wrote went into the folder it checked, wherever the attacker moved it
    report = json.loads((runs / "out.old" / "report.json").read_text())
    assert done["result"]["exit"] == 2 and "no longer names the folder" in done["stderr"], done["stderr"]
    assert not report["passed"]


def test_a_swapped_out_folder_never_serves_the_attackers_checkpoint(tmp_path, hostile_user):
    validate_attack.setup(tmp_path)
    runs = _runs_folder(hostile_user)
    attack = {"when": "model", "uid": hostile_user.uid, "gid": hostile_user.gid,
              "script": f'mv "{runs}/out" "{runs}/out.old" && mkdir -p "{runs}/out/model" && '
                        f'echo \'{{"who": "the attacker"}}\' > "{runs}/out/model/config.json"'}
    done = _validate(tmp_path, runs / "out", attack=attack)
    assert "attacked at model" in done["result"]["reached"], done["output"]
    served = (tmp_path / "served.json").read_text() if (tmp_path / "served.json").exists() else None
    assert served is None or "attacker" not in served, served
    assert done["result"]["exit"] == 2 and "the server was not started" in done["stderr"], done["stderr"]
    assert served is None


def test_what_a_run_makes_is_private_folders_0700_files_0600(tmp_path):
    fake = tmp_path / "fake"
    fake.mkdir()
    validate_attack.setup(fake)
    out = tmp_path / "out"
    done = _validate(fake, out)
    assert done["result"]["exit"] == 1, done["output"]  # the stand-in server exits: row a fails
    modes = {str(p.relative_to(out)): stat.S_IMODE(p.lstat().st_mode) for p in out.rglob("*")}
    assert {"report.json", "server.log", "deploy.yaml", "host-facts.md", "model/config.json"} <= set(modes)
    assert stat.S_IMODE(out.stat().st_mode) == 0o700
    wrong = {name: f"{mode:04o}" for name, mode in modes.items()
             if mode != (0o700 if (out / name).is_dir() else 0o600)}
    assert wrong == {}


def _poll_returns(path: Path) -> tuple[bool, logscan.LogScan]:
    scan = logscan.LogScan(path)
    thread = threading.Thread(target=scan.poll, daemon=True)
    thread.start()
    thread.join(20)  # a hang guard, not a timing: poll of anything but a FIFO returns at once
    return not thread.is_alive(), scan


def test_a_fifo_in_place_of_the_log_is_not_waited_on(tmp_path):
    log = tmp_path / "server.log"
    os.mkfifo(log)
    returned, scan = _poll_returns(log)
    if not returned:  # release the blocked open so the thread ends, then fail
        os.close(os.open(log, os.O_WRONLY | os.O_NONBLOCK))
    assert returned and scan.offset == 0


def test_a_link_in_place_of_the_log_is_not_followed(tmp_path):
    elsewhere = tmp_path / "elsewhere.txt"
    elsewhere.write_text("Traceback (most recent call last):\n")
    log = tmp_path / "server.log"
    log.symlink_to(elsewhere)
    returned, scan = _poll_returns(log)
    assert returned and scan.offset == 0 and scan.bad_count == 0
    # control: the same line in a regular log is read and flagged
    real = tmp_path / "real.log"
    real.write_text(elsewhere.read_text())
    returned, scan = _poll_returns(real)
    assert returned and scan.offset > 0 and scan.bad_count == 1

"""`drama3-patches status --collect DIR` on a report folder someone else could write into.

Each case plants what a hostile local user (or a broken writer) could leave there: a FIFO, a
link, a huge file, wrong field types, terminal escapes, a report of another owner. The command
must show the good reports, skip each bad one with its owner and reason, and neither hang,
follow a link, nor pass an escape sequence to the terminal.
"""

from __future__ import annotations

import json
import os

from support.hostile import hostile_user  # noqa: F401 (a fixture)
from support.subproc import run_cli


def report(pid: int, reason: str = "applied cleanly", **extra) -> dict:
    return {"pid": pid, "platform": "cpu", "enabled": True, "argv": ["vllm", "*", "--api-key", "*"],
            "versions": {"vllm": "0.32.0"}, "patches": [{"id": "selftest", "state": "applied", "reason": reason}],
            **extra}


def _write(folder, name: str, data) -> None:
    (folder / name).write_text(data if isinstance(data, str) else json.dumps(data))


def _collect(folder, *args):
    return run_cli("status", "--collect", str(folder), *args, timeout=60)


def _skips(stderr: str) -> dict:
    out = {}
    for line in stderr.splitlines():
        if line.startswith("drama3-patches: skipping report "):
            path, _, why = line[len("drama3-patches: skipping report "):].partition(": ")
            out[os.path.basename(path)] = why
    return out


def test_planted_and_malformed_files_are_skipped_with_owner_and_reason(tmp_path):
    reports = tmp_path / "reports"
    reports.mkdir()
    _write(reports, "100.json", report(100))
    os.mkfifo(reports / "101.json")  # nobody writes: a blocking open would hang the command
    secret = tmp_path / "secret.json"
    _write(tmp_path, "secret.json", report(102, reason="a file the link points at"))
    os.symlink(secret, reports / "102.json")
    with open(reports / "103.json", "wb") as fh:
        fh.truncate(2 * 1024 * 1024)  # sparse: refused by its size
    _write(reports, "104.json", {"pid": 104, "patches": [{"id": ["x"], "state": 1, "reason": None}]})
    _write(reports, "105.json", report(1))  # claims another process's pid
    _write(reports, "106.json", report(106, argv="vllm serve"))
    _write(reports, "107.json", '{"pid": 107, "patches": ' + "[" * 100_000 + "]" * 100_000 + "}")
    (reports / "108.json").write_bytes(b'{"pid": 108, "patches": [], "platform": "\xff"}')
    _write(reports, "109.json", report(109, reason="\x1b]0;owned\x07\x1b[2J\x1b[31mred\x9b"))
    r = _collect(reports)
    assert "Traceback" not in r.stderr
    assert r.returncode == 0, r.stderr
    me = os.geteuid()
    skips = _skips(r.stderr)
    assert set(skips) == {f"{n}.json" for n in range(101, 109)}, r.stderr
    assert skips["101.json"].startswith("not a regular file (a FIFO); a report must be one (owner ")
    assert skips["102.json"].startswith("a symbolic link; not followed (owner ")
    assert skips["103.json"].startswith("2.0 MiB, over the 1.0 MiB limit for a report (owner ")
    assert skips["104.json"].startswith("a patch entry's id, state or reason is not text (owner ")
    assert skips["105.json"].startswith("says pid 1 but is named 105.json (owner ")
    assert skips["106.json"].startswith("argv is not a list of text (owner ")
    assert skips["107.json"].startswith("not valid JSON: ")
    assert skips["108.json"].startswith("unreadable: not UTF-8 (invalid start byte) (owner ")
    assert all(why.endswith(f"uid {me})") for why in skips.values()), skips
    # Shown: the two good reports; the escapes as text, none reaching the terminal.
    assert "2 process report(s)" in r.stdout
    assert "\x1b" not in r.stdout + r.stderr and "\x07" not in r.stdout and "\x9b" not in r.stdout
    assert "\\x1b]0;owned\\x07\\x1b[2J\\x1b[31mred\\x9b" in r.stdout
    assert "a file the link points at" not in r.stdout
    data = json.loads(_collect(reports, "--json").stdout)
    assert sorted(p["pid"] for p in data["processes"]) == [100, 109] and len(data["skipped"]) == 8


def test_a_report_planted_by_another_user_is_skipped_unless_trusted(hostile_user):
    """A throwaway local account writes a forged report into a folder both can write (as /tmp
    is): collect names that account and skips it; --trust ACCOUNT shows it."""
    reports = hostile_user.shared
    _write(reports, "200.json", report(200))
    forged = json.dumps(report(201, reason="\x1b[2Jforged by the other account"))
    hostile_user.sh('printf %s "$1" > "$2"', forged, reports / "201.json")
    r = _collect(reports)
    assert r.returncode == 0 and "1 process report(s)" in r.stdout and "forged" not in r.stdout
    why = _skips(r.stderr)["201.json"]
    assert why == (f"owner {hostile_user.name}, uid {hostile_user.uid}: not you or root, so possibly planted; "
                   f"--trust {hostile_user.name} shows it")
    r = _collect(reports, "--trust", hostile_user.name)
    assert "2 process report(s)" in r.stdout and "\\x1b[2Jforged by the other account" in r.stdout
    assert not _skips(r.stderr) and "\x1b" not in r.stdout
    r = _collect(reports, "--trust", "no-such-user-d3p")
    assert (r.returncode, r.stderr.strip()) == (2, "drama3-patches status: --trust 'no-such-user-d3p': no such user")


def test_a_folder_others_can_write_is_said(tmp_path):
    reports = tmp_path / "reports"
    reports.mkdir()
    os.chmod(reports, 0o777)
    _write(reports, "300.json", report(300))
    r = _collect(reports)
    assert r.returncode == 0 and "1 process report(s)" in r.stdout
    assert "the folder is writable by others (mode 777): only reports of trusted owners are shown" in r.stderr


def test_reports_of_two_hosts_are_grouped_and_a_remote_pid_is_never_called_gone(tmp_path):
    """A folder shared by two nodes: the same pid on both is two processes; the other host's pid,
    not running here, is shown without "(gone)"; a pid of this host that is not running is gone."""
    from drama3_patches.engine.state import host_label

    here, there = host_label(), "node.b"
    assert here != there
    reports = tmp_path / "reports"
    reports.mkdir()
    dead = 4_000_000  # above any pid_max: never a running process here
    _write(reports, f"{here}-{dead}.json", report(dead, host=here))
    _write(reports, f"{there}-{dead}.json", report(dead, host=there))
    _write(reports, f"{there}-{os.getpid()}.json", report(os.getpid()))
    _write(reports, f"{there}-7.json", report(7, host="node.c"))  # the text contradicts its name
    _write(reports, "bad-host!-8.json", report(8))
    r = _collect(reports)
    assert r.returncode == 0, r.stderr
    skips = _skips(r.stderr)
    assert skips[f"{there}-7.json"].startswith(f"says host 'node.c' but is named {there}-7.json (owner ")
    assert skips["bad-host!-8.json"].startswith("not a <host>-<pid>.json name (owner ")
    assert "3 process report(s) from 2 host(s)" in r.stdout
    assert f"host {here}: 1 process(es), pid {dead}" in r.stdout
    assert f"host {there}: 2 process(es), pid {os.getpid()}, {dead}" in r.stdout
    assert f"host {here} (this host)" in r.stdout
    gone = [line for line in r.stdout.splitlines() if "(gone)" in line]
    assert len(gone) == 1 and gone[0].split()[0] == str(dead), r.stdout  # only this host's dead pid
    data = json.loads(_collect(reports, "--json").stdout)
    assert [(p["host"], p["pid"]) for p in data["processes"]] == sorted(
        [(here, dead), (there, dead), (there, os.getpid())])

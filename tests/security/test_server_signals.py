"""validate signals only the server: once the server's leader has exited, its pid (and the group id
that is the same number) is never signalled, even when the kernel hands that number to another
user's process; and a signal that lands while the server starts still ends with the server stopped.

The reused pid is forced through ``/proc/sys/kernel/ns_last_pid`` with a throwaway local user's
process (``support.hostile``), so that test runs as root, skipped with the reason elsewhere.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from drama3_patches.tools.validate import server
from support import validate_attack
from support.hostile import hostile_user  # noqa: F401 (a fixture)
from support.subproc import call


def _alive(pid: int) -> bool:
    """Running, and not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            raw = fh.read().decode()
    except OSError:
        return False
    return raw[raw.rfind(")") + 2:].split()[0] != "Z"


def _spawn_with_pid(pid: int, uid: int, gid: int, tries: int = 50) -> tuple[subprocess.Popen, bool]:
    """A process of ``uid`` in a session of its own (so it leads a group numbered as its pid), given
    ``pid`` where the kernel can hand that number out; else the last try's process."""
    for _ in range(tries):
        with open("/proc/sys/kernel/ns_last_pid", "w") as fh:
            fh.write(str(pid - 1))
        proc = subprocess.Popen(["sleep", "120"], user=uid, group=gid, extra_groups=[], start_new_session=True)
        if proc.pid == pid:
            return proc, True
        if _ == tries - 1:
            return proc, False
        proc.kill()
        proc.wait()
    raise AssertionError("unreachable")


def test_a_reaped_leaders_pid_and_group_are_never_signalled(hostile_user):
    if not os.path.exists("/proc/sys/kernel/ns_last_pid"):
        pytest.skip("no /proc/sys/kernel/ns_last_pid to hand a pid out again with")
    srv = server.Server(subprocess.Popen(["/bin/sh", "-c", "exit 0"], start_new_session=True))
    leader = srv.pid
    deadline = time.monotonic() + 60
    while srv.poll() is None and time.monotonic() < deadline:  # as wait_ready asks while the server starts
        time.sleep(0.05)
    assert srv.poll() == 0
    victim, same_pid = _spawn_with_pid(leader, hostile_user.uid, hostile_user.gid)
    try:
        srv.note_tree()
        stopped = srv.stop(grace=1, kill_wait=1)
        assert _alive(victim.pid), (f"another user's process (pid {victim.pid}, the leader's number: {same_pid}) "
                                    f"was signalled; stop said {stopped}")
    finally:
        victim.kill()
        victim.wait()


def test_a_signal_while_the_server_starts_still_stops_every_process_of_it(tmp_path):
    validate_attack.setup(tmp_path)
    done = call(validate_attack.run_validate, str(tmp_path), validate_attack.argv(tmp_path, tmp_path / "out"),
                None, False, True, env={"FAKE_DIR": str(tmp_path), "FAKE_MODE": "wait"}, timeout=300,
                with_output=True)
    child = int(Path(tmp_path / "child.pid").read_text())
    try:
        assert not _alive(child), done["output"]  # the child ignores TERM: only validate's stop ends it
        assert done["result"]["exit"] == 128 + signal.SIGTERM, done["output"]
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)

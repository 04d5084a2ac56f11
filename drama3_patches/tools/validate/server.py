"""``vllm serve MODEL --omni`` as an operator runs it: started, waited for, stopped with everything it started.

The server runs in a process group and session of its own (each stage and worker is a process of
that group), its output in one log file (read by ``logscan``). Stopping signals the whole group,
TERM then, after a bounded wait, KILL, whether or not the leader is still there: a worker that
outlived a crashed leader is still the server's. Processes that left the group (a new session of
their own) are found through the process tree, which is noted while the server runs
(:meth:`Server.note_tree`).

Only the server is ever signalled (validate runs as root): the leader is not reaped until the
last signal is sent, so while validate signals, the leader's pid and its group's id cannot name
another process; the leader itself is signalled through a pidfd where the kernel has them. Its
exit is observed without reaping it (``waitid(WNOWAIT)``). Descendants that left the group are
signalled only while they are the process noted (pid and start time). Once the leader is reaped,
neither its pid nor its group id is signalled or counted as the server's again.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from drama3_patches.tools.files import InputError

PR_SET_PDEATHSIG = 1  # linux/prctl.h
MAX_PROCS = 65536  # /proc entries looked at per scan: bounded even on a crowded host


def vllm_command() -> str:
    """The ``vllm`` executable beside this interpreter, else on PATH; InputError when absent."""
    beside = Path(sys.executable).parent / "vllm"
    if beside.is_file():
        return str(beside)
    found = shutil.which("vllm")
    if not found:
        raise InputError("no `vllm` command beside this Python or on PATH: install vLLM and vLLM-Omni "
                         "in this environment")
    return found


def _child_setup(prctl):
    """What the server's leader runs between fork and exec: the signals validate held back while
    starting it are not held in the server; and, where ``prctl`` is there (Linux), a TERM when
    validate's main thread ends, however it ends (even SIGKILL, which no handler sees): vLLM's
    leader stops its stages on TERM. Only C calls here: nothing may take a lock another thread
    held at the fork."""

    def setup() -> None:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, (signal.SIGINT, signal.SIGTERM, signal.SIGHUP))
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)

    return setup


def _prctl():
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux: the signal handlers and stop() still apply
        return None


def _stat(pid: int) -> tuple[int, int, str, int] | None:
    """(parent pid, process group, state, start time in clock ticks) of a live pid, from /proc."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            raw = fh.read(4096).decode("ascii", "replace")
    except OSError:
        return None
    # the command name is in parentheses and may hold spaces: the fields follow its last ')'
    fields = raw[raw.rfind(")") + 2:].split()
    try:
        return int(fields[1]), int(fields[2]), fields[0], int(fields[19])
    except (IndexError, ValueError):
        return None


def _all_pids() -> list[int]:
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    return [int(n) for n in names[:MAX_PROCS * 4] if n.isdigit()][:MAX_PROCS]


class Server:
    """A started server: its leader, its process group, the descendants seen while it ran."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self.pgid = proc.pid  # start_new_session: the leader leads its own group
        self.seen: dict[int, int] = {}  # pid -> start time: descendants noted while the server ran
        self._status: int | None = None  # the leader's exit status, seen without reaping it
        self.reaped = False
        try:  # the leader is our unreaped child here, so this pid is still it
            self.pidfd: int | None = os.pidfd_open(proc.pid)
        except (AttributeError, OSError):  # no pidfd (kernel < 5.3, not Linux): the pid, still unreaped
            self.pidfd = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self):
        """The leader's exit status, or None while it runs; the leader is not reaped (its pid and
        group id stay the server's until :meth:`stop` has sent its last signal)."""
        if self._status is None and not self.reaped:
            try:
                info = os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:  # reaped by someone else (not validate's code): its pid is not ours
                self.reaped = True
                return self.proc.returncode
            if info is not None:
                self._status = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
        return self._status if not self.reaped else self.proc.returncode

    @property
    def returncode(self):
        return self.poll()

    def _reap(self) -> None:
        """The leader reaped (at the end of :meth:`stop`): from now on its pid and group id are free
        for the kernel to reuse, and are neither signalled nor counted."""
        if not self.reaped:
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                return
            self.reaped = True
            if self.pidfd is not None:
                os.close(self.pidfd)
                self.pidfd = None

    def note_tree(self) -> None:
        """Remember every live descendant of the leader and every member of its group (the leader
        and its group only while it is unreaped: after that, the numbers may be someone else's)."""
        table = {pid: st for pid in _all_pids() if (st := _stat(pid)) is not None}
        family = set() if self.reaped else {self.pid}
        grew = True
        while grew:
            grew = False
            for pid, (ppid, pgrp, state, start) in table.items():
                if pid not in family and (ppid in family or (pgrp == self.pgid and not self.reaped)):
                    family.add(pid)
                    grew = True
        for pid in family:
            if pid in table and table[pid][2] != "Z":
                self.seen.setdefault(pid, table[pid][3])

    def alive(self) -> list[int]:
        """The server's processes still running (zombies are not): its group's members and the
        descendants noted before, each the same process (start time) as when noted."""
        out = []
        for pid in _all_pids():
            st = _stat(pid)
            if st is None or st[2] == "Z":
                continue
            if (st[1] == self.pgid and not self.reaped) or self.seen.get(pid) == st[3]:
                out.append(pid)
        return out

    def _signal(self, sig: int) -> None:
        if not self.reaped:  # the leader unreaped: its pid and group id are still the server's
            if self.pidfd is not None:
                try:
                    signal.pidfd_send_signal(self.pidfd, sig)
                except (ProcessLookupError, PermissionError):
                    pass
            try:
                os.killpg(self.pgid, sig)
            except (ProcessLookupError, PermissionError):
                pass  # the group has vanished: nothing of it to signal
        for pid in self.alive():
            if pid == self.pid and self.reaped:
                continue
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def _wait_gone(self, seconds: float) -> list[int]:
        deadline = time.monotonic() + seconds
        while True:
            left = self.alive()  # a zombie leader is not counted: it is reaped once signalling is over
            if not left or time.monotonic() >= deadline:
                return left
            time.sleep(0.2)

    def stop(self, grace: float = 60.0, kill_wait: float = 30.0) -> dict:
        """TERM to every process of the server, up to ``grace`` seconds for them to end, then KILL
        to what is left. Returns what happened: ``{"terminated": n, "killed": n, "left": [pids]}``."""
        self.note_tree()
        before = self.alive()
        if not before:
            self._reap()
            return {"terminated": 0, "killed": 0, "left": []}
        self._signal(signal.SIGTERM)
        stubborn = self._wait_gone(grace)
        if stubborn:
            self._signal(signal.SIGKILL)
        left = self._wait_gone(kill_wait) if stubborn else []
        self._reap()
        return {"terminated": len(before) - len(stubborn), "killed": len(stubborn) - len(left), "left": left}


def start(model: str, deploy: Path, port: int, env: dict, log) -> Server:
    """``vllm serve`` started with its output to ``log`` (a file open for writing, made by the
    caller: validate makes it new, 0600, in its own folder)."""
    argv = [vllm_command(), "serve", model, "--omni", "--deploy-config", str(deploy), "--host", "127.0.0.1",
            "--port", str(port)]
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True, preexec_fn=_child_setup(_prctl()))
    return Server(proc)


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_ready(server: Server, port: int, timeout: float, tick=None) -> tuple[bool, float, str]:
    """(ready, seconds, why not): polls ``/v1/models`` until it answers 200, the server exits, or
    ``timeout`` passes. ``tick(seconds)`` is called about every 30 s while waiting; the server's
    process tree is noted on the way."""
    began = time.monotonic()
    told = 0.0
    while True:
        waited = time.monotonic() - began
        server.note_tree()
        if server.poll() is not None:
            return False, waited, f"the server exited with status {server.returncode} before it was ready"
        if waited > timeout:
            return False, waited, f"not ready within {timeout:g} s"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as resp:
                if resp.status == 200:
                    return True, waited, ""
        except OSError:
            pass
        if tick is not None and waited - told >= 30:
            told = waited
            tick(waited)
        time.sleep(2)

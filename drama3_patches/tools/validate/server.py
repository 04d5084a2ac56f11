"""``vllm serve MODEL --omni`` as an operator runs it: started, waited for, read, stopped.

The server runs in its own process group (each stage is a process of its own), its output in
one log file. The log is read in bounded pieces, never whole into memory at once beyond
``MAX_LOG_SCAN`` bytes.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from drama3_patches.tools.files import InputError

MAX_LOG_SCAN = 256 * 1024 * 1024  # a day of INFO lines from every process is far less
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_PREFIX = re.compile(r"\((APIServer|StageEngineCoreProc_stage(\d+)_replica\d+|Worker(?:_TP(\d+))?) pid=(\d+)\)")


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


def start(model: str, deploy: Path, port: int, env: dict, log: Path) -> subprocess.Popen:
    argv = [vllm_command(), "serve", model, "--omni", "--deploy-config", str(deploy), "--host", "127.0.0.1",
            "--port", str(port)]
    with open(log, "wb") as out:
        return subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_ready(server: subprocess.Popen, port: int, timeout: float, tick=None) -> tuple[bool, float, str]:
    """(ready, seconds, why not): polls ``/v1/models`` until it answers 200, the server exits, or
    ``timeout`` passes. ``tick(seconds)`` is called about every 30 s while waiting."""
    began = time.monotonic()
    told = 0.0
    while True:
        waited = time.monotonic() - began
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


def stop(server: subprocess.Popen, grace: float = 60) -> None:
    if server.poll() is not None:
        return
    try:
        os.killpg(server.pid, signal.SIGINT)
        server.wait(grace)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(30)
    except ProcessLookupError:
        pass


def read_log(log: Path, end: int | None = None) -> str:
    """The log's text up to byte ``end`` (at most MAX_LOG_SCAN bytes: its last ones), colours removed."""
    size = log.stat().st_size if end is None else end
    with open(log, "rb") as fh:
        fh.seek(max(0, size - MAX_LOG_SCAN))
        raw = fh.read(min(size, MAX_LOG_SCAN))
    return _ANSI.sub("", raw.decode("utf-8", "replace"))


def process_roles(text: str, multi_rank_stage: int | None = None) -> dict[int, str]:
    """pid -> role, from the log's ``(ROLE pid=N)`` prefixes: ``api-server``, ``engine-core stage N``,
    ``worker stage N rank R``. A worker's stage is told by what it loads (stage 0 the DAC encoder
    for voice references, stage 1 the DAC decoder); its rank by its ``_TP`` suffix, which only a
    stage of several ranks has: where one rank logs nothing of its loading, that suffix places it
    in ``multi_rank_stage``."""
    roles: dict[int, str] = {}
    ranks: dict[int, int] = {}
    suffixed: set[int] = set()
    for match in _PREFIX.finditer(text):
        name, stage, rank, pid = match.group(1), match.group(2), match.group(3), int(match.group(4))
        if name == "APIServer":
            roles.setdefault(pid, "api-server")
        elif stage is not None:
            roles.setdefault(pid, f"engine-core stage {stage}")
        else:
            roles.setdefault(pid, "worker stage ?")
            ranks[pid] = int(rank or 0)
            if rank is not None:
                suffixed.add(pid)
    for line in text.splitlines():
        match = _PREFIX.search(line)
        if not match or not match.group(1).startswith("Worker"):
            continue
        pid = int(match.group(4))
        if "Loaded DAC codec encoder" in line:
            roles[pid] = f"worker stage 0 rank {ranks.get(pid, 0)}"
        elif "DAC codec loaded" in line and not roles[pid].startswith("worker stage 0"):
            roles[pid] = f"worker stage 1 rank {ranks.get(pid, 0)}"
    for pid in suffixed:
        if roles[pid] == "worker stage ?" and multi_rank_stage is not None:
            roles[pid] = f"worker stage {multi_rank_stage} rank {ranks[pid]}"
    return roles

"""A local attacker for tests that need no account of their own: uid ``nobody`` (65534) in a
forked child.

``as_nobody(func, *args)`` forks; the child drops to uid and gid 65534 (no supplementary groups)
and runs ``func(*args)``: what another local user could do on a shared host. The ``shared``
fixture is a folder both can write, as ``/tmp`` is (mode 1777; pytest's own temporary folders are
closed to other users). Skipped, with the reason, where the suite does not run as root (only root
can change its uid).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import traceback
from pathlib import Path

import pytest

NOBODY = 65534
NOT_ROOT = ("becoming another local user (uid 65534) needs root: run the suite as root (e.g. in a "
            "container) to cover files a local attacker plants")


def as_nobody(func, *args) -> None:
    """Run ``func(*args)`` as uid/gid 65534 in a forked child; its exception fails the caller."""
    if os.geteuid() != 0:
        pytest.skip(NOT_ROOT)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            func(*args)
            code = 0
        except BaseException:
            os.write(write, traceback.format_exc().encode()[-4000:])
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as fh:
        error = fh.read().decode(errors="replace")
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise AssertionError(f"as uid {NOBODY}: {getattr(func, '__name__', func)} failed:\n{error}")


@pytest.fixture
def shared():
    if os.geteuid() != 0:
        pytest.skip(NOT_ROOT)
    folder = Path(tempfile.mkdtemp(prefix="d3p-shared-"))
    try:
        os.chmod(folder, 0o1777)
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)

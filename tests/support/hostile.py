"""Another local user, for tests of what a hostile account on a shared host can plant.

The ``hostile_user`` fixture creates a throwaway account (``useradd``) when the suite runs as
root, and deletes it afterwards; elsewhere the test is skipped with the reason.  ``shared`` is a
folder like ``/tmp`` (mode 1777) that both users can write; ``evil_library`` a shared object
whose constructor leaves a marker file, so a test can tell whether a process loaded it.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path

import pytest

NOT_ROOT = ("creating a throwaway hostile account needs root (useradd); run the suite as root "
            "(e.g. in a container) to cover another user's planted files")


class Hostile:
    def __init__(self, name: str, shared: Path):
        pw = pwd.getpwnam(name)
        self.name, self.uid, self.gid, self.shared = name, pw.pw_uid, pw.pw_gid, shared

    def plant_for_next_pids(self, folder: Path, suffix: str, count: int, link_to: Path | None = None) -> range:
        """Plant, for each of the next ``count`` pids the kernel hands out, ``<pid><suffix>`` in ``folder``:
        a symbolic link to ``link_to``, else a FIFO.  One process does it all, so it uses up no more
        than a pid or two of the range it guesses (pids are handed out in sequence)."""
        python = shutil.which("python3", path="/usr/bin:/bin")
        if python is None or not os.path.exists("/proc/sys/kernel/ns_last_pid"):
            pytest.skip("no system python3 or no /proc/sys/kernel/ns_last_pid to guess pids with")
        out = self.sh(f'exec {python} -c "$1" "$2" "$3" "$4" "$5"', PLANT, folder, suffix, count, link_to or "")
        first, last = map(int, out.split())
        return range(first, last)

    def sh(self, script: str, *args: str) -> str:
        """Run a shell script as the hostile user (``$1``... are ``args``); its stdout."""
        proc = subprocess.run(["/bin/sh", "-c", script, "sh", *map(str, args)], user=self.uid, group=self.gid,
                              extra_groups=[], cwd="/", capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            raise AssertionError(f"as {self.name}: {script!r} failed: {proc.stderr}")
        return proc.stdout


@pytest.fixture
def hostile_user():
    if os.geteuid() != 0:
        pytest.skip(NOT_ROOT)
    if shutil.which("useradd") is None or shutil.which("userdel") is None:
        pytest.skip("useradd/userdel are not installed here")
    name = f"d3p-{uuid.uuid4().hex[:10]}"
    subprocess.run(["useradd", "--no-create-home", "--home-dir", "/nonexistent", "--shell", "/usr/sbin/nologin",
                    "--user-group", name], check=True, capture_output=True, timeout=60)
    shared = Path(tempfile.mkdtemp(prefix="d3p-shared-"))
    try:
        os.chmod(shared, 0o1777)
        yield Hostile(name, shared)
    finally:
        shutil.rmtree(shared, ignore_errors=True)
        subprocess.run(["userdel", name], capture_output=True, timeout=60)
        subprocess.run(["groupdel", name], capture_output=True, timeout=60)  # where userdel left the group


PLANT = """
import os, sys
folder, suffix, count, target = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
with open("/proc/sys/kernel/ns_last_pid") as f:
    first = int(f.read()) + 1
for pid in range(first, first + count):
    path = os.path.join(folder, f"{pid}{suffix}")
    os.symlink(target, path) if target else os.mkfifo(path)
print(first, first + count)
"""

EVIL_SOURCE = r"""
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen(MARKER, "w");
    if (f) { fputs("the planted library ran", f); fclose(f); }
}
int d3p_planted(void) { return 1; }
"""


def evil_library(folder: Path, marker: Path) -> Path:
    """Compile a library whose constructor writes ``marker``; readable by everyone."""
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the planted library")
    src = folder / "evil.c"
    src.write_text(EVIL_SOURCE)
    out = folder / "evil.so"
    subprocess.run([cc, "-shared", "-fPIC", f'-DMARKER="{marker}"', "-o", str(out), str(src)], check=True,
                   capture_output=True, timeout=120)
    out.chmod(0o755)
    return out

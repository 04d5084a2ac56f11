"""A local user who controls a parent of the kernel cache folder must not get code of theirs built
and loaded as root (issue 41, item 4).

The cache folder is root's (0700) but sits under a folder another user owns (``sudo`` keeping
``HOME=/home/alice``). The attack, made deterministic: a compiler stand-in (``CC``) stops once
before compiling and hands the attacker its command line (in the field: ``/proc/<pid>/cmdline``);
the attacker swaps the parent for a link to a folder of theirs holding a FIFO where the source
should be, waits until the compiler opens it, swaps the parent back (so the output lands in
root's real folder) and feeds their source through the FIFO. Where the build works by path the
compiler reads the planted source and the library passes every owner check; built by descriptor,
the compiler never opens the FIFO.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys

import pytest

from support.hostile import hostile_user  # noqa: F401 (a fixture)

from drama3_patches.kernels import fp8_build

needs_cc = pytest.mark.skipif(shutil.which("gcc") is None, reason="the compiler stand-in runs gcc; none here")

# The compiler stand-in: passes --version through; otherwise publishes its command line, waits for
# the attacker's "go", compiles with gcc, then says it is done.
STANDIN = """#!/bin/sh
case "$1" in --version) exec gcc "$@";; esac
printf '%s\\n' "$@" > "$D3P_CHAN/argv.part" && mv "$D3P_CHAN/argv.part" "$D3P_CHAN/argv"
i=0
while [ ! -e "$D3P_CHAN/go" ] && [ $i -lt 6000 ]; do sleep 0.01; i=$((i+1)); done
gcc "$@"; rc=$?
touch "$D3P_CHAN/done"
exit $rc
"""

# The attacker, run as the other user: argv chan home source.
ATTACKER = r"""
import os, sys, time
chan, home, planted = sys.argv[1], sys.argv[2], sys.argv[3]
def wait_for(path):
    for _ in range(12000):
        if os.path.exists(path):
            return
        time.sleep(0.01)
    sys.exit("gave up waiting for " + path)
wait_for(os.path.join(chan, "argv"))
src = open(os.path.join(chan, "argv")).read().split("\n")[-2]
build = os.path.basename(os.path.dirname(src))
decoy = os.path.join(home, "decoy", "drama3_patches", build)
os.makedirs(decoy)
fifo = os.path.join(decoy, os.path.basename(src))
os.mkfifo(fifo)
cache = os.path.join(home, ".cache")
os.rename(cache, cache + "-real")
os.symlink(os.path.join(home, "decoy"), cache)
open(os.path.join(chan, "go"), "w").close()
while True:
    try:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        break
    except OSError:
        if os.path.exists(os.path.join(chan, "done")):
            print("the compiler never read the planted source")
            sys.exit(0)
        time.sleep(0.005)
os.unlink(cache)
os.rename(cache + "-real", cache)
os.set_blocking(fd, True)
os.write(fd, open(planted, "rb").read())
os.close(fd)
print("the compiler read the planted source")
"""

PLANTED_SOURCE = r"""
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen("%s", "w");
    if (f) { fputs("the planted library ran", f); fclose(f); }
}
int d3_fp8_simd_level(void) { return 0; }
"""


@needs_cc
def test_a_swapped_parent_of_the_cache_folder_never_gets_its_source_built_and_loaded(tmp_path, hostile_user,
                                                                                     monkeypatch):
    python = shutil.which("python3", path="/usr/bin:/bin")
    if python is None:
        pytest.skip("no system python3 to run the attacker with")
    shared = hostile_user.shared
    home = shared / "home"
    hostile_user.sh('mkdir -m 755 "$1"', home)
    chan = shared / "chan"
    chan.mkdir(mode=0o777)
    chan.chmod(0o777)
    planted = shared / "planted.c"
    marker = tmp_path / "marker"
    planted.write_text(PLANTED_SOURCE % marker)
    planted.chmod(0o644)
    attacker_py = shared / "attacker.py"
    attacker_py.write_text(ATTACKER)
    attacker_py.chmod(0o644)
    standin = tmp_path / "cc"
    standin.write_text(STANDIN)
    standin.chmod(0o700)
    monkeypatch.setenv("CC", str(standin))
    monkeypatch.setenv("D3P_CHAN", str(chan))
    attacker = subprocess.Popen([python, str(attacker_py), str(chan), str(home), str(planted)], cwd="/",
                                user=hostile_user.uid, group=hostile_user.gid, extra_groups=[],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lib = fp8_build.find_or_build((), home / ".cache" / "drama3_patches", rebuild=False)
        said, errors = attacker.communicate(timeout=120)
    finally:
        if attacker.poll() is None:
            attacker.kill()
            attacker.wait()
    assert attacker.returncode == 0, errors
    try:
        # Loaded as the kernel's loader does (the checked descriptor), in a child of this root process.
        loaded = subprocess.run(
            [sys.executable, "-c", "import ctypes, sys; lib = ctypes.CDLL(sys.argv[1]); "
             "print(hasattr(lib, 'd3_fp8_expand'))", f"/proc/self/fd/{lib.fd}"],
            pass_fds=(lib.fd,), capture_output=True, text=True, timeout=60)
    finally:
        lib.close()
    assert loaded.returncode == 0, loaded.stderr
    assert not marker.exists(), "the attacker's library ran as root"
    assert "never read the planted source" in said, said
    assert loaded.stdout.strip() == "True", "the library built is not the kernel"


def test_the_cache_folder_is_never_a_link_and_its_created_parents_are_private(tmp_path):
    """The cache folder's opener refuses a link standing at its name, and the parents it creates are
    0700 (os.makedirs would give them the umask's 0755)."""
    old = os.umask(0o022)
    try:
        fd = fp8_build._open_private_dir(tmp_path / "a" / "b" / "cache")
    finally:
        os.umask(old)
    os.close(fd)
    modes = {p: stat.S_IMODE((tmp_path / p).stat().st_mode) for p in ("a", "a/b", "a/b/cache")}
    assert modes == {"a": 0o700, "a/b": 0o700, "a/b/cache": 0o700}
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(fp8_build.UnsafeCache, match="symbolic link"):
        fp8_build._open_private_dir(tmp_path / "link")

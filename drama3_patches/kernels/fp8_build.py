"""Building the native fp8 kernel: the C compiler driver and the trust-checked library cache.

The C source is ``fp8_expand.c`` next to this module (package data); what it computes and how
it is checked after loading is in :mod:`drama3_patches.kernels.fp8_native`, which loads what
this module builds.

Environment: ``DRAMA3_PATCHES_CACHE_DIR`` (where the built library is kept; default
``$XDG_CACHE_HOME/drama3_patches`` or ``~/.cache/drama3_patches``), ``CC`` (the compiler;
default ``cc``/``gcc``/``clang``).

Trust: the library runs inside the server, often as root, so the cache is used
only when nobody else could have written it.  The folder (created 0700, with
0700 parents; never a link) must belong to this user and be closed to group and
others; the library must be a regular file of this user, closed to others,
opened without following a link and loaded through that open descriptor.  The
build goes through descriptors too: a private build folder made and opened
through the folder's descriptor, the compiler given ``/proc/<pid>/fd/N`` paths
of it, so whoever can rename a parent of the folder cannot swap the source the
compiler reads or the folder it writes into.  A folder that fails (or an explicit
one that does) is named in a warning and the kernel is built in a fresh private
temporary folder for this process.  A cached library that does not load is
rebuilt once; every compiler call has a timeout.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

from drama3_patches._bootstrap import cache_dir as _hook_cache_dir
from drama3_patches._bootstrap import check_private, open_private_dir
from drama3_patches.logger import init_logger

logger = init_logger(__name__)

SOURCE_NAME = "fp8_expand.c"
MAX_SOURCE_BYTES = 1 << 20  # the source is about 12 KiB

# Where the built kernel is cached (README's environment table).
CACHE_DIR_ENV = "DRAMA3_PATCHES_CACHE_DIR"
# Generous for a one-second build on a loaded host; a hung compiler must not hang the server.
COMPILE_TIMEOUT_S = 300
VERSION_TIMEOUT_S = 30
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


@functools.lru_cache(maxsize=1)
def source() -> str:
    """The kernel's C source, shipped next to this module; OSError when the install lacks it."""
    with open(Path(__file__).with_name(SOURCE_NAME), "rb") as fh:
        data = fh.read(MAX_SOURCE_BYTES + 1)
    if len(data) > MAX_SOURCE_BYTES:
        raise OSError(f"{SOURCE_NAME} is over {MAX_SOURCE_BYTES} bytes: not the kernel's source")
    return data.decode()


class UnsafeCache(OSError):
    """A cache folder or library another user could have written: never loaded."""


def _cache_dir() -> tuple[Path, bool]:
    """The cache folder, and whether $DRAMA3_PATCHES_CACHE_DIR named it: the start-up hook's folder
    (``_bootstrap.cache_dir``); without $HOME, the password database's home (a build may read it)."""
    folder = _hook_cache_dir() or os.path.join(os.path.expanduser("~"), ".cache", "drama3_patches")
    return Path(folder), bool(os.environ.get(CACHE_DIR_ENV))


def _check_private(st: os.stat_result, what: str) -> None:
    """Refuse what this user does not own or what others may write (UnsafeCache naming which)."""
    check_private(st, UnsafeCache,
                  foreign=lambda uid: f"{what} belongs to uid {uid}, not to this process (uid {os.geteuid()})",
                  writable=lambda mode: f"{what} is writable by group or others (mode {mode:04o})")


def _open_private_dir(path: Path, create: bool = True) -> int:
    """An fd of ``path`` (created 0700, with 0700 parents, when absent) after checking it is private
    to this user; a link at its name is refused.

    Everything after works relative to this fd, so renaming the path afterwards (by
    whoever can write its parent) cannot put another folder under us.
    """
    what = f"cache folder {path}"
    return open_private_dir(
        path, create, UnsafeCache,
        foreign=lambda uid: f"{what} belongs to uid {uid}, not to this process (uid {os.geteuid()})",
        writable=lambda mode: f"{what} is writable by group or others (mode {mode:04o})",
        link=lambda: f"{what} is a symbolic link, which is never followed")


def _open_library(name: str, dir_fd: int) -> int | None:
    """An fd of the library ``name`` in the folder, checked; None when absent; UnsafeCache when refused."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:  # ELOOP: a symbolic link stands there
        raise UnsafeCache(f"library {name} cannot be opened without following a link: {exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeCache(f"library {name} is not a regular file")
        _check_private(st, f"library {name}")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _compiler() -> str | None:
    for cand in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cand and shutil.which(cand.split()[0]):
            return cand
    return None


def _cpu_signature() -> str:
    # -march=native code must not run on another CPU: the cache key includes its features.
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def _flags(native: bool) -> list[str]:
    flags = ["-O3", "-fPIC", "-shared", "-pthread", "-ffp-contract=off", "-fno-fast-math"]
    if native:
        flags.append("-mcpu=native" if platform.machine() in ("aarch64", "arm64") else "-march=native")
    return flags


def _run(argv: list[str], timeout: float) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{' '.join(argv[:2])} ... did not finish within {timeout:.0f} s") from None


def _through_fd(fd: int) -> str:
    """A path to the folder ``fd`` that names that very folder in any process of this user:
    ``/proc/<pid>/fd/<fd>`` is resolved by the kernel to the inode this process holds, whatever
    anybody renames or links meanwhile (the compiler and its helpers are other processes, so not
    ``/proc/self``)."""
    path = f"/proc/{os.getpid()}/fd/{fd}"
    if not os.path.isdir(path):
        raise RuntimeError("the fp8 kernel is built only through descriptors, and /proc/<pid>/fd is "
                           "not available here (mount /proc)")
    return path


def _compile(cc: str, flags: list[str], dir_fd: int, name: str, where: Path) -> subprocess.CompletedProcess:
    """Compile into a fresh private folder inside the folder ``dir_fd``, then rename the library into it.

    All by descriptor: the build folder is made and checked through ``dir_fd``, the source written
    through the build folder's fd, and the compiler reads and writes through ``/proc/<pid>/fd/N``
    of that fd: nobody who can rename a parent of ``where`` can put another source under the
    compiler or another folder under its output. The rename is atomic: concurrent builders (several
    ranks) never see half a file.
    """
    build = f".build-{os.urandom(8).hex()}"  # a name nobody could guess
    os.mkdir(build, 0o700, dir_fd=dir_fd)
    try:
        build_fd = os.open(build, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _O_CLOEXEC, dir_fd=dir_fd)
        try:
            _check_private(os.fstat(build_fd), f"build folder {where / build}")
            src = os.open(SOURCE_NAME, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _O_CLOEXEC, 0o600,
                          dir_fd=build_fd)
            with os.fdopen(src, "w") as f:
                f.write(source())
            here = _through_fd(build_fd)
            proc = _run([*cc.split(), *flags, "-o", f"{here}/{name}", f"{here}/{SOURCE_NAME}"], COMPILE_TIMEOUT_S)
            if proc.returncode == 0:
                os.replace(name, name, src_dir_fd=build_fd, dst_dir_fd=dir_fd)
            return proc
        finally:
            for left in os.listdir(build_fd):
                try:
                    os.unlink(left, dir_fd=build_fd)
                except OSError:
                    pass
            os.close(build_fd)
    finally:
        try:
            os.rmdir(build, dir_fd=dir_fd)
        except OSError:
            pass


class Library:
    """A checked library: its path (for messages) and an open fd of exactly the file checked."""

    def __init__(self, path: Path, fd: int, temporary: str | None = None):
        self.path, self.fd, self.temporary = path, fd, temporary

    def load_path(self) -> str:
        # dlopen() by name would resolve the path again, after the checks, through folders
        # someone else may be able to rename: /proc/self/fd/N names the very inode checked,
        # so what is loaded is what was checked (the swap-after-check race is closed).
        proc = f"/proc/self/fd/{self.fd}"
        return proc if os.path.exists(proc) else str(self.path)

    def close(self) -> None:
        os.close(self.fd)
        if self.temporary:
            shutil.rmtree(self.temporary, ignore_errors=True)  # a loaded library stays mapped


def find_or_build(extra_flags: tuple[str, ...], cache_dir: Path | None, rebuild: bool) -> Library:
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set CC, or install gcc)")
    version = _run([*cc.split(), "--version"], VERSION_TIMEOUT_S).stdout
    explicit = cache_dir is not None
    if cache_dir is None:
        cache_dir, explicit = _cache_dir()
    try:
        dir_fd = _open_private_dir(cache_dir)
        try:
            return _in_folder(cc, version, extra_flags, cache_dir, dir_fd, rebuild)
        finally:
            os.close(dir_fd)
    except OSError as exc:
        # Not ours, open to others, a link or FIFO planted, or not writable (a read-only
        # home): build where nobody else can write, for this process only, and say why.
        why = f"{exc}" if isinstance(exc, UnsafeCache) else f"cache folder {cache_dir}: {exc}"
        how = f"{CACHE_DIR_ENV}={cache_dir} is refused" if explicit else "the kernel cache is not used"
        logger.warning("fp8 expansion: %s (%s); building in a private temporary folder instead "
                       "(fix: a folder of this user, mode 700%s)", how, why,
                       "" if explicit else f", or set {CACHE_DIR_ENV}")
    temporary = Path(tempfile.mkdtemp(prefix="drama3_patches-"))  # 0700, unpredictable name
    try:
        dir_fd = _open_private_dir(temporary, create=False)
        try:
            lib = _in_folder(cc, version, extra_flags, temporary, dir_fd, rebuild=False)
        finally:
            os.close(dir_fd)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    lib.temporary = str(temporary)
    return lib


def _in_folder(cc: str, version: str, extra_flags: tuple[str, ...], folder: Path, dir_fd: int,
               rebuild: bool) -> Library:
    """The checked library in a checked folder: found there, or compiled into it."""
    errors = []
    for native in (True, False):
        flags = _flags(native) + list(extra_flags)
        key = hashlib.sha256("\0".join([source(), cc, version, *flags, platform.machine(),
                                        _cpu_signature()]).encode()).hexdigest()[:16]
        name = f"fp8_expand-{key}.so"
        if rebuild:
            try:
                os.unlink(name, dir_fd=dir_fd)
            except FileNotFoundError:
                pass
        fd = _open_library(name, dir_fd)
        if fd is None:
            proc = _compile(cc, flags, dir_fd, name, folder)
            if proc.returncode != 0:
                errors.append(f"{cc} {' '.join(flags)}: {proc.stderr.strip()[-2000:]}")
                continue
            fd = _open_library(name, dir_fd)
            if fd is None:
                raise RuntimeError(f"the built library {name} vanished from {folder}")
        return Library(folder / name, fd)
    raise RuntimeError("building the fp8 kernel failed: " + " | ".join(errors))


def build(extra_flags: tuple[str, ...] = (), cache_dir: Path | None = None, rebuild: bool = False) -> Path:
    """Compile the kernel (or find it in the cache) and return the checked library's path; raises on failure.

    For tests and tools that load it themselves; :func:`drama3_patches.kernels.fp8_native.load`
    keeps the checked file open instead.
    """
    lib = find_or_build(extra_flags, cache_dir, rebuild)
    lib.temporary = None  # the caller loads it by path: keep it
    lib.close()
    return lib.path



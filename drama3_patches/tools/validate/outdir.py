"""validate's output folder, validate's own: checked once through a descriptor and written through it.

validate runs as root and writes the report, the log, the served deploy file and the host's facts
into ``--out``. A folder another user owns or can write could hold, by the time a file is written,
a link to a root file elsewhere, a FIFO, or another checkpoint. So:

* an existing ``--out`` must be a folder (not a link) owned by this user and writable by no group
  or other user, else it is refused as a bad argument before anything runs; one that does not
  exist is made 0700 (missing parents 0700 too) and checked the same way;
* the folder is opened once (``O_NOFOLLOW``) and every file and subfolder is made through that
  descriptor: files 0600, created exclusively (``O_EXCL``, never through a link), replaced whole
  through a temporary of random name (``_bootstrap.replace_file``); subfolders 0700;
* ``--force`` removes the earlier outputs through the same descriptor;
* the server is handed paths, so :meth:`OutFolder.same_path` tells whether the path still names
  the checked folder (checked before the server starts, and after it stops).
"""

from __future__ import annotations

import os
import pwd
import shutil
import stat
import sys
from pathlib import Path

from drama3_patches.tools.files import InputError

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def _owner(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _open_checked(name, what: str, dir_fd: int | None = None) -> int:
    """A descriptor of the folder ``name`` (not a link), owned by this user and not writable by
    group or others; InputError naming the owner and mode otherwise."""
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except OSError:
            st = None
        kind = "a symbolic link" if st is not None and stat.S_ISLNK(st.st_mode) else "not a folder"
        raise InputError(f"{what} exists and is {kind} ({exc.strerror}); give a new folder") from None
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        os.close(fd)
        raise InputError(f"{what} is owned by {_owner(st.st_uid)} with mode {stat.S_IMODE(st.st_mode):04o}: "
                         f"validate writes only into a folder of its own ({_owner(os.geteuid())}, not writable "
                         "by group or others); give a new path")
    return fd


class OutFolder:
    """``--out``: :meth:`check` at the argument check, :meth:`create` once the host check passed."""

    def __init__(self, path, fd: int | None = None) -> None:
        self.path = Path(os.path.abspath(path))  # as given, links not resolved: the checks say what it is
        self.fd = fd

    def __truediv__(self, name: str) -> Path:
        """The path of ``name`` in the folder (for messages and for the server, which takes paths)."""
        return self.path / name

    def check(self, force: bool) -> None:
        """Refuse (InputError) an ``--out`` that exists but is not this user's private empty folder
        (not empty is allowed with ``force``); keep its descriptor."""
        if not os.path.lexists(self.path):
            return
        fd = _open_checked(self.path, f"--out {self.path}")
        if not force:
            with os.scandir(fd) as entries:
                if next(entries, None) is not None:
                    os.close(fd)
                    raise InputError(f"--out {self.path} exists and is not an empty folder; give a new one, "
                                     "or --force")
        self.fd = fd

    def create(self) -> None:
        """Make the folder (0700) where :meth:`check` found none, and check what is there now."""
        if self.fd is not None:
            return
        os.makedirs(self.path.parent, mode=0o700, exist_ok=True)
        try:
            os.mkdir(self.path, 0o700)
        except FileExistsError:
            pass  # made since the argument check: checked below like any existing folder
        self.check(force=False)
        if self.fd is None:
            raise InputError(f"--out {self.path} vanished while it was made; give it again")

    def same_path(self) -> bool:
        """Whether the path still names the checked folder (the server is given paths under it)."""
        try:
            st, mine = os.stat(self.path), os.fstat(self.fd)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)

    def write(self, name: str, data) -> None:
        """``name`` replaced whole by ``data`` (text or bytes), 0600, through the descriptor."""
        from drama3_patches._bootstrap import replace_file

        replace_file(self.fd, name, data.encode("utf-8") if isinstance(data, str) else data)

    def open_new(self, name: str):
        """A new file ``name`` (0600, never through a link, never an existing one) open for writing."""
        return os.fdopen(os.open(name, _NEW_FILE, 0o600, dir_fd=self.fd), "wb")

    def folder(self, name: str) -> OutFolder:
        """The subfolder ``name``, made 0700 if absent, checked like the folder itself."""
        try:
            os.mkdir(name, 0o700, dir_fd=self.fd)
        except FileExistsError:
            pass
        return OutFolder(self.path / name, _open_checked(name, f"{self.path / name}", dir_fd=self.fd))

    def clear(self, names) -> None:
        """Remove ``names`` (files, links, folders) from the folder, through its descriptor: a link
        is removed, never followed; nothing outside the checked folder is touched."""
        for name in names:
            try:
                st = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if stat.S_ISDIR(st.st_mode):
                if sys.version_info >= (3, 11):
                    shutil.rmtree(name, dir_fd=self.fd)
                else:  # no dir_fd before 3.11: the same folder, named through this process's descriptor
                    shutil.rmtree(f"/proc/self/fd/{self.fd}/{name}")
            else:
                os.unlink(name, dir_fd=self.fd)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

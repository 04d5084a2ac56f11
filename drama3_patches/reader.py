"""The package's one bounded file reader: a regular file of bounded size, never a blocking open.

Standard library only, imported at interpreter start when the start-up list is not cached
(the start-up scan reads the manifest with it), so it stays small; the operator commands read
every input file through it too (``tools/files.py``).
"""

import os
import stat

# The shipped manifest is about 20 KB; anything past this is not a manifest.
MANIFEST_MAX_BYTES = 1 << 20
MIB = 1 << 20


class UnreadableFile(OSError):
    """A file :func:`read_regular` refused; the message is one line naming the path and why.
    ``kind``: ``link``, ``not-regular``, ``foreign-owner``, ``shared-writable``, ``too-large`` or
    ``unreadable``; ``st``: the open file's ``fstat`` where it got that far, else None."""

    def __init__(self, message: str, kind: str = "unreadable", st: os.stat_result | None = None):
        super().__init__(message)
        self.kind, self.st = kind, st


def read_regular(path: str, limit: int, what: str = "file", follow: bool = True, owners=None,
                 private: bool = False) -> tuple[bytes, os.stat_result]:
    """(contents, stat) of a regular file of at most ``limit`` bytes, else :class:`UnreadableFile`.

    The one bounded reader of the package: the start-up scan and the manifest loader use it at
    every interpreter start, the operator commands for every input file (tools/files.py). Opened
    non-blocking (a FIFO cannot stall the open) and checked with ``fstat`` on the descriptor that
    is read, so the answer holds for the bytes read; a device (``/dev/zero``) or a huge file is
    refused, and the read stops at ``limit + 1`` bytes whatever the size said. ``follow=False``
    refuses a symbolic link (``O_NOFOLLOW``): for files in a folder others may write.
    ``owners`` (uids) refuses a file of any other owner and ``private`` one that group or others
    may write, both from that ``fstat``, before a byte is read.
    """
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    if not follow:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if not follow and os.path.islink(path):
            raise UnreadableFile(f"{path}: a symbolic link; not followed", "link") from None
        raise UnreadableFile(f"{path}: cannot read {what}: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnreadableFile(f"{path}: not a regular file ({_kind(st.st_mode)}); a {what} must be one",
                                 "not-regular", st)
        if owners is not None and st.st_uid not in owners:
            raise UnreadableFile(f"{path}: owned by uid {st.st_uid}, not by root or this user (uid {os.geteuid()}): "
                                 f"another user could have written this {what}; not read (chown it to root or "
                                 "to this user)", "foreign-owner", st)
        if private and st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise UnreadableFile(f"{path}: writable by group or others (mode {stat.S_IMODE(st.st_mode):o}); "
                                 f"a {what} others can write is not read (chmod go-w it)", "shared-writable", st)
        if st.st_size > limit:
            raise UnreadableFile(f"{path}: {_size(st.st_size)}, over the {_size(limit)} limit for a {what}",
                                 "too-large", st)
        chunks, left = [], limit + 1
        while left > 0:
            try:
                chunk = os.read(fd, min(left, MIB))
            except BlockingIOError:  # only non-regular files block; checked above, so a race: refuse
                raise UnreadableFile(f"{path}: changed while read; not read", st=st) from None
            except OSError as exc:
                raise UnreadableFile(f"{path}: cannot read {what}: {exc.strerror or exc}", st=st) from None
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        if len(data) > limit:
            raise UnreadableFile(f"{path}: grew past the {_size(limit)} limit for a {what} while read", "too-large", st)
        return data, st
    finally:
        os.close(fd)


def read_text(path: str, limit: int, what: str = "file") -> str:
    """:func:`read_regular`, decoded as UTF-8; a bad byte is one line naming its offset."""
    data, _ = read_regular(path, limit, what)
    return decode_text(data, path, what)


def decode_text(data: bytes, path: str, what: str = "file") -> str:
    """``data`` (read from ``path``) as UTF-8 text, else :class:`UnreadableFile` naming the offset."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UnreadableFile(f"{path}: not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset "
                             f"{exc.start}); save the {what} as UTF-8") from None


def read_manifest(path: str) -> tuple[bytes, os.stat_result]:
    """The manifest's bytes and stat: a regular file of at most 1 MiB, owned by root or this user
    and not writable by group or others (it decides what code runs where), else
    :class:`UnreadableFile`. The start-up scan and the engine's loader both read it here."""
    return read_regular(path, MANIFEST_MAX_BYTES, "manifest", owners=(0, os.geteuid()), private=True)


def read_manifest_text(path: str) -> str:
    data, _ = read_manifest(path)
    return decode_text(data, path, "manifest")


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a plain file"


def _size(n: int) -> str:
    return f"{n / MIB:.1f} MiB" if n >= MIB else f"{n} bytes"

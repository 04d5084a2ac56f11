"""Reading an operator's input files safely: regular files only, of bounded size, never a hang.

Every operator command reads what it is given through :func:`read_regular`, so a FIFO
(which would block ``open``), a device (``/dev/zero``: endless), or a file far larger than
its kind ever is becomes one line naming the file and the limit, not a hang or an
exhausted host. :class:`InputError` is that line; ``drama3_patches.tools.main`` prints it.
"""

from __future__ import annotations

import os
import re
import stat

MIB = 1024 ** 2


class InputError(Exception):
    """Bad operator input (a file, a value): the message is one line naming it and the fix."""


def read_regular(path: str, limit: int, what: str = "file", follow: bool = True) -> tuple[bytes, os.stat_result]:
    """(contents, stat) of a regular file of at most ``limit`` bytes.

    Opened non-blocking (a FIFO cannot stall the open) and checked with ``fstat`` on the
    descriptor that is read, so the answer holds for the bytes read. ``follow=False``
    refuses a symbolic link (``O_NOFOLLOW``): for files in a folder others may write.
    The read itself stops at ``limit + 1`` bytes whatever the size said.
    """
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    if not follow:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if not follow and os.path.islink(path):
            raise InputError(f"{path}: a symbolic link; not followed") from None
        raise InputError(f"{path}: cannot read {what}: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InputError(f"{path}: not a regular file ({_kind(st.st_mode)}); a {what} must be one")
        if st.st_size > limit:
            raise InputError(f"{path}: {_size(st.st_size)}, over the {_size(limit)} limit for a {what}")
        chunks, left = [], limit + 1
        while left > 0:
            try:
                chunk = os.read(fd, min(left, MIB))
            except BlockingIOError:  # only non-regular files block; checked above, so a race: refuse
                raise InputError(f"{path}: changed while read; not read") from None
            except OSError as exc:
                raise InputError(f"{path}: cannot read {what}: {exc.strerror or exc}") from None
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        if len(data) > limit:
            raise InputError(f"{path}: grew past the {_size(limit)} limit for a {what} while read")
        return data, st
    finally:
        os.close(fd)


def read_text(path: str, limit: int, what: str = "file") -> str:
    """:func:`read_regular`, decoded as UTF-8; a bad byte is one line naming its offset."""
    data, _ = read_regular(path, limit, what)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"{path}: not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset {exc.start}); "
                         f"save the {what} as UTF-8") from None


# C0 and C1 controls and DEL: a terminal obeys them (colours, cursor moves, title changes),
# so text that came from a file is never printed with them in.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text, newlines: bool = False) -> str:
    """``text`` with every control character shown as ``\\xNN`` (tabs kept; newlines only when
    ``newlines``), so printing it cannot drive the terminal."""
    text = str(text)
    if not newlines:
        text = text.replace("\n", "\\x0a")
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a link")):
        if test(mode):
            return name
    return "not a plain file"


def _size(n: int) -> str:
    return f"{n / MIB:.1f} MiB" if n >= MIB else f"{n} bytes"

"""Reading an operator's input files safely: regular files only, of bounded size, never a hang.

Every operator command reads what it is given through :func:`read_regular`, so a FIFO
(which would block ``open``), a device (``/dev/zero``: endless), or a file far larger than
its kind ever is becomes one line naming the file and the limit, not a hang or an
exhausted host. :class:`InputError` is that line; ``drama3_patches.tools.main`` prints it.
"""

from __future__ import annotations

import os
import re

from drama3_patches import env
from drama3_patches.env import MIB  # noqa: F401 (the tools import it from here)


class InputError(Exception):
    """Bad operator input (a file, a value): the message is one line naming it and the fix."""


def read_regular(path: str, limit: int, what: str = "file", follow: bool = True) -> tuple[bytes, os.stat_result]:
    """(contents, stat) of a regular file of at most ``limit`` bytes (:func:`drama3_patches.env.read_regular`,
    the package's one bounded reader); a refusal is an :class:`InputError`."""
    try:
        return env.read_regular(path, limit, what, follow)
    except env.UnreadableFile as exc:
        raise InputError(str(exc)) from None


def read_text(path: str, limit: int, what: str = "file") -> str:
    """:func:`read_regular`, decoded as UTF-8; a bad byte is one line naming its offset."""
    try:
        return env.read_text(path, limit, what)
    except env.UnreadableFile as exc:
        raise InputError(str(exc)) from None


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

"""The environment contract (docs/design.md): variable names, flag parsing, warnings, manifest path.

A leaf: standard library only, and it imports nothing of this package, so the
``.pth`` hook, the engine and the tools all read the environment the same way.
"""

from __future__ import annotations

import os
import stat
import sys

ENABLE = "DRAMA3_PATCHES"
DISABLE = "DRAMA3_PATCHES_DISABLE"
STRICT = "DRAMA3_PATCHES_STRICT"
PLATFORM = "DRAMA3_PATCHES_PLATFORM"
REPORT_DIR = "DRAMA3_PATCHES_REPORT_DIR"
MANIFEST = "DRAMA3_PATCHES_MANIFEST"
TP_CHECK = "DRAMA3_PATCHES_TP_CHECK"

TRUE = ("1", "true", "yes", "on")
FALSE = ("", "0", "false", "no", "off")
PLATFORMS = ("npu", "cuda", "cpu")

_warned: set[str] = set()


def warn_once(key: str, message: str) -> None:
    """One stderr line per key and process (logging may not be configured this early)."""
    if key not in _warned:
        _warned.add(key)
        sys.stderr.write(f"drama3-patches: warning: {message}\n")


def soft_failure(what: str, exc: BaseException) -> None:
    """An error of ours inside the host's import: raised under STRICT, else one warning per process.

    Outside DRAMA3_PATCHES_STRICT=1 nothing the package does may make the host's
    import fail; the process goes on with the original code.
    """
    if strict():
        raise exc
    cause = " ".join(str(exc).split())  # one line, even for YAML's multi-line messages
    warn_once(
        "soft-failure",
        f"{what}: {type(exc).__name__}: {cause}; the import proceeds unpatched "
        f"(fix the cause, or set {STRICT}=1 to make this an error)",
    )


# The shipped manifest is about 20 KB; anything past this is not a manifest.
MANIFEST_MAX_BYTES = 1 << 20
MIB = 1 << 20


class UnreadableFile(OSError):
    """A file :func:`read_regular` refused; the message is one line naming the path and why."""


def read_regular(path: str, limit: int, what: str = "file", follow: bool = True) -> tuple[bytes, os.stat_result]:
    """(contents, stat) of a regular file of at most ``limit`` bytes, else :class:`UnreadableFile`.

    The one bounded reader of the package: the start-up scan and the manifest loader use it at
    every interpreter start, the operator commands for every input file (tools/files.py). Opened
    non-blocking (a FIFO cannot stall the open) and checked with ``fstat`` on the descriptor that
    is read, so the answer holds for the bytes read; a device (``/dev/zero``) or a huge file is
    refused, and the read stops at ``limit + 1`` bytes whatever the size said. ``follow=False``
    refuses a symbolic link (``O_NOFOLLOW``): for files in a folder others may write.
    """
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    if not follow:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if not follow and os.path.islink(path):
            raise UnreadableFile(f"{path}: a symbolic link; not followed") from None
        raise UnreadableFile(f"{path}: cannot read {what}: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnreadableFile(f"{path}: not a regular file ({_kind(st.st_mode)}); a {what} must be one")
        if st.st_size > limit:
            raise UnreadableFile(f"{path}: {_size(st.st_size)}, over the {_size(limit)} limit for a {what}")
        chunks, left = [], limit + 1
        while left > 0:
            try:
                chunk = os.read(fd, min(left, MIB))
            except BlockingIOError:  # only non-regular files block; checked above, so a race: refuse
                raise UnreadableFile(f"{path}: changed while read; not read") from None
            except OSError as exc:
                raise UnreadableFile(f"{path}: cannot read {what}: {exc.strerror or exc}") from None
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        if len(data) > limit:
            raise UnreadableFile(f"{path}: grew past the {_size(limit)} limit for a {what} while read")
        return data, st
    finally:
        os.close(fd)


def read_text(path: str, limit: int, what: str = "file") -> str:
    """:func:`read_regular`, decoded as UTF-8; a bad byte is one line naming its offset."""
    data, _ = read_regular(path, limit, what)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UnreadableFile(f"{path}: not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset "
                             f"{exc.start}); save the {what} as UTF-8") from None


def read_manifest_text(path: str) -> str:
    return read_text(path, MANIFEST_MAX_BYTES, "manifest")


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a plain file"


def _size(n: int) -> str:
    return f"{n / MIB:.1f} MiB" if n >= MIB else f"{n} bytes"


def flag_value(raw: str | None) -> bool | None:
    """True / False for an accepted spelling, None for one that is not understood."""
    value = (raw or "").strip().lower()
    if value in TRUE:
        return True
    if value in FALSE:
        return False
    return None


def parse_flag(name: str) -> bool:
    """Read a boolean variable as docs/design.md says; bad values warn once and count as off."""
    raw = os.environ.get(name)
    value = flag_value(raw)
    if value is None:
        warn_once(
            name,
            f"{name}={raw!r} is not understood; accepted values are "
            f"{'/'.join(TRUE)} (enable) or {'/'.join(v for v in FALSE if v)}/empty "
            "(disable); treating it as disabled",
        )
        return False
    return value


def enabled() -> bool:
    return parse_flag(ENABLE)


def strict() -> bool:
    return parse_flag(STRICT)


def tp_check() -> bool:
    """Compare each step's sampled frames across the tensor-parallel group (off by default)."""
    return parse_flag(TP_CHECK)


def disabled_ids() -> set[str]:
    raw = os.environ.get(DISABLE, "")
    return {part.strip() for part in raw.split(",") if part.strip()}


def platform_override() -> str | None:
    """The platform $DRAMA3_PATCHES_PLATFORM names, None when unset; a bad value warns once."""
    raw = os.environ.get(PLATFORM, "").strip().lower()
    if not raw:
        return None
    if raw in PLATFORMS:
        return raw
    warn_once(PLATFORM, f"{PLATFORM}={raw!r} is not one of {'|'.join(PLATFORMS)}; detecting instead")
    return None


def manifest_path() -> str:
    """The manifest in force: $DRAMA3_PATCHES_MANIFEST, the packaged copy, or the source tree's."""
    override = os.environ.get(MANIFEST)
    if override:
        return override
    here = os.path.dirname(os.path.abspath(__file__))
    packaged = os.path.join(here, "patches_manifest.yaml")
    if os.path.exists(packaged):
        return packaged
    return os.path.join(os.path.dirname(here), "patches_manifest.yaml")

"""``drama3-patches deploy-config [PROFILE] [--out FILE]``: print or write a shipped deploy config."""

from __future__ import annotations

import os
import sys


def register(sub) -> None:
    from drama3_patches.tools.deploy_config.profiles import DEFAULT_PROFILE, PROFILES

    p = sub.add_parser(
        "deploy-config",
        help="print or write one of the shipped vLLM-Omni deploy configs",
        description="Profiles: " + ", ".join(
            f"{name} ({'default' if name == DEFAULT_PROFILE else 'option'})" for name in sorted(PROFILES)
        ),
    )
    p.add_argument("profile", nargs="?", default=DEFAULT_PROFILE, help=f"profile name (default {DEFAULT_PROFILE})")
    p.add_argument("--out", metavar="FILE", help="write the config to FILE instead of standard output "
                                                 "(a new file; an existing one only with --force)")
    p.add_argument("--force", action="store_true", help="with --out: overwrite FILE if it exists")
    p.add_argument("--list", action="store_true", help="list the profiles and exit")
    p.set_defaults(func=run)


def _write(path: str, text: str, force: bool) -> None:
    """A new file (created exclusively), or with ``force`` an existing regular one truncated;
    opened non-blocking so a FIFO at ``path`` is an error, not a hang."""
    import stat

    flags = os.O_WRONLY | os.O_CREAT | getattr(os, "O_NONBLOCK", 0) | (os.O_TRUNC if force else os.O_EXCL)
    fd = os.open(path, flags, 0o644)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a regular file")
        os.set_blocking(fd, True)
        with os.fdopen(fd, "w", encoding="utf-8", closefd=False) as fh:
            fh.write(text)
    finally:
        os.close(fd)


def run(args) -> int:
    from drama3_patches.tools.deploy_config.profiles import PROFILES, profile_names, profile_text, validate

    if getattr(args, "list", False):
        for name in profile_names():
            print(f"{name}\t{PROFILES[name]}")
        return 0
    if args.profile not in PROFILES:
        print(f"drama3-patches deploy-config: unknown profile {args.profile!r}; "
              f"known: {', '.join(profile_names())}", file=sys.stderr)
        return 2
    text = profile_text(args.profile)
    import yaml

    problems = validate(yaml.safe_load(text))
    if problems:
        # A shipped config that fails its own schema is a packaging bug: say so, write nothing.
        for line in problems:
            print(f"drama3-patches deploy-config: {args.profile}: {line}", file=sys.stderr)
        return 1
    if args.out:
        exists = f"drama3-patches deploy-config: {args.out} exists; pass --force to overwrite it"
        if not args.force and os.path.lexists(args.out):
            print(exists, file=sys.stderr)
            return 2
        try:
            _write(args.out, text, args.force)
        except FileExistsError:  # created between the check and the write
            print(exists, file=sys.stderr)
            return 2
        except OSError as exc:
            print(f"drama3-patches deploy-config: cannot write {args.out}: {exc.strerror or exc}", file=sys.stderr)
            return 1
        print(f"wrote {args.profile} to {args.out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0

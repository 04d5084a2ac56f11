"""``drama3-patches deploy-config [PROFILE] [--out FILE]``: print or write a shipped deploy config."""

from __future__ import annotations

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
    p.add_argument("--out", metavar="FILE", help="write the config to FILE instead of standard output")
    p.add_argument("--list", action="store_true", help="list the profiles and exit")
    p.set_defaults(func=run)


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
        try:
            with open(args.out, "w", encoding="utf-8") as fh:
                fh.write(text)
        except OSError as exc:
            print(f"drama3-patches deploy-config: cannot write {args.out}: {exc.strerror}", file=sys.stderr)
            return 1
        print(f"wrote {args.profile} to {args.out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0

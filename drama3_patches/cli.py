"""``drama3-patches``: status, list and the operator commands.

Each subcommand lives in ``drama3_patches/commands/<name>.py`` with
``register(subparsers)``; heavy imports happen inside the command's ``run``.
Exit codes: 0 all good, 1 a patch (or check) failed, 2 usage error.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = ("status", "listing", "deploy_config", "plan", "doctor", "bench")


def build_parser() -> argparse.ArgumentParser:
    from drama3_patches import __version__

    parser = argparse.ArgumentParser(
        prog="drama3-patches",
        description="Fish Audio Drama 3 on Ascend NPUs with vLLM-Omni: patch status and operator tools.",
    )
    parser.add_argument("--version", action="version", version=f"drama3-patches {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"drama3_patches.commands.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"drama3_patches.commands.{name}":
                continue
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("drama3-patches: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())

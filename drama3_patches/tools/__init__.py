"""``drama3-patches``: the operator tools, apart from the serving path.

No serving process imports this package: the patches, the engine and the
start-up hook live beside it in ``drama3_patches``.  Each subcommand is the
module or package of its name here (``list`` -> ``tools.list``, ``deploy-config``
-> ``tools.deploy_config``), holding its command line (``register(subparsers)``)
and its logic; heavy imports happen inside the command's ``run``.
Exit codes: 0 all good, 1 a patch (or check) failed, 2 usage error.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = ("status", "list", "deploy_config", "plan", "doctor", "bench")


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
            module = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"{__name__}.{name}":
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


"""``drama3-patches``: the operator tools, apart from the serving path.

No serving process imports this package: the patches, the engine and the
start-up hook live beside it in ``drama3_patches``.  Each subcommand is the
module or package of its name here (``list`` -> ``tools.list``, ``deploy-config``
-> ``tools.deploy_config``), holding its command line (``register(subparsers)``)
and its logic; heavy imports happen inside the command's ``run``.
Exit codes: 0 all good, 1 a patch (or check) failed, 2 bad input (usage, a file that
cannot be used), 70 a bug in this package.

Bad input never ends in a traceback: a command raises :class:`~drama3_patches.tools.files.InputError`
(or returns 2 itself) and :func:`main` prints its one line.  Anything else that escapes a
command is a bug; it is shown in full, said to be one, and exits 70.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import traceback

COMMANDS = ("status", "list", "deploy_config", "plan", "doctor", "bench", "tiny_model", "validate", "frame_time",
            "overlay", "drift")


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
    from drama3_patches.tools.files import InputError, printable

    parser = build_parser()
    args = parser.parse_args(argv)
    name = f"drama3-patches {args.command}"
    try:
        return int(args.func(args) or 0)
    except InputError as exc:
        print(f"{name}: {printable(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except Exception:  # not bad input (that is InputError): a bug, shown whole rather than hidden
        traceback.print_exc()
        print(f"{name}: this is a bug in drama3-patches, not a problem with your input; please report it "
              "with the traceback above and the command line", file=sys.stderr)
        return 70


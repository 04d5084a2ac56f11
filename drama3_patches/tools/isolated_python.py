"""Python children that never import from the folder they were started in.

The tools run as root, often from a folder others can write (``/tmp``, a shared checkout). A
plain ``python -c``/``python -m`` child puts its working folder first on ``sys.path``, so a
planted ``json.py`` or ``argparse.py`` there would run as root. Every Python child the package
starts is built here instead:

* ``-P`` (Python 3.11+): neither the working folder nor a script's folder goes on ``sys.path``.
  Not ``-I``: that also drops ``PYTHONPATH``, which an Ascend host needs (the CANN toolkit's
  ``set_env.sh`` puts its Python packages there, and ``torch_npu`` imports them). On Python 3.10,
  which has no ``-P``, the child runs a two-line prologue that drops ``sys.path[0]`` (the working
  folder) before it imports anything, then the code or module asked for.
* ``-s`` where this interpreter runs without the user's site folder: a child sees no folder its
  parent did not.
* ``PYTHONPATH`` keeps only absolute entries: an empty or relative entry names the working
  folder again.
"""

from __future__ import annotations

import os
import site
import subprocess
import sys

# Python 3.10: drop the working folder (sys.path[0] for -c and -m) before anything is imported
# from it, then run what was asked (argv: "-c" CODE ... or "-m" MODULE ...).
_PROLOGUE = """\
import sys
del sys.path[0]
mode, what = sys.argv[1:3]
sys.argv = [what if mode == "-m" else "-c"] + sys.argv[3:]
if mode == "-c":
    exec(compile(what, "<string>", "exec"), {"__name__": "__main__"})
else:
    import runpy
    runpy.run_module(what, run_name="__main__", alter_sys=True)
"""


def argv(mode: str, what: str, *args: str, safe_path_flag: bool | None = None) -> list[str]:
    """The command line of a child running ``-c CODE`` or ``-m MODULE`` (``mode``) with ``args``.
    ``safe_path_flag`` picks ``-P`` (default: where this Python has it) or the 3.10 prologue."""
    if mode not in ("-c", "-m"):
        raise ValueError(f"mode must be -c or -m, not {mode!r}")
    if safe_path_flag is None:
        safe_path_flag = sys.version_info >= (3, 11)
    flags = [] if site.ENABLE_USER_SITE else ["-s"]
    if safe_path_flag:
        return [sys.executable, "-P", *flags, mode, what, *args]
    return [sys.executable, *flags, "-c", _PROLOGUE, mode, what, *args]


def environ(base: dict | None = None) -> dict:
    """``base`` (default this process's environment) with only absolute ``PYTHONPATH`` entries."""
    env = dict(os.environ if base is None else base)
    if "PYTHONPATH" in env:
        kept = [p for p in env["PYTHONPATH"].split(os.pathsep) if os.path.isabs(p)]
        if kept:
            env["PYTHONPATH"] = os.pathsep.join(kept)
        else:
            del env["PYTHONPATH"]
    return env


def run(mode: str, what: str, *args: str, timeout: float, env: dict | None = None,
        safe_path_flag: bool | None = None, **kwargs) -> subprocess.CompletedProcess:
    """:func:`subprocess.run` of an isolated child (output captured, no stdin); raises what it does."""
    if "input" not in kwargs:
        kwargs["stdin"] = subprocess.DEVNULL
    return subprocess.run(argv(mode, what, *args, safe_path_flag=safe_path_flag), env=environ(env),
                          capture_output=True, timeout=timeout, **kwargs)

"""Run code in a fresh interpreter with the project importable (tier 1 and replica tests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def child_env(env: dict | None = None, pythonpath: list | None = None) -> dict:
    base = {k: v for k, v in os.environ.items() if not k.startswith("DRAMA3_PATCHES")}
    paths = [str(p) for p in (pythonpath or [])] + [str(ROOT)]
    if base.get("PYTHONPATH"):
        paths.append(base["PYTHONPATH"])
    base["PYTHONPATH"] = os.pathsep.join(paths)
    base.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    base.update({k: str(v) for k, v in (env or {}).items()})
    return base


def run_python(code: str, env: dict | None = None, pythonpath: list | None = None,
               timeout: float = 300, check: bool = True, args: list | None = None,
               executable: str | None = None) -> subprocess.CompletedProcess:
    """Run ``code`` in ``python -c``; with ``check`` a non-zero exit fails with both streams shown."""
    proc = subprocess.run(
        [executable or sys.executable, "-c", textwrap.dedent(code), *(args or [])],
        env=child_env(env, pythonpath), capture_output=True, text=True, timeout=timeout,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"child exited {proc.returncode}\n--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}"
        )
    return proc


def result_of(proc: subprocess.CompletedProcess, tag: str = "RESULT"):
    """The JSON a child printed last behind ``tag`` (``print(tag + json.dumps(...))``)."""
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(tag)]
    if not lines:
        raise AssertionError(f"the child printed no {tag} line\n--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}")
    return json.loads(lines[-1][len(tag):])


def run_cli(*argv: str, env: dict | None = None, pythonpath: list | None = None,
            timeout: float = 300) -> subprocess.CompletedProcess:
    """``drama3-patches ARGV`` as a fresh process (through ``python -m``, so no install is needed)."""
    return subprocess.run(
        [sys.executable, "-m", "drama3_patches.tools", *argv],
        env=child_env(env, pythonpath), capture_output=True, text=True, timeout=timeout,
    )

"""Upstream replica profiles (tests/replicas/<name>/): where they are and how a child uses them.

A profile is a sys.path root of stand-ins for one upstream version of vllm-ascend or vllm-omni
(with its dist-info, so version guards read it). Profiles are combined: an omni profile needs an
ascend profile beside it, as vllm-omni's NPU workers subclass vllm-ascend's.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

REPLICAS = Path(__file__).resolve().parents[1] / "replicas"

ASCEND_MAIN = "ascend_main_2608"      # vllm-ascend public main, 2026-08-22
ASCEND_032 = "ascend_032"             # vllm-ascend 0.32 as the port used it
ASCEND_FIXED = "ascend_synthetic_fixed"  # synthetic: the Mamba manager already takes prefill_end
OMNI_030 = "omni_030"                 # vllm-omni 0.30.0 wheel

#: The real (non-synthetic) vllm-ascend profiles, each paired with vllm-omni 0.30.0.
ASCEND_PROFILES = (ASCEND_MAIN, ASCEND_032)


def profile(name: str) -> Path:
    path = REPLICAS / name
    if not path.is_dir():
        raise FileNotFoundError(f"no replica profile {name!r} under {REPLICAS}")
    return path


def profile_paths(*names: str) -> list[Path]:
    """The sys.path roots for ``names``, in order (first wins, like PYTHONPATH)."""
    return [profile(n) for n in names]


def npu_env(**extra: str) -> dict[str, str]:
    """Environment of a child that applies the patches as on an Ascend host."""
    env = {"DRAMA3_PATCHES": "1", "DRAMA3_PATCHES_PLATFORM": "npu"}
    env.update(extra)
    return env


def pythonpath_with(*names: str, base: str | None = None) -> str:
    """A PYTHONPATH value with the profiles first, then ``base`` (default: the current one)."""
    parts = [str(p) for p in profile_paths(*names)]
    rest = os.environ.get("PYTHONPATH", "") if base is None else base
    if rest:
        parts.append(rest)
    return os.pathsep.join(parts)


@contextlib.contextmanager
def on_sys_path(*names: str):
    """Put profiles first on this process's sys.path; restore sys.path and forget the modules
    imported from them on exit. Prefer a child process (``npu_env`` + ``profile_paths`` with
    ``tests.support.subproc.run_python``) for anything that patches real classes."""
    roots = [str(p) for p in profile_paths(*names)]
    saved = list(sys.path)
    before = set(sys.modules)
    sys.path[:0] = roots
    try:
        yield roots
    finally:
        sys.path[:] = saved
        for name in set(sys.modules) - before:
            origin = getattr(sys.modules[name], "__file__", None) or ""
            if any(origin.startswith(root) for root in roots):
                del sys.modules[name]

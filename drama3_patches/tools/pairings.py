"""The version pairs that can run together: one table for the test matrix and ``doctor``.

Standard library only, and importable by file path: ``noxfile.py`` loads it
without installing the project, and ``doctor`` checks a host against it.

The test matrix proves ``vllm`` / ``vllm-omni`` / ``torch``: each row is a nox
session (CPU torch).  ``vllm-ascend`` and ``torch-npu`` cannot be installed off
an Ascend host, so their columns are what docs/upstream.md records, not what a
test ran; doctor says so beside each of them.
"""

from __future__ import annotations

import re
from typing import NamedTuple


class Pairing(NamedTuple):
    vllm: str         # tested: the vLLM release of the nox session
    vllm_omni: str    # tested: the vLLM-Omni release beside it (imports only beside its own vLLM minor)
    torch: str        # tested: what this vLLM pins
    vllm_ascend: str  # documented: the vLLM-Ascend line built for this vLLM (the port's container images)
    torch_npu: str    # documented: torch-npu matches torch's release


PAIRINGS = (
    Pairing("0.31.0", "0.31.0rc1", "2.13.0", "0.31", "2.13.0"),
    Pairing("0.32.0", "0.32.0rc1", "2.13.0", "0.32", "2.13.0"),
)

# The newest vLLM releases, for the drift lane only (`nox -s drift`): no vLLM-Omni imports beside
# them, so they are no test session and no pairing doctor offers. torch: what each wheel pins.
DRIFT = (
    ("0.33.0", "2.14.0"),
    ("0.34.0", "2.14.0"),
)

# The newest public vLLM-Ascend source, read beside each drift row (`nox -s drift`): a release
# published as an sdist only (its wheels come from Ascend's own index), so the lane reads its
# source, never installs it.
DRIFT_ASCEND_SOURCE = "0.30.0rc2"

# vLLM-Omni releases that import beside no vLLM of the table, and why.
UNPAIRED_OMNI = {
    "0.30.0": "imports beside neither vLLM 0.31 nor 0.32 (RoutedExpertsLists is missing from vllm.v1.outputs)",
}

# The first vLLM-Omni release with Drama 3 (model_executor/models/fish_omni).
DRAMA3_OMNI = "0.32.0rc1"

TESTED = ("vllm", "vllm-omni", "torch")
DOCUMENTED = ("vllm-ascend", "torch-npu")

_RELEASE = re.compile(r"^\s*v?(\d+(?:\.\d+)*)")


def release(version: str) -> tuple[int, ...]:
    """The numeric release of a version string: '2.13.0+cpu' -> (2, 13, 0), '0.32.0rc1' -> (0, 32, 0)."""
    m = _RELEASE.match(version or "")
    return tuple(int(x) for x in m.group(1).split(".")) if m else ()


def minor(version: str) -> tuple[int, ...]:
    """(major, minor) of a version string; () when it has none."""
    r = release(version)
    return r[:2] if len(r) >= 2 else ()


def for_vllm(version: str) -> Pairing | None:
    """The row whose vLLM has the same minor as ``version``."""
    return next((p for p in PAIRINGS if minor(p.vllm) == minor(version) != ()), None)


def for_omni(version: str) -> Pairing | None:
    """The row whose vLLM-Omni has the same minor as ``version`` (0.30.0 has none)."""
    if version in UNPAIRED_OMNI:
        return None
    return next((p for p in PAIRINGS if minor(p.vllm_omni) == minor(version) != ()), None)


def nox_pairs() -> list[tuple[str, str]]:
    """(vllm, vllm-omni) of every nox session."""
    return [(p.vllm, p.vllm_omni) for p in PAIRINGS]


def nox_torch(vllm: str) -> str:
    """The torch the row of ``vllm`` pins (a test pairing's or a drift row's): each session installs
    its own, so the rows may pin different ones."""
    rows = [(p.vllm, p.torch) for p in PAIRINGS] + list(DRIFT)
    for version, torch in rows:
        if version == vllm:
            return torch
    raise ValueError(f"vLLM {vllm} is in no row of the pairings table (drama3_patches/tools/pairings.py)")


def drift_rows() -> list[tuple[str, str]]:
    """(vllm, torch) of each `nox -s drift` session, newest last."""
    return sorted(DRIFT, key=lambda row: release(row[0]))

"""A throw-away target package and manifest for engine tests (the `selftest` patch)."""

from __future__ import annotations

import textwrap
from pathlib import Path

TARGET_SOURCE = '''
"""A module the self-test patch targets."""

def greet(name, punctuation="!"):
    """Say hello."""
    return f"hello {name}{punctuation}"


def fixed():
    return "fixed"
fixed.upstream_fixed = True


class Base:
    def inherited(self):
        return "base"


class Greeter(Base):
    def hi(self):
        return "hi"

    @classmethod
    def make(cls):
        return "made"
'''

ENTRY = """\
  - id: {id}
    summary: engine self-test
    targets:
{targets}
    requires: {requires}
    platforms: {platforms}
    implementation: drama3_patches.patches.selftest:plan
    why: prove the machinery
    how: append a suffix
    upstream: none
    remove_when: never
"""


def write_target(root: Path, name: str = "d3p_target", source: str = TARGET_SOURCE) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"{name}.py"
    path.write_text(textwrap.dedent(source))
    return path


def manifest_text(*entries: dict) -> str:
    out = ["patches:"]
    for e in entries:
        targets = "\n".join(f"      - {t}" for t in e["targets"])
        out.append(ENTRY.format(
            id=e.get("id", "selftest"),
            targets=targets,
            requires=e.get("requires", "{}"),
            platforms=e.get("platforms", "[cpu, cuda, npu]"),
        ))
    return "\n".join(out)


def write_manifest(root: Path, *entries: dict) -> Path:
    path = root / "manifest.yaml"
    path.write_text(manifest_text(*entries))
    return path


def write_dist(root: Path, name: str, version: str, folder_name: str | None = None) -> None:
    """A minimal installed-distribution record, so importlib.metadata finds ``name``."""
    folder = root / f"{folder_name or name.replace('-', '_')}-{version}.dist-info"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


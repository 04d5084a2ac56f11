"""Installed distribution versions and PEP 440 guard checks."""

from __future__ import annotations

import functools
from importlib import metadata


def _spellings(dist: str) -> list[str]:
    # vllm-ascend is published both as `vllm-ascend` and `vllm_ascend` (wheel
    # dist-info folders normalise to underscores, some builds keep dashes).
    names = [dist]
    for alt in (dist.replace("_", "-"), dist.replace("-", "_"), dist.replace("-", ".")):
        if alt not in names:
            names.append(alt)
    return names


@functools.lru_cache(maxsize=None)
def installed_version(dist: str) -> str | None:
    """Version string of ``dist`` as installed, or None when it is not installed."""
    for name in _spellings(dist):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def clear_cache() -> None:
    installed_version.cache_clear()


def check(dist: str, specifier: str, installed=None) -> tuple[bool, str]:
    """(ok, reason) for one guard; pre-, dev- and local versions are accepted.

    ``installed`` (dist -> version or None) replaces the lookup, so doctor can judge given versions.
    """
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    found = (installed or installed_version)(dist)
    if found is None:
        return False, f"{dist} is not installed"
    try:
        version = Version(found)
    except InvalidVersion:
        return False, f"{dist} {found} is not a PEP 440 version"
    spec = SpecifierSet(specifier, prereleases=True)
    if spec.contains(version, prereleases=True):
        return True, f"{dist} {found} matches {specifier}"
    return False, f"{dist} {found} is outside {specifier}"

"""Installed distribution versions and PEP 440 guard checks."""

from __future__ import annotations

import functools
from importlib import metadata


@functools.lru_cache(maxsize=None)
def installed_version(dist: str) -> str | None:
    """Version string of ``dist`` as installed, or None when it is not installed.

    Any spelling works: importlib.metadata normalises the name (``vllm-ascend``, ``vllm_ascend``,
    ``vllm.ascend`` and ``VLLM-Ascend`` find the same ``vllm_ascend-*.dist-info``).
    """
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
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

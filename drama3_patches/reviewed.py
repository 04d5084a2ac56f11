"""The vLLM and vLLM-Omni versions the patch set was reviewed for, and whether the installed ones
fall outside every patch's range (then every patch steps aside, and the host must hear why).

The ranges are the manifest's ``requires``; nothing here imports vLLM.
"""

from __future__ import annotations

# Distributions whose move past the reviewed range makes the patches step aside, as people name them.
WATCHED = {"vllm": "vLLM", "vllm-omni": "vLLM-Omni"}


def span(specs) -> str:
    """``0.31-0.32`` for ``>=0.31.0,<0.33`` and ``>=0.32.0,<0.33``: the lowest lower bound's minor to
    the minor before the highest ``<X.Y`` bound; the specifiers joined where that reading fails."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    items = [sp for spec in specs for sp in SpecifierSet(spec)]
    lows = [Version(sp.version) for sp in items if sp.operator == ">="]
    highs = [Version(sp.version) for sp in items if sp.operator == "<"]
    if not lows or not highs or len(lows) + len(highs) != len(items):
        return " or ".join(sorted(set(specs)))
    low, high = min(lows), max(highs)
    if len(high.release) < 2 or high.release[1] == 0 or any(high.release[2:]):
        return " or ".join(sorted(set(specs)))
    last = f"{high.release[0]}.{high.release[1] - 1}"
    first = f"{low.release[0]}.{low.release[1] if len(low.release) > 1 else 0}"
    return first if first == last else f"{first}-{last}"


def outside(manifest, installed=None) -> list[tuple[str, str, str]]:
    """(name, installed version, reviewed span) of each watched distribution that no patch admits."""
    from drama3_patches.versions import check, installed_version

    installed = installed or installed_version
    out = []
    for dist, label in WATCHED.items():
        specs = [p.requires[dist] for p in manifest.patches if p.requires.get(dist)]
        version = installed(dist)
        if not specs or version is None:
            continue
        if not any(check(dist, spec, installed)[0] for spec in specs):
            out.append((label, version, span(specs)))
    return out


def skipped_by_versions(manifest, installed=None) -> int:
    """How many patches some version guard refuses."""
    from drama3_patches.versions import check

    return sum(1 for p in manifest.patches
               if not all(check(d, s, installed)[0] for d, s in p.requires.items()))


def verdict(manifest, installed=None) -> str | None:
    """``this patch set was reviewed for vLLM 0.31-0.32; 0.34.0 is installed: every patch is skipped``,
    or None when the installed vLLM and vLLM-Omni are inside some patch's range."""
    outs = outside(manifest, installed)
    if not outs:
        return None
    said = "; ".join(f"{label} {where}; {version} is installed" for label, version, where in outs)
    n, total = skipped_by_versions(manifest, installed), len(manifest.patches)
    tail = "every patch is skipped" if n == total else f"{n} of {total} patches are skipped"
    return f"this patch set was reviewed for {said}: {tail}"

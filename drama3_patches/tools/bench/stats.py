"""Order statistics the bench and validate figures share (a leaf: imports nothing of the package)."""

from __future__ import annotations


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default, which vLLM's benchmark uses)."""
    if not values:
        return None
    v = sorted(values)
    pos = (len(v) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)

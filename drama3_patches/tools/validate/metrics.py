"""The server's ``/metrics`` page, saved and read: what the patches' series said while it ran.

:func:`save` reads ``URL/metrics`` (bounded), writes it to ``OUT/metrics.txt`` and returns the
``drama3_patches_*`` samples; :func:`parse` is the pure part, :func:`total` sums samples.
Parsing is prometheus_client's (installed with vLLM, which validate serves).
"""

from __future__ import annotations

import urllib.request
from dataclasses import dataclass

PREFIX = "drama3_patches_"
MAX_PAGE_BYTES = 16 * 1024 * 1024  # vLLM's page is tens of kilobytes; a runaway one is not read whole
FILE = "metrics.txt"


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict
    value: float


def parse(text: str, prefix: str = PREFIX) -> list[Sample]:
    """The samples of ``text`` (Prometheus text format) whose names start with ``prefix``.
    A malformed page raises ValueError (prometheus_client's parser)."""
    from prometheus_client.parser import text_string_to_metric_families

    out = []
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith(prefix):
                out.append(Sample(s.name, dict(s.labels), float(s.value)))
    return out


def total(samples: list[Sample], name: str, **labels) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    return sum(s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def fetch(url: str, timeout: float = 30, limit: int | None = None) -> str:
    """``url``'s body as text, at most ``limit`` bytes (default ``MAX_PAGE_BYTES``; ValueError beyond,
    OSError when it cannot be read)."""
    limit = MAX_PAGE_BYTES if limit is None else limit
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        if resp.status != 200:
            raise OSError(f"{url}: HTTP {resp.status}")
        body = resp.read(limit + 1)
    if len(body) > limit:
        raise ValueError(f"{url}: the page is over {limit} bytes; not read")
    return body.decode("utf-8", "replace")


def save(url: str, out_dir, timeout: float = 30) -> dict:
    """Save the server at ``url``'s ``/metrics`` page to ``out_dir/metrics.txt`` (``out_dir`` an
    ``outdir.OutFolder``: written through its descriptor).

    Returns ``{"file": path, "samples": [Sample...]}`` (this project's series), or
    ``{"file": None, "samples": [], "error": why}`` when the page could not be read or parsed
    (what was read is still saved): a report line, never an exception.
    """
    path = out_dir / FILE
    try:
        text = fetch(url.rstrip("/") + "/metrics", timeout)
    except (OSError, ValueError) as exc:
        return {"file": None, "samples": [], "error": f"{type(exc).__name__}: {exc}"}
    out_dir.write(FILE, text)
    try:
        samples = parse(text)
    except ValueError as exc:
        return {"file": str(path), "samples": [], "error": f"not a Prometheus page: {exc}"}
    return {"file": str(path), "samples": samples}

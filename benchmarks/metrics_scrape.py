"""What one ``/metrics`` scrape costs the API server with the patches' collector, side by side.

A report folder of N live processes (N = 12, a two-stage deployment's processes with room to
spare, and 200): this process writes its real report through the engine, and each of N ``sleep``
processes gets a copy naming its pid and start (as a worker or engine core of some stage and
rank, or an unnamed process; the API server is this process), so that every report is live and
exported. For each N the page is made by
prometheus_client's ``generate_latest`` from a registry holding the collector:

  first    a new collector (empty cache): every file read, checked and parsed
  cached   the same collector again: files unchanged since, only listed, stat'ed, checked for life
  collect  of which the collector's own part (``collect()``; the rest is prometheus_client's text)

and, as the reference, the page of prometheus_client's default collectors alone (process, GC,
platform: what vLLM's page has before any engine series). Medians of interleaved rounds.

    python benchmarks/metrics_scrape.py [--rounds 30]   # with vLLM's environment (prometheus_client)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SIZES = (12, 200)


def _roles(n: int):
    """A deployment's mix: engine cores and workers of two stages, some others (the API server is
    the scraping process itself)."""
    for i in range(n):
        kind = i % 6
        if kind == 0:
            yield "engine-core", i % 2, None
        elif kind == 5:
            yield "other", None, None
        else:
            yield "worker", i % 2, i % 8


def _folder(base: Path, n: int, template: dict, sleepers: list) -> Path:
    from drama3_patches.engine.state import host_label, start_ticks

    folder = base / f"reports-{n}"
    folder.mkdir(mode=0o700)
    here = host_label()
    for proc, (role, stage, rank) in zip(sleepers[:n], _roles(n)):
        data = dict(template, pid=proc.pid, written_at=time.time())
        data["process"] = dict(template["process"], role=role, stage=stage, rank=rank, ppid=os.getpid(),
                               start_ticks=start_ticks(proc.pid))
        data["counts"] = {"preemptions": proc.pid % 7, "resumes": proc.pid % 5}
        path = folder / f"{here}-{proc.pid}.json"
        path.write_text(json.dumps(data, indent=1, sort_keys=True))
        path.chmod(0o600)
    return folder


def _registry(collector):
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry


def _default_page() -> bytes:
    from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector, generate_latest

    registry = CollectorRegistry()
    for collector in (ProcessCollector, GCCollector, PlatformCollector):
        collector(registry=registry)
    return generate_latest(registry)


def _timed(func) -> tuple[float, object]:
    start = time.perf_counter()
    out = func()
    return time.perf_counter() - start, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=30)
    args = ap.parse_args()
    os.environ.update({"DRAMA3_PATCHES": "1", "DRAMA3_PATCHES_PLATFORM": "cpu"})
    from prometheus_client import generate_latest

    import drama3_patches
    from drama3_patches.engine import get_engine
    from drama3_patches.engine.state import host_label, write_report
    from drama3_patches.metrics import PatchCollector

    sleepers = [subprocess.Popen(["sleep", "3600"]) for _ in range(max(SIZES))]
    try:
        with tempfile.TemporaryDirectory(prefix="d3p-scrape-") as tmp:
            base = Path(tmp)
            os.environ["DRAMA3_PATCHES_REPORT_DIR"] = str(base / "own")
            drama3_patches.status()
            write_report(get_engine())
            template = json.loads((base / "own" / f"{host_label()}-{os.getpid()}.json").read_text())
            folders = {n: _folder(base, n, template, sleepers) for n in SIZES}
            times = {(n, what): [] for n in SIZES for what in ("first", "cached", "collect")}
            times[("default", "page")] = []
            pages = {}
            warm = {}
            for n, folder in folders.items():  # one scrape each before timing: imports, page cache
                os.environ["DRAMA3_PATCHES_REPORT_DIR"] = str(folder)
                warm[n] = PatchCollector()
                generate_latest(_registry(warm[n]))
            for r in range(args.rounds):
                t, _ = _timed(_default_page)
                times[("default", "page")].append(t)
                for n, folder in folders.items():
                    os.environ["DRAMA3_PATCHES_REPORT_DIR"] = str(folder)
                    t, pages[n] = _timed(lambda: generate_latest(_registry(PatchCollector())))
                    times[(n, "first")].append(t)
                    t, _ = _timed(lambda: generate_latest(_registry(warm[n])))
                    times[(n, "cached")].append(t)
                    t, _ = _timed(lambda: list(warm[n].collect()))
                    times[(n, "collect")].append(t)
                if (r + 1) % 10 == 0:
                    print(f"  {r + 1}/{args.rounds} rounds", file=sys.stderr)
    finally:
        for proc in sleepers:
            proc.kill()
            proc.wait()
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    base_ms = med[("default", "page")]
    print(f"python {sys.version.split()[0]}, {args.rounds} interleaved rounds; medians")
    print(f"{'reports':>8} {'first ms':>9} {'cached ms':>10} {'collect ms':>11} {'first/cached':>13} "
          f"{'cached/default':>15} {'our series':>11} {'our bytes':>10}")
    for n in SIZES:
        text = pages[n].decode()
        ours = [ln for ln in text.splitlines() if ln.startswith("drama3_patches_")]
        live = next(ln for ln in ours if ln.startswith('drama3_patches_reports{status="live"}'))
        assert float(live.split()[-1]) == n + 1, f"not every report was live: {live}"
        print(f"{n:>8} {med[(n, 'first')]:>9.2f} {med[(n, 'cached')]:>10.2f} {med[(n, 'collect')]:>11.2f} "
              f"{med[(n, 'first')] / med[(n, 'cached')]:>12.2f}x {med[(n, 'cached')] / base_ms:>14.2f}x "
              f"{len(ours):>11} {sum(len(ln) + 1 for ln in ours):>10}")
    print(f"{'default':>8} {base_ms:>9.2f} {'':>10} {'':>11} {'':>13} {'1.00x':>15}   "
          "(process, GC, platform collectors)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The report folder after many restarts, with and without retention, side by side.

One simulated restart is a process that writes its report through the engine's own writer (a
fork of this one, so its first report is also its first tidy) and ends. Between restarts every
file in the folder is made older by the interval between restarts (their times moved back), so
1,000 restarts 10 minutes apart stand for a week of a deployment that restarts a worker every
10 minutes. The same run is made with ``DRAMA3_PATCHES_REPORT_RETENTION=0`` (everything kept: what
every earlier version did) and with the default (a day), each in a fresh folder; printed: the
files and bytes left, and the work each process's tidy did (names looked at, reports read).

    python benchmarks/report_retention.py [--restarts 1000] [--interval 600]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _age_all(folder: Path, seconds: float) -> None:
    for path in folder.iterdir():
        st = path.stat()
        os.utime(path, (st.st_atime - seconds, st.st_mtime - seconds))


def _restart(stats_fd: int) -> None:
    """A forked child: write this process's first report (its tidy included), say what the tidy did."""
    from drama3_patches import retention
    from drama3_patches.engine import get_engine, state

    done = {}
    original = retention.sweep

    def sweep(*args, **kwargs):
        done.update(original(*args, **kwargs))
        return done

    retention.sweep = sweep
    state.write_report(get_engine())
    os.write(stats_fd, (json.dumps(done) + "\n").encode())
    os._exit(0)


def run(restarts: int, interval: float, retention_s: str) -> dict:
    from drama3_patches.engine import get_engine

    folder = Path(tempfile.mkdtemp(prefix="d3p-retention-")) / "reports"
    os.environ["DRAMA3_PATCHES_REPORT_DIR"] = str(folder)
    os.environ["DRAMA3_PATCHES_REPORT_RETENTION"] = retention_s
    get_engine().snapshot()  # versions looked up once, in the parent: every child inherits them
    read_end, write_end = os.pipe()
    work = []
    with os.fdopen(read_end, "rb", buffering=0) as stats:
        for _ in range(restarts):
            pid = os.fork()
            if pid == 0:
                _restart(write_end)
            os.waitpid(pid, 0)
            line = b""
            while not line.endswith(b"\n"):
                line += stats.read(1)
            work.append(json.loads(line))
            _age_all(folder, interval)
    os.close(write_end)
    files = list(folder.iterdir())
    result = {"files": len(files), "bytes": sum(p.stat().st_size for p in files),
            "names_max": max(w.get("names", 0) for w in work), "read_max": max(w.get("read", 0) for w in work),
            "removed": sum(w.get("reports", 0) for w in work)}
    shutil.rmtree(folder.parent)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--restarts", type=int, default=1000)
    parser.add_argument("--interval", type=float, default=600.0, help="seconds between restarts (simulated)")
    args = parser.parse_args()
    os.environ["DRAMA3_PATCHES_PLATFORM"] = "cpu"
    print(f"{args.restarts} restarts, one every {args.interval:.0f} s (simulated)")
    print(f"{'retention':>12} {'files':>7} {'KiB':>9} {'removed':>8} {'names/start':>12} {'read/start':>11}")
    for label, value in (("0 (keep)", "0"), ("86400", "86400")):
        r = run(args.restarts, args.interval, value)
        print(f"{label:>12} {r['files']:>7} {r['bytes'] / 1024:>9.1f} {r['removed']:>8} {r['names_max']:>12} "
              f"{r['read_max']:>11}")


if __name__ == "__main__":
    main()

"""Repeat the timing-sensitive tests on a loaded host and count each test's failures.

    python tests/support/stress.py --rounds 5              # the list below, a CPU hog per core
    python tests/support/stress.py --rounds 3 --cpus 0 --workers 2 -- -k bench

Each round starts ``--hogs`` busy-looping processes, then one pytest run of ``TIMING_SENSITIVE``
(or the paths given after ``--``) with ``--workers`` xdist workers, and reads each test's outcome
from pytest's JUnit XML. ``--cpus`` pins the hogs and pytest (and so every child) to those
cores. pytest starts with SIGINT ignored (``--sigint ignored``, the default), as a CI job started
in the background of a non-interactive shell (``cmd &``) does: its children inherit that, and a
test that signals a child has to cope. At the end: each test that failed at least once, failures out of runs.
Exit 0 when none failed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Tests that wait on real time, real processes or real sockets: servers streaming on a schedule,
# signals, deadlines, timers, process starts compared with report times, file mtimes.
TIMING_SENSITIVE = [
    "tests/tools/test_bench.py",  # stand-in server with injected timing, deadlines, Ctrl-C
    "tests/tools/test_profile.py",  # stand-in server, request timeouts
    "tests/tools/test_validate_metrics.py",  # /metrics server, scrape timeout
    "tests/tools/test_validate_lifecycle.py",  # signals to validate, the server's stop and kill
    "tests/tools/test_status_collect_roles.py",  # a process start against a report's write time
    "tests/engine/test_report_file.py",  # the report's flush timer
    "tests/engine/test_report_process.py",  # children ending while the flush timer writes
    "tests/engine/test_startup_cache.py",  # manifests changed within the last second
    "tests/engine/test_threads_and_fork.py",  # forks while other threads hold locks
    "tests/patches/test_patch_metrics_endpoint.py",  # a live process tree, a killed process, pid reuse
]

HOG = "while True:\n    pass\n"


def _outcomes(xml_path: Path) -> dict[str, str | None]:
    """test id -> None when it passed, else its failure's message, for every test that ran
    (skipped ones are left out)."""
    out = {}
    for case in ET.parse(xml_path).iter("testcase"):
        if case.find("skipped") is not None:
            continue
        test = f"{case.get('classname')}::{case.get('name')}"
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        out[test] = None if bad is None else (bad.get("message") or bad.text or "(no message)")
    return out


def _first_lines(message: str, n: int = 3) -> str:
    return "\n    ".join(line[:200] for line in message.strip().splitlines()[:n])


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def one_round(args, tests: list[str], xml_path: Path) -> tuple[dict[str, str | None], int]:
    """(outcomes, pytest's exit status) of one pytest run beside ``args.hogs`` busy loops."""
    hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(args.hogs)]
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rf", f"--junitxml={xml_path}"]
    if args.workers:
        argv += ["-n", str(args.workers)]
    try:
        proc = subprocess.run(argv + tests, cwd=ROOT, start_new_session=True,
                              preexec_fn=_ignore_sigint if args.sigint == "ignored" else None,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    if not xml_path.exists():  # pytest did not get as far as running tests
        sys.stdout.write(proc.stdout[-4000:])
        return {}, proc.returncode
    return _outcomes(xml_path), proc.returncode


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5, help="pytest runs (default 5)")
    p.add_argument("--hogs", type=int, default=os.cpu_count() or 1,
                   help="busy-looping processes beside each run (default: one per core)")
    p.add_argument("--cpus", help="comma-separated cores to pin the hogs and pytest to (e.g. 0)")
    p.add_argument("--workers", type=int, default=0, help="pytest-xdist workers (default 0: none)")
    p.add_argument("--sigint", choices=("ignored", "default"), default="ignored",
                   help="SIGINT as pytest inherits it: ignored (a background job's, default) or default")
    p.add_argument("tests", nargs="*", help="pytest paths or arguments (default: TIMING_SENSITIVE)")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.hogs < 0:
        p.error("--rounds must be at least 1 and --hogs at least 0")
    if args.cpus:
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})  # the children inherit it
    tests = args.tests or TIMING_SENSITIVE
    runs, failures = Counter(), Counter()
    broken = 0
    with tempfile.TemporaryDirectory(prefix="stress-") as tmp:
        for n in range(1, args.rounds + 1):
            began = time.monotonic()
            got, status = one_round(args, tests, Path(tmp) / f"round{n}.xml")
            failed = sorted(t for t, why in got.items() if why is not None)
            runs.update(got.keys())
            failures.update(failed)
            broken += not got
            said = "".join(f"\n  FAILED {t}\n    {_first_lines(got[t])}" for t in failed)
            print(f"round {n}/{args.rounds}: {len(got)} run, {len(failed)} failed, pytest exit {status}, "
                  f"{time.monotonic() - began:.0f} s{said}", flush=True)
    print(f"\n{args.rounds} round(s), {args.hogs} hog(s), cores {args.cpus or 'all'}, "
          f"{args.workers or 'no'} xdist worker(s), SIGINT {args.sigint}")
    if not failures and not broken:
        print(f"no failure in {sum(runs.values())} test runs ({len(runs)} tests)")
        return 0
    if broken:
        print(f"{broken} round(s) ran no test: see the output above")
    print("failures/runs  test")
    for test, count in sorted(failures.items(), key=lambda item: (-item[1], item[0])):
        print(f"{count:>4}/{runs[test]:<4}    {test}")
    return 1


if __name__ == "__main__":
    sys.exit(main())

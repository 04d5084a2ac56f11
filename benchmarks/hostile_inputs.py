"""What another local user's files cost the package: a stuffed report folder, a huge or alias-heavy manifest.

Each case runs in fresh interpreters, with the package of ``--project`` (default: this checkout)
first on ``PYTHONPATH``; ``--compare DIR`` measures a second checkout (an older commit) in the same
rounds, interleaved, and prints the ratio:

  scrape-N       one ``/metrics`` collection (``PatchCollector().collect()``, a new collector: the
                 files renamed since the last scrape, so nothing is cached) over a report folder of
                 N files of just under 1 MiB owned by uid 65534 (sparse: no disk); needs root to chown
  startup-20000  ``python -c pass`` with ``DRAMA3_PATCHES=1`` and a manifest of the shipped entries
                 plus one of 20,000 targets (never fits the start-up cache: scanned at every start)
  alias-import   the first target import, where the engine reads the manifest: one entry of 2,000
                 targets anchored, and 200 entries that are aliases of it
  plain-import   the same import with the shipped manifest and one entry naming it: the reference
  bare           ``python -c pass`` without the patches, the reference for start-up

    python benchmarks/hostile_inputs.py [--rounds 5] [--compare DIR]   # with vLLM's environment
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

ROOT = Path(__file__).resolve().parents[1]
FOREIGN_UID = 65534
SCRAPE_SIZES = (200, 10000)

SCRAPE = """
import json, os, sys, time
os.environ.update(DRAMA3_PATCHES="1", DRAMA3_PATCHES_PLATFORM="cpu", DRAMA3_PATCHES_REPORT_DIR=sys.argv[1])
from drama3_patches.metrics import PatchCollector
list(PatchCollector().collect())  # imports, the engine, the page cache
start = time.perf_counter()
families = list(PatchCollector().collect())
took = time.perf_counter() - start
skipped = {s.labels["reason"]: s.value for f in families for s in f.samples
           if s.name == "drama3_patches_reports_skipped" and s.value}
print(json.dumps({"s": took, "skipped": skipped}))
"""

FIRST_IMPORT = """
import json, time
start = time.perf_counter()
import d3p_bench_target
print(json.dumps({"s": time.perf_counter() - start}))
"""


def _entry(pid: str, targets: list, anchor: str = "") -> str:
    lines = [f"  - {anchor}", f"    id: {pid}"] if anchor else [f"  - id: {pid}"]
    lines.append("    targets:")
    lines += [f"      - {t}" for t in targets]
    lines += ["    platforms: [npu, cuda, cpu]",
              "    implementation: drama3_patches.patches.selftest:plan"]
    lines += [f"    {field}: benchmark entry" for field in ("summary", "why", "how", "upstream", "remove_when")]
    return "\n".join(lines)


def _manifests(work: Path) -> dict:
    shipped = (ROOT / "patches_manifest.yaml").read_text().rstrip("\n")
    big = work / "targets-20000.yaml"
    big.write_text(shipped + "\n" + _entry("bench-many", [f"d3p_bench_{i}:f" for i in range(20000)]) + "\n")
    plain = work / "plain.yaml"
    plain.write_text(shipped + "\n" + _entry("bench-one", ["d3p_bench_target:f"]) + "\n")
    alias = work / "aliases.yaml"
    targets = ["d3p_bench_target:f"] + [f"d3p_bench_{i}:f" for i in range(1999)]
    alias.write_text(shipped + "\n" + _entry("bench-big", targets, anchor="&big") + "\n"
                     + "\n".join("  - *big" for _ in range(200)) + "\n")
    (work / "d3p_bench_target.py").write_text("def f():\n    return 1\n")
    for path in (big, plain, alias):
        path.chmod(0o644)
    return {"big": big, "plain": plain, "alias": alias}


def _folder(work: Path, n: int) -> Path:
    from drama3_patches.engine.state import host_label

    folder = work / f"reports-{n}"
    folder.mkdir(mode=0o755)
    here = host_label()
    for i in range(n):
        path = folder / f"{here}-{100000 + i}.json"
        with open(path, "wb") as fh:
            fh.truncate((1 << 20) - 1)
        if os.geteuid() == 0:
            os.chown(path, FOREIGN_UID, FOREIGN_UID)
    return folder


def _env(project: Path, extra: dict, work: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DRAMA3_PATCHES")}
    env["PYTHONPATH"] = os.pathsep.join([str(project), str(work)])
    env["VLLM_LOGGING_LEVEL"] = "WARNING"
    env.update(extra)
    return env


def _wall(argv: list, env: dict) -> float:
    start = time.perf_counter()
    subprocess.run(argv, env=env, check=True, capture_output=True)
    return time.perf_counter() - start


def _inner(argv: list, env: dict) -> dict:
    out = subprocess.run(argv, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--project", type=Path, default=ROOT, help="the checkout measured (default: this one)")
    ap.add_argument("--compare", type=Path, help="another checkout measured side by side (e.g. an older commit)")
    args = ap.parse_args()
    sys.path.insert(0, str(args.project))
    projects = {"this": args.project.resolve()}
    if args.compare:
        projects["compare"] = args.compare.resolve()
    if os.geteuid() != 0:
        print("not root: the scrape folders' files stay yours (not foreign), so they are read", file=sys.stderr)
    py = sys.executable
    times: dict = {}
    notes: dict = {}
    with tempfile.TemporaryDirectory(prefix="d3p-hostile-") as tmp:
        work = Path(tmp)
        manifests = _manifests(work)
        folders = {n: _folder(work, n) for n in SCRAPE_SIZES}
        for r in range(args.rounds):
            for name, project in projects.items():
                def add(case, value, _name=name):
                    times.setdefault((case, _name), []).append(value)

                for n, folder in folders.items():
                    got = _inner([py, "-c", SCRAPE, str(folder)], _env(project, {}, work))
                    add(f"scrape-{n}", got["s"])
                    notes[(f"scrape-{n}", name)] = got["skipped"]
                cache = work / f"cache-{name}-{r}"  # empty: every start scans (20,000 targets never fit anyway)
                start_env = {"DRAMA3_PATCHES": "1", "DRAMA3_PATCHES_MANIFEST": str(manifests["big"]),
                             "DRAMA3_PATCHES_CACHE_DIR": str(cache)}
                add("startup-20000", _wall([py, "-c", "pass"], _env(project, start_env, work)))
                add("bare", _wall([py, "-c", "pass"], _env(project, {}, work)))
                alias_env = {"DRAMA3_PATCHES": "1", "DRAMA3_PATCHES_MANIFEST": str(manifests["alias"]),
                             "DRAMA3_PATCHES_CACHE_DIR": str(cache), "DRAMA3_PATCHES_PLATFORM": "cpu"}
                add("alias-import", _inner([py, "-c", FIRST_IMPORT], _env(project, alias_env, work))["s"])
                plain_env = dict(alias_env, DRAMA3_PATCHES_MANIFEST=str(manifests["plain"]))
                add("plain-import", _inner([py, "-c", FIRST_IMPORT], _env(project, plain_env, work))["s"])
            print(f"  {r + 1}/{args.rounds} rounds", file=sys.stderr)
    print(f"python {sys.version.split()[0]}, {args.rounds} interleaved rounds, medians in ms")
    cases = sorted({case for case, _ in times}, key=lambda c: list(dict.fromkeys(c for c, _ in times)).index(c))
    head = f"{'case':>14} " + " ".join(f"{name + ' ms':>12}" for name in projects)
    print(head + (f" {'compare/this':>13}" if "compare" in projects else ""))
    for case in cases:
        med = {name: statistics.median(times[(case, name)]) * 1e3 for name in projects}
        row = f"{case:>14} " + " ".join(f"{med[name]:>12.1f}" for name in projects)
        if "compare" in projects:
            row += f" {med['compare'] / med['this']:>12.1f}x"
        print(row)
    for (case, name), skipped in sorted(notes.items()):
        print(f"  {case} ({name}): skipped by reason {skipped}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

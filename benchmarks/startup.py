"""Interpreter start-up cost of the ``.pth`` hook, side by side in one run.

Scratch virtual environments made from the same Python:

  bare        the package not installed
  unset       the package installed (wheel, .pth line in site-packages), DRAMA3_PATCHES unset
  enabled     the same, DRAMA3_PATCHES=1 (triggers registered, no target imported)
  unset-2x    unset, DRAMA3_PATCHES_MANIFEST naming a generated manifest of twice today's entries
  enabled-2x  enabled, with that manifest

Runs ``python -c pass`` in rounds that interleave the cases, so machine noise hits each alike,
and prints medians and each ratio against ``bare``. Targets (docs/design.md): unset <= 1.03x,
enabled <= 1.10x, whatever the manifest's size. Measured in the steady state: every case has
the same private cache folder (``DRAMA3_PATCHES_CACHE_DIR``), the warm-up starts fill it, and the
run says where each enabled case's start-up list came from. ``--project`` measures another
checkout (an older commit) with this same script.

    python benchmarks/startup.py [--rounds 150] [--project DIR]
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# One target line of the manifest (`      - module.path:Qualified.name`), and an entry's id line.
TARGET_LINE = re.compile(r"^(\s+- )([A-Za-z_][\w.]*)(:[A-Za-z_][\w.]*\s*)$")
ID_LINE = re.compile(r"^(\s*- id:\s*)(\S+)(\s*)$")


def _make_envs(work: Path, project: Path) -> tuple[Path, Path]:
    # Built from a copy: the in-tree build of pip would leave build/ and *.egg-info in the project.
    source = work / "src"
    shutil.copytree(project, source, ignore=shutil.ignore_patterns(".git", ".nox", ".venv*", "build", "dist",
                                                                   "*.egg-info", "__pycache__"))
    wheels = work / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels), str(source)],
                   check=True)
    (wheel,) = wheels.glob("drama3_patches-*.whl")
    bare, installed = work / "bare", work / "installed"
    # Both with pip (and the setuptools .pth it brings), so the only difference is our package.
    venv.EnvBuilder(with_pip=True).create(bare)
    venv.EnvBuilder(with_pip=True).create(installed)
    py = installed / "bin" / "python"
    # --no-deps: start-up never imports packaging or yaml, so they are not needed to measure it.
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--disable-pip-version-check", str(wheel)],
                   check=True)
    return bare / "bin" / "python", py


def doubled_manifest(text: str) -> str:
    """Today's manifest and a copy of each entry under a new id, its targets in modules of their own."""
    body = text.split("\npatches:\n", 1)[1]
    copy = []
    for line in body.splitlines():
        line = ID_LINE.sub(r"\1\2-copy\3", line)
        line = TARGET_LINE.sub(r"\1\2_copy\3", line)
        copy.append(line)
    return text.rstrip("\n") + "\n\n" + "\n".join(copy) + "\n"


def _once(python: Path, env: dict) -> float:
    start = time.perf_counter()
    subprocess.run([str(python), "-c", "pass"], env=env, check=True)
    return time.perf_counter() - start


def _probe(python: Path, env: dict) -> str:
    """Where this start's target list came from (a build without the cache says so)."""
    code = ("import sys; b = sys.modules.get('drama3_patches._bootstrap'); "
            "print(getattr(b, 'targets_from', 'manifest (no cache in this build)') if b else 'not activated', "
            "len(b.installed_finder().modules) if b and b.installed_finder() else 0)")
    return subprocess.run([str(python), "-c", code], env=env, capture_output=True, text=True, check=True).stdout.strip()


def _ours_at_start(python: Path, env: dict) -> str:
    """Our modules in ``-X importtime`` of one enabled start, with their self times."""
    err = subprocess.run([str(python), "-X", "importtime", "-c", "pass"], env=env, capture_output=True, text=True,
                         check=True).stderr
    rows = [ln.split("|") for ln in err.splitlines() if "drama3_patches" in ln]
    return ", ".join(f"{r[2].strip()} {r[0].split(':')[1].strip()} us" for r in rows) or "none"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=150)
    ap.add_argument("--project", type=Path, default=ROOT, help="the checkout to build and measure (default: this one)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="d3p-startup-") as tmp:
        print(f"building the wheel of {args.project} and two scratch environments ...", file=sys.stderr)
        bare, installed = _make_envs(Path(tmp), args.project.resolve())
        manifest = Path(tmp) / "doubled.yaml"
        text = doubled_manifest((args.project / "patches_manifest.yaml").read_text())
        manifest.write_text(text)
        entries = sum(1 for ln in text.splitlines() if ID_LINE.match(ln))
        base_env = {"PATH": "/usr/bin:/bin", "DRAMA3_PATCHES_CACHE_DIR": str(Path(tmp) / "cache")}
        doubled = {**base_env, "DRAMA3_PATCHES_MANIFEST": str(manifest)}
        cases = {
            "bare": (bare, base_env),
            "unset": (installed, base_env),
            "enabled": (installed, {**base_env, "DRAMA3_PATCHES": "1"}),
            "unset-2x": (installed, doubled),
            "enabled-2x": (installed, {**doubled, "DRAMA3_PATCHES": "1"}),
        }
        time.sleep(1.1)  # a manifest written less than a second ago is not cached
        times: dict[str, list[float]] = {k: [] for k in cases}
        for _ in range(5):  # warm the page cache (and the start-up cache)
            for python, env in cases.values():
                _once(python, env)
        sources = {k: _probe(*cases[k]) for k in ("enabled", "enabled-2x")}
        idle = [k for k, found in sources.items() if found.startswith("not activated")]
        if idle:  # the enabled cases would time a start that patches nothing
            raise SystemExit(f"the .pth line did not activate the package in the {' and '.join(idle)} case(s)")
        ours = _ours_at_start(*cases["enabled"])
        for r in range(args.rounds):
            for name, (python, env) in cases.items():
                times[name].append(_once(python, env))
            if (r + 1) % 50 == 0:
                print(f"  {r + 1}/{args.rounds} rounds", file=sys.stderr)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"python {sys.version.split()[0]}, {args.rounds} interleaved rounds of `python -c pass`, "
          f"project {args.project}")
    print(f"enabled: target list from {sources['enabled']} modules; enabled-2x ({entries} entries): "
          f"from {sources['enabled-2x']} modules")
    print(f"enabled, -X importtime of ours: {ours}")
    print(f"{'case':<11} {'median ms':>10} {'p10 ms':>8} {'p90 ms':>8} {'ratio':>7}")
    for name, values in times.items():
        q = statistics.quantiles(values, n=10)
        print(f"{name:<11} {med[name] * 1e3:10.2f} {q[0] * 1e3:8.2f} {q[-1] * 1e3:8.2f} {med[name] / med['bare']:7.3f}")
    for name, bound in (("unset", 1.03), ("enabled", 1.10), ("unset-2x", 1.03), ("enabled-2x", 1.10)):
        print(f"ratio {name + '/bare':<16} = {med[name] / med['bare']:.3f}  (target <= {bound:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Interpreter start-up cost of the ``.pth`` hook, side by side in one run.

Three interpreters made from the same Python, in scratch virtual environments:

  bare      the package not installed
  unset     the package installed (wheel, .pth line in site-packages), DRAMA3_PATCHES unset
  enabled   the same, DRAMA3_PATCHES=1 (triggers registered, no target imported)

Runs ``python -c pass`` in rounds that interleave the three, so machine noise
hits each alike, and prints medians and the two ratios against ``bare``.
Targets (docs/design.md): unset <= 1.03x, enabled <= 1.20x.

    python benchmarks/startup.py [--rounds 60]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _make_envs(work: Path) -> tuple[Path, Path]:
    wheels = work / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels), str(ROOT)],
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


def _once(python: Path, env: dict) -> float:
    start = time.perf_counter()
    subprocess.run([str(python), "-c", "pass"], env=env, check=True)
    return time.perf_counter() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=60)
    args = ap.parse_args()
    base_env = {"PATH": "/usr/bin:/bin"}
    with tempfile.TemporaryDirectory(prefix="d3p-startup-") as tmp:
        print("building the wheel and two scratch environments ...", file=sys.stderr)
        bare, installed = _make_envs(Path(tmp))
        cases = {
            "bare": (bare, base_env),
            "unset": (installed, base_env),
            "enabled": (installed, {**base_env, "DRAMA3_PATCHES": "1"}),
        }
        check = subprocess.run([str(installed), "-c", "import sys; print('drama3_patches' in sys.modules)"],
                               env=cases["enabled"][1], capture_output=True, text=True, check=True)
        assert check.stdout.strip() == "True", "the .pth line did not run in the enabled case"
        times: dict[str, list[float]] = {k: [] for k in cases}
        for _ in range(5):  # warm the page cache
            for python, env in cases.values():
                _once(python, env)
        for r in range(args.rounds):
            for name, (python, env) in cases.items():
                times[name].append(_once(python, env))
            if (r + 1) % 20 == 0:
                print(f"  {r + 1}/{args.rounds} rounds", file=sys.stderr)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"python {sys.version.split()[0]}, {args.rounds} interleaved rounds of `python -c pass`")
    print(f"{'case':<9} {'median ms':>10} {'p10 ms':>8} {'p90 ms':>8} {'ratio':>7}")
    for name, values in times.items():
        q = statistics.quantiles(values, n=10)
        print(f"{name:<9} {med[name] * 1e3:10.2f} {q[0] * 1e3:8.2f} {q[-1] * 1e3:8.2f} {med[name] / med['bare']:7.3f}")
    print(f"ratio unset/bare   = {med['unset'] / med['bare']:.3f}  (target <= 1.03)")
    print(f"ratio enabled/bare = {med['enabled'] / med['bare']:.3f}  (target <= 1.20)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The project's distributions, built as an operator builds them for a host without a package
index: an sdist from the source tree, the wheel built from that sdist (so the sdist is known to be
complete), the wheels of the declared dependencies, and a scratch virtual environment that installs
them with ``--no-index``.

Each step is a child process; nothing is written into the source tree (the build runs in a copy).
"""

from __future__ import annotations

import configparser
import os
import shutil
import subprocess
import sys
import venv
from dataclasses import dataclass
from pathlib import Path

from support.subproc import ROOT

PACKAGE = "drama3_patches"
# Beside the package, the files setup.py copies into the wheel (and MANIFEST.in into the sdist).
ROOT_FILES = ("drama3_patches.pth", "patches_manifest.yaml")
BUILD_FILES = ("setup.py", "setup.cfg", "pyproject.toml", "MANIFEST.in", "README.md")
# A clean pip: no configuration file, index or find-links of the host leaks into the install.
PIP_ENV = {"PATH": "/usr/bin:/bin", "PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}


def source_files(under: str = "") -> list[str]:
    """The working tree's files (tracked, and untracked ones git does not ignore), relative to ROOT;
    without git, every file less caches and build outputs."""
    if (ROOT / ".git").exists() and shutil.which("git"):
        out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "--cached", "--others", "--exclude-standard",
                              "--", under or "."], capture_output=True, text=True, check=True).stdout
        return sorted(p for p in out.splitlines() if (ROOT / p).is_file())
    skip = {".git", ".nox", "build", "dist", "__pycache__", "validate-out"}
    base = ROOT / under if under else ROOT
    return sorted(str(p.relative_to(ROOT)) for p in base.rglob("*")
                  if p.is_file() and not skip & set(p.relative_to(ROOT).parts) and p.suffix not in (".pyc", ".so")
                  and not any(part.endswith(".egg-info") for part in p.parts))


def package_files() -> set[str]:
    """What the wheel must hold of the package: every file of the source package, and the manifest."""
    return set(source_files(PACKAGE)) | {f"{PACKAGE}/patches_manifest.yaml"}


def requirements() -> list[str]:
    """The distribution's install_requires, as setup.cfg declares them."""
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    lines = cfg["options"]["install_requires"].splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")]


def _run(argv: list, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=600, **kw)
    assert proc.returncode == 0, f"{' '.join(map(str, argv))}: exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


@dataclass
class Built:
    sdist: Path
    wheel: Path
    wheelhouse: Path  # the wheel and its dependencies' wheels: what is carried to the offline host


def build(tmp: Path) -> Built:
    """sdist (setuptools' PEP 517 hook, what ``python -m build --sdist`` calls) from a copy of the
    source tree, the wheel from that sdist, and the dependencies' wheels beside it."""
    src, house = tmp / "src", tmp / "wheelhouse"
    for rel in source_files():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, src / rel)
    house.mkdir()
    code = "import sys; from setuptools import build_meta; print(build_meta.build_sdist(sys.argv[1]))"
    name = _run([sys.executable, "-c", code, tmp], cwd=src).stdout.strip().splitlines()[-1]
    sdist = tmp / name
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", house, sdist],
         cwd=tmp)
    (wheel,) = house.glob(f"{PACKAGE}-*.whl")
    # The dependencies as the carrying machine fetches them (its configured index), binary only.
    _run([sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "-d", house, *requirements()],
         cwd=tmp)
    return Built(sdist, wheel, house)


@dataclass
class Installed:
    python: Path
    bin: Path
    site: Path
    pip_output: str


def install_offline(tmp: Path, wheelhouse: Path) -> Installed:
    """A scratch venv that installs drama3-patches from the wheelhouse alone (``--no-index``)."""
    env_dir = tmp / "offline-venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    proc = _run([python, "-m", "pip", "install", "--no-index", "--find-links", wheelhouse, "drama3-patches"],
                env={**PIP_ENV, "HOME": str(tmp)}, cwd=tmp)
    site = _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    return Installed(python, env_dir / "bin", Path(site), proc.stdout + proc.stderr)

"""Tier 1: what ``pip install`` (wheel and editable) puts in site-packages, in scratch venvs."""

from __future__ import annotations

import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

from support.selftest import write_manifest, write_target
from support.subproc import ROOT

pytestmark = pytest.mark.packaging


def _pip(python: Path, *args: str) -> None:
    proc = subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *args],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _scratch(tmp_path: Path, name: str) -> tuple[Path, Path]:
    env_dir = tmp_path / name
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    return python, Path(site)


def _check_patched(python: Path, tmp_path: Path) -> None:
    write_target(tmp_path / "t")
    manifest = write_manifest(tmp_path / "t", {"targets": ["d3p_target:greet"]})
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path / "t"), "DRAMA3_PATCHES_MANIFEST": str(manifest)}
    code = "import d3p_target, sys; print(d3p_target.greet('pip'), 'drama3_patches' in sys.modules)"
    on = subprocess.run([str(python), "-c", code], env={**env, "DRAMA3_PATCHES": "1"},
                        capture_output=True, text=True, cwd=tmp_path)
    off = subprocess.run([str(python), "-c", code], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert on.stdout.strip() == "hello pip! [patched] True", on.stderr
    assert off.stdout.strip() == "hello pip! False", off.stderr
    cli = subprocess.run([str(python.parent / "drama3-patches"), "list"], capture_output=True, text=True,
                         cwd=tmp_path, env={"PATH": "/usr/bin:/bin"})
    assert cli.returncode == 0 and "mamba-prefill-end:" in cli.stdout, cli.stderr


def test_wheel_contents(tmp_path):
    out = tmp_path / "dist"
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(ROOT)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    (wheel,) = out.glob("drama3_patches-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "drama3_patches.pth" in names  # the wheel root lands in site-packages
    assert "drama3_patches/patches_manifest.yaml" in names
    assert any(n.startswith("drama3_patches/tools/deploy_config/configs/") and n.endswith(".yaml") for n in names)
    assert "drama3_patches/kernels/fp8_expand.c" in names  # the native fp8 kernel's source, built on first use
    pth = zipfile.ZipFile(wheel).read("drama3_patches.pth").decode()
    assert pth == (ROOT / "drama3_patches.pth").read_text()
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "[vllm.general_plugins]" in text and "drama3_patches = drama3_patches.plugin:register" in text
    assert "drama3-patches = drama3_patches.tools:main" in text


@pytest.mark.parametrize("editable", [False, True], ids=["wheel", "editable"])
def test_pip_install_puts_the_pth_line_in_site_packages(tmp_path, editable):
    python, site = _scratch(tmp_path, "venv")
    _pip(python, *(["-e"] if editable else []), str(ROOT))
    pth = site / "drama3_patches.pth"
    assert pth.exists(), sorted(p.name for p in site.iterdir())
    assert pth.read_text() == (ROOT / "drama3_patches.pth").read_text()
    _check_patched(python, tmp_path)
    # Uninstalling removes the line again: nothing is left to run at start-up.
    proc = subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "-q", "drama3-patches"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert not pth.exists()

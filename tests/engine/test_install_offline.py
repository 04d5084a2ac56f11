"""Tier 1: installing without a package index, as an operator brings drama3-patches into an
offline Ascend container (README, "Install without an index"). One sdist, the wheel built from it,
the dependencies' wheels and one scratch venv installed with ``--no-index`` serve every check here.
"""

from __future__ import annotations

import subprocess
import tarfile
import zipfile

import pytest
import yaml

from support import dist
from support.subproc import ROOT

pytestmark = pytest.mark.packaging


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return dist.build(tmp_path_factory.mktemp("dist"))


@pytest.fixture(scope="module")
def offline(built, tmp_path_factory):
    installed = dist.install_offline(tmp_path_factory.mktemp("offline"), built.wheelhouse)
    print(installed.pip_output)
    return installed


def _manifest_ids() -> list[str]:
    return [p["id"] for p in yaml.safe_load((ROOT / "patches_manifest.yaml").read_text())["patches"]]


def test_the_sdist_carries_everything_its_wheel_is_built_from(built):
    # The fixture built the wheel from this sdist: without the .pth and the manifest in it, that
    # build fails (setup.py copies both into the wheel).
    with tarfile.open(built.sdist) as tar:
        top = tar.getnames()[0].split("/")[0]
        names = {n[len(top) + 1:] for n in tar.getnames() if n.startswith(top + "/")}
    wanted = set(dist.source_files(dist.PACKAGE)) | set(dist.ROOT_FILES) | set(dist.BUILD_FILES)
    assert wanted <= names, sorted(wanted - names)
    assert built.wheel.name.endswith("-py3-none-any.whl")  # pure Python: one wheel for x86 and aarch64 hosts


def test_the_wheel_holds_the_package_its_data_and_the_start_up_line(built):
    names = set(zipfile.ZipFile(built.wheel).namelist())
    package = {n for n in names if n.startswith(dist.PACKAGE + "/")}
    assert package == dist.package_files(), (sorted(dist.package_files() - package), sorted(package -
                                                                                         dist.package_files()))
    assert {n for n in names - package if ".dist-info/" not in n} == {"drama3_patches.pth"}
    assert zipfile.ZipFile(built.wheel).read("drama3_patches.pth") == (ROOT / "drama3_patches.pth").read_bytes()


def test_the_wheelhouse_holds_each_declared_dependency(built):
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name, parse_wheel_filename

    have = {canonicalize_name(parse_wheel_filename(w.name)[0]) for w in built.wheelhouse.glob("*.whl")}
    wanted = {canonicalize_name(Requirement(r).name) for r in dist.requirements()} | {"drama3-patches"}
    assert have == wanted


def test_installed_with_no_index_the_command_lists_every_patch(offline):
    assert "Successfully installed" in offline.pip_output and "drama3-patches" in offline.pip_output
    done = subprocess.run([str(offline.bin / "drama3-patches"), "list"], capture_output=True, text=True,
                          timeout=120, env={"PATH": "/usr/bin:/bin"}, cwd=offline.bin)
    assert done.returncode == 0, done.stderr
    print(done.stdout)
    manifest = offline.site / dist.PACKAGE / "patches_manifest.yaml"
    assert done.stdout.splitlines()[0] == f"{len(_manifest_ids())} patches in {manifest}"
    listed = [ln.split(":")[0] for ln in done.stdout.splitlines() if ln and not ln.startswith(" ") and ": " in ln]
    assert listed == _manifest_ids()


def test_installed_with_no_index_the_data_files_are_in_place(offline):
    env = {"PATH": "/usr/bin:/bin"}
    profiles = subprocess.run([str(offline.bin / "drama3-patches"), "deploy-config", "--list"], capture_output=True,
                              text=True, timeout=120, env=env, cwd=offline.bin)
    assert profiles.returncode == 0, profiles.stderr
    shipped = sorted((ROOT / dist.PACKAGE / "tools" / "deploy_config" / "configs").glob("*.yaml"))
    assert shipped and all(p.name in profiles.stdout for p in shipped), profiles.stdout
    assert (offline.site / dist.PACKAGE / "kernels" / "fp8_expand.c").read_bytes() == \
        (ROOT / dist.PACKAGE / "kernels" / "fp8_expand.c").read_bytes()
    assert (offline.site / "drama3_patches.pth").read_text() == (ROOT / "drama3_patches.pth").read_text()
    # The start-up line runs in that venv: enabled, the hook is imported at interpreter start.
    code = "import sys; print('drama3_patches._bootstrap' in sys.modules)"
    on = subprocess.run([str(offline.python), "-c", code], capture_output=True, text=True, timeout=60,
                        env={**env, "DRAMA3_PATCHES": "1"}, cwd=offline.bin)
    off = subprocess.run([str(offline.python), "-c", code], capture_output=True, text=True, timeout=60, env=env,
                         cwd=offline.bin)
    assert (on.stdout.strip(), off.stdout.strip()) == ("True", "False"), on.stderr + off.stderr


def test_validate_on_a_bare_host_is_one_line_naming_the_missing_vllm_and_exit_2(offline, tmp_path):
    """The package installed alone (its own dependencies, no vLLM, no vLLM-Omni): validate's host
    check answers before anything starts: one line naming what is missing and the fix, exit 2, no
    traceback, nothing written."""
    out = tmp_path / "out"
    done = subprocess.run([str(offline.bin / "drama3-patches"), "validate", "--profile", "910b-tp2-ep",
                           "--out", str(out)], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={"PATH": "/usr/bin:/bin"})
    print(done.stderr)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr
    assert lines[0].startswith("drama3-patches validate: this host cannot run a validation: vLLM is not installed")
    assert "fix: " in lines[0] and "vllm==" in lines[0]
    assert not out.exists() or not any(out.iterdir())  # nothing was started or written

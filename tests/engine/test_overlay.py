"""``drama3-patches overlay DIR`` and an image that cannot be rebuilt: a fresh virtual environment
("the image") without the package, its own ``sitecustomize`` and the ``selftest`` patch's target
module in its site-packages; the overlay is its only way to drama3-patches (``PYTHONPATH=DIR``,
nothing of this shell's environment). Also: ``status``'s ``activated_by`` for each route."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import venv
from pathlib import Path

import pytest

from support.selftest import write_manifest, write_target
from support.subproc import run_cli, run_python

ALL_DEPS = ("packaging", "PyYAML", "wrapt")
PROBE = """
import json, os, sys
import d3p_target
out = {"greet": d3p_target.greet("img"), "loaded": "drama3_patches" in sys.modules,
       "sitecustomize": getattr(sys.modules.get("sitecustomize"), "__file__", None)}
if out["loaded"]:
    import drama3_patches
    status = drama3_patches.status()
    out.update(package=drama3_patches.__file__, activated_by=status["activated_by"],
               states={p["id"]: p["state"] for p in status["patches"]})
print(json.dumps(out))
"""


def _link_dist(name: str, site: Path) -> None:
    """The running Python's installed distribution ``name``, linked into ``site`` (the image has it)."""
    dist = importlib.metadata.distribution(name)
    for top in {f.parts[0] for f in dist.files if f.parts[0] != ".." and not f.parts[0].endswith(".pth")}:
        src = Path(dist.locate_file(top))
        if src.exists() and not (site / top).exists():
            (site / top).symlink_to(src)


def make_image(root: Path, deps=ALL_DEPS) -> tuple[Path, Path]:
    """A fresh venv (no pip, no system site-packages) with ``deps``, the target module and its own
    sitecustomize, which appends a line to $IMG_SC_LOG each time it runs."""
    venv.EnvBuilder(with_pip=False, symlinks=True).create(root)
    python = root / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    for name in deps:
        _link_dist(name, site)
    write_target(site)
    (site / "sitecustomize.py").write_text(
        "import os\nwith open(os.environ['IMG_SC_LOG'], 'a') as fh:\n    fh.write('image sitecustomize\\n')\n")
    return python, site


def in_image(python: Path, tmp: Path, env: dict) -> tuple[dict, int]:
    """PROBE in the image with only ``env`` (and PATH, HOME); its result and how often the image's
    sitecustomize ran."""
    log = tmp / f"sc-{len(list(tmp.glob('sc-*')))}.log"
    log.touch()
    proc = subprocess.run([str(python), "-c", PROBE], capture_output=True, text=True, timeout=120, cwd=tmp,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(tmp), "IMG_SC_LOG": str(log), **env})
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1]), len(log.read_text().splitlines())


def overlay(tmp: Path, image_python: Path, name: str = "overlay") -> tuple[Path, dict]:
    out = tmp / name
    proc = run_cli("overlay", str(out), "--python", str(image_python), timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out, json.loads((out / "drama3-overlay.json").read_text())


def test_with_the_overlay_alone_a_childs_target_import_is_patched_and_the_images_sitecustomize_runs_once(tmp_path):
    python, site = make_image(tmp_path / "image")
    manifest = write_manifest(tmp_path, {"targets": ["d3p_target:greet"]})
    out, record = overlay(tmp_path, python)
    assert record["dependencies_written"] == [] and set(record["image_has"]) == set(ALL_DEPS)
    assert record["image_sitecustomize"] == str(site / "sitecustomize.py")
    assert sorted(p.name for p in out.iterdir()) == ["drama3-overlay.json", "drama3_patches", "sitecustomize.py"]
    on = {"PYTHONPATH": str(out), "DRAMA3_PATCHES": "1", "DRAMA3_PATCHES_MANIFEST": str(manifest)}

    got, ran = in_image(python, tmp_path, on)
    assert got["greet"] == "hello img! [patched]", got
    assert got["package"] == str(out / "drama3_patches" / "__init__.py")
    assert got["activated_by"] == "sitecustomize" and got["states"] == {"selftest": "applied"}
    assert got["sitecustomize"] == str(site / "sitecustomize.py") and ran == 1

    # Controls: the image alone has no drama3-patches; the overlay with DRAMA3_PATCHES off loads
    # nothing of ours. The image's sitecustomize runs once either way.
    got, ran = in_image(python, tmp_path, {"DRAMA3_PATCHES": "1", "DRAMA3_PATCHES_MANIFEST": str(manifest)})
    assert (got["greet"], got["loaded"], ran) == ("hello img!", False, 1), got
    got, ran = in_image(python, tmp_path, {**on, "DRAMA3_PATCHES": "0"})
    assert (got["greet"], got["loaded"], ran) == ("hello img!", False, 1), got


def test_the_overlay_copies_the_package_and_its_manifest_and_no_upstream_code(tmp_path):
    python, _ = make_image(tmp_path / "image")
    out, _ = overlay(tmp_path, python)
    files = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()}
    assert "drama3_patches/patches_manifest.yaml" in files and "drama3_patches/_bootstrap.py" in files
    assert not [f for f in files if "__pycache__" in f or f.endswith(".pyc")]
    assert not [f for f in files if f.split("/")[0] not in {"drama3_patches", "sitecustomize.py",
                                                              "drama3-overlay.json"}], files
    # readable by a container's user, writable by nobody else
    assert all(p.stat().st_mode & 0o777 in (0o644, 0o755) for p in [out, *out.rglob("*")])


@pytest.mark.packaging  # pip fetches wrapt from the package index, as for the wheelhouse
def test_the_overlay_writes_the_dependency_the_image_lacks_at_a_version_the_package_accepts(tmp_path):
    from packaging.requirements import Requirement
    from packaging.version import Version

    python, _ = make_image(tmp_path / "image", deps=("packaging", "PyYAML"))
    manifest = write_manifest(tmp_path, {"targets": ["d3p_target:greet"]})
    out, record = overlay(tmp_path, python)
    (wanted,) = [Requirement(r) for r in importlib.metadata.requires("drama3-patches") if r.startswith("wrapt")]
    assert record["dependencies_written"] == [str(wanted)] and record["image_has"]["wrapt"] is None
    (info,) = out.glob("wrapt-*.dist-info")
    assert Version(info.name.split("-")[1].removesuffix(".dist")) in wanted.specifier
    assert not list(out.glob("yaml")) and not list(out.glob("packaging"))  # the image's own are used
    got, ran = in_image(python, tmp_path, {"PYTHONPATH": str(out), "DRAMA3_PATCHES": "1",
                                           "DRAMA3_PATCHES_MANIFEST": str(manifest)})
    assert (got["greet"], got["states"], ran) == ("hello img! [patched]", {"selftest": "applied"}, 1), got


@pytest.mark.parametrize("kind", ["not-empty", "others-write", "link", "file"])
def test_the_overlay_refuses_a_folder_it_cannot_own_whole_and_writes_nothing(tmp_path, kind):
    python, _ = make_image(tmp_path / "image")
    target = tmp_path / "out"
    if kind == "link":
        (tmp_path / "elsewhere").mkdir()
        target.symlink_to(tmp_path / "elsewhere")
    elif kind == "file":
        target.write_text("x")
    else:
        target.mkdir(mode=0o755)
        if kind == "not-empty":
            (target / "keep").write_text("theirs")
        else:
            os.chmod(target, 0o777)
    before = sorted(os.listdir(tmp_path))
    proc = run_cli("overlay", str(target), "--python", str(python))
    assert proc.returncode == 2 and proc.stderr.startswith("drama3-patches overlay: "), proc.stderr
    assert sorted(os.listdir(tmp_path)) == before  # no half-written folder beside it
    # control: an empty folder of this user, closed to others, is taken
    empty = tmp_path / "empty"
    empty.mkdir(mode=0o755)
    assert run_cli("overlay", str(empty), "--python", str(python)).returncode == 0
    assert (empty / "sitecustomize.py").is_file()


ROUTE = """
import json, os, sys
import drama3_patches
route = sys.argv[1]
if route == "plugin":
    os.environ["DRAMA3_PATCHES"] = "1"  # after start-up: only the plugin activates
    from drama3_patches import plugin
    plugin.register()
elif route == "api":
    drama3_patches.apply()
print(json.dumps(drama3_patches.status()["activated_by"]))
"""


@pytest.mark.parametrize(("route", "enabled", "want"),
                         [(".pth", "1", ".pth"), ("plugin", None, "plugin"), ("api", None, "api"),
                          ("none", None, None)])
def test_status_says_how_the_process_was_activated(tmp_path, route, enabled, want):
    write_target(tmp_path)
    manifest = write_manifest(tmp_path, {"targets": ["d3p_target:greet"]})
    env = {"DRAMA3_PATCHES_MANIFEST": str(manifest), **({"DRAMA3_PATCHES": enabled} if enabled else {})}
    proc = run_python(ROUTE, env=env, pythonpath=[tmp_path], args=[route])
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == want

"""Tier 1: the start-up list of target modules, cached per manifest, and every way it stays honest.

The ``.pth`` line's ``_bootstrap.activate`` takes the target modules from a private cache file
keyed by the manifest's path and identity on disk, and scans the manifest when there is no
entry for it as it is now. Each child here is a fresh interpreter started as a serving process
is (the ``.pth`` line on), with its own cache folder (``DRAMA3_PATCHES_CACHE_DIR``).

A cache entry is written only for a manifest unchanged for ``RACY_NS`` (one second), so the
module fixture writes the manifests first and waits that long once.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from support.hostile import hostile_user  # noqa: F401 (a fixture)
from support.selftest import manifest_text, write_target
from support.subproc import ROOT, call

T_TARGET = "d3p_target:greet"
T_OTHER = "d3p_other:greet"
GENERATED = 12  # entries added to the shipped manifest: at least twice its 12 of the day in all


def start_and_import(modules: list) -> dict:
    """Runs in a fresh interpreter: where the start-up list came from, what of ours the start loaded,
    then each module imported in turn and its ``greet('x')``, and the first patch's state."""
    import importlib
    import sys

    from drama3_patches import _bootstrap

    out = {"from": _bootstrap.targets_from,
           "idle": sorted(m for m in sys.modules if m.startswith("drama3_patches")),
           "triggers": sorted(_bootstrap.installed_finder().modules) if _bootstrap.installed_finder() else None}
    out["greet"] = [importlib.import_module(m).greet("x") for m in modules]
    if modules:
        import drama3_patches

        patches = drama3_patches.status()["patches"]
        out["state"] = patches[0]["state"] if patches else None
    return out


def _aged(path: Path) -> Path:
    """``path`` unchanged since the module fixture's wait (else its entry would not be cached)."""
    age = time.time_ns() - max(path.stat().st_mtime_ns, path.stat().st_ctime_ns)
    assert age >= 1_000_000_000, f"{path} changed {age / 1e9:.2f} s ago"
    return path


@pytest.fixture(scope="module")
def aged(tmp_path_factory):
    """Target modules, manifests and two copies of the installed package (each with its packaged
    manifest), written once and then left alone for a second."""
    root = tmp_path_factory.mktemp("startup")
    mods = root / "mods"
    write_target(mods)
    write_target(mods, "d3p_other")
    for i in range(GENERATED):
        write_target(mods, f"d3p_gen{i}")
    files = {"mods": mods}
    for name, targets in (("target", [T_TARGET]), ("other", [T_OTHER])):
        files[name] = root / f"{name}.yaml"
        files[name].write_text(manifest_text({"targets": targets}))
    # Today's manifest and as many entries again, each on a module of its own: the list must
    # follow whatever the manifest names, new entries included, with no list kept by hand.
    generated = manifest_text(*({"id": f"generated-{i}", "targets": [f"d3p_gen{i}:greet"]} for i in range(GENERATED)))
    files["generated"] = root / "generated.yaml"
    files["generated"].write_text((ROOT / "patches_manifest.yaml").read_text().rstrip("\n") + "\n"
                                  + generated.split("\n", 1)[1])
    for name in ("edited", "operator"):
        site = root / f"site-{name}"
        shutil.copytree(ROOT / "drama3_patches", site / "drama3_patches",
                        ignore=shutil.ignore_patterns("__pycache__", "tools"))
        (site / "drama3_patches" / "patches_manifest.yaml").write_text(manifest_text({"targets": [T_TARGET]}))
        files[f"site-{name}"] = site
    time.sleep(1.1)
    return files


def _start(aged, cache: Path, modules: list, manifest: Path | None = None, site: Path | None = None, **env) -> dict:
    full = {"DRAMA3_PATCHES": "1", "DRAMA3_PATCHES_CACHE_DIR": str(cache), **env}
    if manifest is not None:
        full["DRAMA3_PATCHES_MANIFEST"] = str(manifest)
    paths = ([site] if site else []) + [aged["mods"]]
    got = call(start_and_import, modules, env=full, pythonpath=paths, with_output=True)
    assert got["stderr"] == "", got["stderr"]
    return got["result"]


def _cache_name() -> str:
    from drama3_patches import _bootstrap  # not at module level: the children import this module

    return _bootstrap.CACHE_NAME


SCANNED = ["drama3_patches", "drama3_patches._bootstrap", "drama3_patches.reader"]
CACHED = ["drama3_patches", "drama3_patches._bootstrap"]


def test_the_first_start_caches_the_list_and_later_starts_use_it(aged, tmp_path):
    cache = tmp_path / "cache"
    first = _start(aged, cache, ["d3p_target"], _aged(aged["target"]))
    assert (first["from"], first["idle"], first["greet"]) == ("manifest", SCANNED, ["hello x! [patched]"])
    # The cache folder and file are this user's alone.
    assert cache.stat().st_mode & 0o777 == 0o700
    assert (cache / _cache_name()).stat().st_mode & 0o777 == 0o600
    second = _start(aged, cache, ["d3p_target"], aged["target"])
    # Served from the cache: no reader, no scan; only the package and its start-up hook loaded.
    assert (second["from"], second["idle"], second["greet"]) == ("cache", CACHED, ["hello x! [patched]"])
    assert second["triggers"] == first["triggers"] == ["d3p_target"]


def test_new_manifest_entries_are_picked_up_with_no_list_kept_by_hand(aged, tmp_path):
    from drama3_patches.manifest import load_manifest

    named = sorted({m for p in load_manifest(aged["generated"]).patches for m in p.modules})
    shipped = len(load_manifest(ROOT / "patches_manifest.yaml").patches)
    assert len(load_manifest(aged["generated"]).patches) == shipped + GENERATED >= 2 * 12  # the shipped, and 12 more
    cache = tmp_path / "cache"
    first = _start(aged, cache, [], _aged(aged["generated"]))
    second = _start(aged, cache, ["d3p_gen7"], aged["generated"])
    assert (first["from"], second["from"]) == ("manifest", "cache")
    assert first["triggers"] == second["triggers"] == named
    assert second["greet"] == ["hello x! [patched]"]


def test_a_manifest_edited_after_install_is_honoured(aged, tmp_path):
    site, cache = aged["site-edited"], tmp_path / "cache"
    packaged = _aged(site / "drama3_patches" / "patches_manifest.yaml")
    assert _start(aged, cache, ["d3p_target"], site=site)["from"] == "manifest"
    assert _start(aged, cache, ["d3p_target", "d3p_other"], site=site)["greet"] == ["hello x! [patched]", "hello x!"]
    # The operator edits the installed manifest: the cached list was for the file as it was.
    packaged.write_text(manifest_text({"targets": [T_OTHER]}))
    got = _start(aged, cache, ["d3p_target", "d3p_other"], site=site)
    assert (got["from"], got["triggers"], got["greet"]) == ("manifest", ["d3p_other"],
                                                           ["hello x!", "hello x! [patched]"])


def test_an_operators_manifest_is_honoured_beside_the_packaged_one(aged, tmp_path):
    site, cache = aged["site-operator"], tmp_path / "cache"
    _aged(site / "drama3_patches" / "patches_manifest.yaml")
    for _ in range(2):  # the second round is served from the cache, one entry per manifest
        packaged = _start(aged, cache, ["d3p_target", "d3p_other"], site=site)
        operator = _start(aged, cache, ["d3p_target", "d3p_other"], _aged(aged["other"]), site=site)
        assert packaged["greet"] == ["hello x! [patched]", "hello x!"]
        assert operator["greet"] == ["hello x!", "hello x! [patched]"]
    assert (packaged["from"], operator["from"]) == ("cache", "cache")


def test_disable_is_honoured_with_a_cached_list(aged, tmp_path):
    cache = tmp_path / "cache"
    _start(aged, cache, [], _aged(aged["target"]))
    got = _start(aged, cache, ["d3p_target"], aged["target"], DRAMA3_PATCHES_DISABLE="selftest")
    assert (got["from"], got["greet"], got["state"]) == ("cache", ["hello x!"], "skipped")


def _plant_entry(cache: Path, manifest: Path, modules: list[str], mode: int = 0o600) -> Path:
    """A cache file whose entry matches ``manifest`` as it is now, listing ``modules``."""
    from drama3_patches import _bootstrap

    cache.mkdir(mode=0o700, exist_ok=True)
    path = cache / _bootstrap.CACHE_NAME
    path.write_text(f"{_bootstrap.CACHE_HEADER}\n{manifest}\t{_bootstrap._key(os.stat(manifest))}\t"
                    f"{' '.join(modules)}\n")
    path.chmod(mode)
    return path


def test_a_stale_list_never_patches_what_the_manifest_no_longer_names(aged, tmp_path):
    """The list names d3p_other, the manifest d3p_target (as if the manifest changed within one
    timestamp tick of the entry's writing). d3p_other's trigger reaches the engine, which finds no
    patch for it and then triggers d3p_target too; a d3p_target imported before that is patched
    once the engine runs. Until some trigger fires, a module missing from the list waits."""
    cache = tmp_path / "cache"
    _plant_entry(cache, _aged(aged["target"]), ["d3p_other"])
    got = _start(aged, cache, ["d3p_other", "d3p_target"], aged["target"])
    assert (got["from"], got["triggers"]) == ("cache", ["d3p_other"])
    assert (got["greet"], got["state"]) == (["hello x!", "hello x! [patched]"], "applied")
    env = {"DRAMA3_PATCHES": "1", "DRAMA3_PATCHES_CACHE_DIR": str(cache),
           "DRAMA3_PATCHES_MANIFEST": str(aged["target"])}
    got = call(named_module_first, env=env, pythonpath=[aged["mods"]])
    assert got == ["hello x!", "hello x!", "hello x! [patched]"]


def named_module_first() -> list:
    """d3p_target bound before any trigger fired (the stale list lacks it), then d3p_other's trigger."""
    import d3p_target

    before = d3p_target.greet("x")
    import d3p_other

    return [before, d3p_other.greet("x"), d3p_target.greet("x")]


def _others_can_write(cache: Path, manifest: Path, hostile) -> None:
    _plant_entry(cache, manifest, ["d3p_target"])
    cache.chmod(0o777)


def _link(cache: Path, manifest: Path, hostile) -> None:
    planted = _plant_entry(cache, manifest, ["d3p_target"])
    real = cache.parent / "elsewhere"
    planted.rename(real)
    planted.symlink_to(real)


def _folder_is_a_link(cache: Path, manifest: Path, hostile) -> None:
    real = cache.parent / "real-cache"
    _plant_entry(real, manifest, ["d3p_target"])
    cache.symlink_to(real)


def _file_others_can_write(cache: Path, manifest: Path, hostile) -> None:
    _plant_entry(cache, manifest, ["d3p_target"], mode=0o666)


def _file_of_another_user(cache: Path, manifest: Path, hostile) -> None:
    os.chown(_plant_entry(cache, manifest, ["d3p_target"]), hostile.uid, hostile.gid)


def _garbled(cache: Path, manifest: Path, hostile) -> None:
    _plant_entry(cache, manifest, ["d3p_target"]).write_bytes(b"\xff\xfe not a cache \x00\n")


def _truncated(cache: Path, manifest: Path, hostile) -> None:
    path = _plant_entry(cache, manifest, ["d3p_target"])
    path.write_text(path.read_text().rstrip("\n"))  # no final newline: not written whole


def _folder_is_a_file(cache: Path, manifest: Path, hostile) -> None:
    cache.write_text("not a folder\n")


CACHE_FAULTS = {
    "folder-others-can-write": _others_can_write,
    "folder-is-a-link": _folder_is_a_link,
    "file-is-a-link": _link,
    "file-others-can-write": _file_others_can_write,
    "file-of-another-user": _file_of_another_user,
    "garbled": _garbled,
    "truncated": _truncated,
    "folder-is-a-file": _folder_is_a_file,
}


@pytest.fixture
def maybe_hostile(request):
    """The hostile account, only for the case that needs one (it needs root)."""
    if request.node.callspec.params["fault"] == "file-of-another-user":
        return request.getfixturevalue("hostile_user")
    return None


@pytest.mark.parametrize("fault", sorted(CACHE_FAULTS))
def test_a_cache_in_doubt_is_not_read_and_start_up_scans_instead(aged, tmp_path, fault, maybe_hostile):
    """Each planted cache lists d3p_target for the manifest as it is now, while the manifest names
    d3p_other: a cache that were read would trigger the wrong module. STRICT=1: nothing is raised."""
    cache = tmp_path / "cache"
    CACHE_FAULTS[fault](cache, _aged(aged["other"]), maybe_hostile)
    got = _start(aged, cache, ["d3p_other"], aged["other"], DRAMA3_PATCHES_STRICT="1")
    assert (got["from"], got["triggers"], got["greet"]) == ("manifest", ["d3p_other"], ["hello x! [patched]"])


def test_no_cache_folder_to_name_means_a_scan_at_every_start(aged, tmp_path):
    env = {"DRAMA3_PATCHES": "1", "DRAMA3_PATCHES_MANIFEST": str(_aged(aged["target"])), "HOME": "",
           "XDG_CACHE_HOME": ""}
    for _ in range(2):
        got = call(start_and_import, ["d3p_target"], env=env, pythonpath=[aged["mods"]])
        assert (got["from"], got["greet"]) == ("manifest", ["hello x! [patched]"])


def test_a_manifest_changed_within_the_last_second_is_not_cached(aged, tmp_path):
    manifest, cache = tmp_path / "fresh.yaml", tmp_path / "cache"
    manifest.write_text(manifest_text({"targets": [T_TARGET]}))
    future = time.time_ns() + 3600 * 10**9  # its times say it changes from now on
    os.utime(manifest, ns=(future, future))
    for _ in range(2):
        assert _start(aged, cache, ["d3p_target"], manifest)["from"] == "manifest"
    assert not (cache / _cache_name()).exists()


def test_the_manifest_in_force_is_the_variables_else_the_shipped_file(monkeypatch, tmp_path):
    """One implementation (the hook's) says which manifest is in force: unset, it names an existing
    patches_manifest.yaml; set, the variable's path as given; the manifest loader reads that one."""
    from drama3_patches import _bootstrap, env, manifest

    monkeypatch.delenv(env.MANIFEST, raising=False)
    shipped = _bootstrap.manifest_path()
    assert os.path.basename(shipped) == "patches_manifest.yaml" and os.path.isfile(shipped)
    assert manifest.manifest_path is _bootstrap.manifest_path
    monkeypatch.setenv(env.MANIFEST, str(tmp_path / "m.yaml"))
    assert _bootstrap.manifest_path() == str(tmp_path / "m.yaml")


def test_the_hooks_copies_of_the_environment_contract_agree_with_env():
    from drama3_patches import _bootstrap, env
    from drama3_patches.kernels import fp8_build

    assert (_bootstrap._ENABLE, _bootstrap._TRUE, _bootstrap._MANIFEST) == (env.ENABLE, env.TRUE, env.MANIFEST)
    assert _bootstrap._CACHE_DIR == fp8_build.CACHE_DIR_ENV


def test_the_cache_folder_is_the_variables_else_xdgs_else_homes_for_the_hook_and_the_kernel(monkeypatch, tmp_path):
    """One folder for the start-up list and the native fp8 kernel: $DRAMA3_PATCHES_CACHE_DIR (named
    explicitly), else $XDG_CACHE_HOME/drama3_patches, else $HOME/.cache/drama3_patches; with
    neither, the hook keeps none and the kernel's build asks the password database."""
    from drama3_patches import _bootstrap
    from drama3_patches.kernels import fp8_build

    home = tmp_path / "home"
    cases = (({}, home / ".cache" / "drama3_patches", False),
             ({"XDG_CACHE_HOME": str(tmp_path / "x")}, tmp_path / "x" / "drama3_patches", False),
             ({"DRAMA3_PATCHES_CACHE_DIR": str(tmp_path / "c")}, tmp_path / "c", True))
    for variables, folder, explicit in cases:
        for name in ("HOME", "XDG_CACHE_HOME", "DRAMA3_PATCHES_CACHE_DIR"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("HOME", str(home))
        for name, value in variables.items():
            monkeypatch.setenv(name, value)
        assert _bootstrap.cache_dir() == str(folder), variables
        assert fp8_build._cache_dir() == (folder, explicit), variables
    for name in ("HOME", "XDG_CACHE_HOME", "DRAMA3_PATCHES_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)
    assert _bootstrap.cache_dir() is None
    import pwd

    assert fp8_build._cache_dir() == (Path(pwd.getpwuid(os.getuid()).pw_dir) / ".cache" / "drama3_patches", False)

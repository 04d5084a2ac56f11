"""The manifest decides what is patched in every process of a deployment, at every interpreter
start: it is read only when nobody but root or the running user could have written it, and what
it may cost is bounded (issue 41, item 8).

The attacker (uid 65534) writes a manifest in a folder both can write; a manifest group or others
may write is the same case. Costs are counted, never timed: bytes read (``rchar`` of
``/proc/self/io``), YAML events consumed, targets validated, name comparisons.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from support.nobody import as_nobody, shared  # noqa: F401 (a fixture)
from support.selftest import manifest_text, write_target
from support.subproc import run_python

GOOD = manifest_text({"targets": ["d3p_target:greet"]})


def _rchar() -> int:
    with open("/proc/self/io") as fh:
        return int(next(line for line in fh if line.startswith("rchar:")).split()[1])


def write_as_attacker(path: str, text: str) -> None:
    with open(path, "w") as fh:
        fh.write(text)
    os.chmod(path, 0o644)


def _foreign(folder: Path) -> Path:
    path = folder / "manifest.yaml"
    as_nobody(write_as_attacker, str(path), GOOD)
    return path


def _writable(mode: int):
    def make(folder: Path) -> Path:
        path = folder / "manifest.yaml"
        path.write_text(GOOD)
        os.chmod(path, mode)
        return path
    return make


REFUSED = {
    "another-owner": (_foreign, "owned by uid 65534, not by root or this user"),
    "others-can-write": (_writable(0o646), "writable by group or others (mode 646)"),
    "group-can-write": (_writable(0o664), "writable by group or others (mode 664)"),
}


def _start(tmp_path, manifest: Path, **extra):
    write_target(tmp_path / "mods")
    env = {"DRAMA3_PATCHES": "1", "DRAMA3_PATCHES_MANIFEST": str(manifest),
           "DRAMA3_PATCHES_CACHE_DIR": str(tmp_path / "cache"), **extra}
    # the .pth start-up, then what vLLM's plugin hook calls in each of its processes, then a target
    code = "from drama3_patches import plugin; plugin.register(); import d3p_target; print(d3p_target.greet('x'))"
    return run_python(code, env=env, pythonpath=[tmp_path / "mods"], timeout=60, check=False)


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_manifest_someone_else_could_write_is_refused_with_one_warning_and_nothing_patched(tmp_path, shared, case):
    make, why = REFUSED[case]
    manifest = make(shared)
    proc = _start(tmp_path, manifest)
    assert (proc.returncode, proc.stdout.strip()) == (0, "hello x!"), proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(warnings) == 1 and str(manifest) in warnings[0] and why in warnings[0], proc.stderr
    # Strict: the refusal is an error, not a warning.
    strict = _start(tmp_path, manifest, DRAMA3_PATCHES_STRICT="1")
    assert "UnreadableFile" in strict.stderr and why in strict.stderr, strict.stderr
    # Negative control: the same text, root's own and closed to others, patches.
    os.chown(manifest, 0, 0)
    os.chmod(manifest, 0o644)
    assert _start(tmp_path, manifest).stdout.strip() == "hello x! [patched]"


@pytest.mark.forked
def test_the_engines_loader_refuses_another_users_manifest_before_a_byte_is_read(tmp_path, shared):
    from drama3_patches.manifest import ManifestError, load_manifest

    path = shared / "manifest.yaml"
    as_nobody(write_as_attacker, str(path), GOOD + "#" * (1000 * 1000) + "\n")
    load_manifest(Path(__file__).resolve().parents[2] / "patches_manifest.yaml")  # imports, before counting
    before = _rchar()
    with pytest.raises(ManifestError, match="owned by uid 65534"):
        load_manifest(path)
    assert _rchar() - before < 64 * 1024
    os.chown(path, 0, 0)  # negative control: root's, it is read (and parses)
    before = _rchar()
    assert load_manifest(path).ids == ("selftest",)
    assert _rchar() - before >= 1000 * 1000


def _alias_heavy(entries: int = 200, targets: int = 2000) -> str:
    """One entry of ``targets`` targets, anchored, and ``entries`` aliases of it: a few kilobytes
    per alias-free byte, as many entries as the attacker likes."""
    base = manifest_text({"id": "big", "targets": [f"d3p_gen{i}:greet" for i in range(targets)]})
    head, body = base.split("\n", 1)
    return head + "\n" + body.replace("  - id: big", "  - &big\n    id: big", 1) + "\n" + "  - *big\n" * entries


@pytest.mark.forked
def test_yaml_aliases_are_refused_before_any_entry_is_expanded_or_validated(monkeypatch):
    import yaml

    import drama3_patches.manifest as manifest

    events = []
    real_get_event, real_parse_target = yaml.parser.Parser.get_event, manifest.parse_target
    validated = []
    monkeypatch.setattr(yaml.parser.Parser, "get_event", lambda self: events.append(1) or real_get_event(self))
    monkeypatch.setattr(manifest, "parse_target", lambda text: validated.append(1) or real_parse_target(text))
    with pytest.raises(manifest.ManifestError) as refused:
        manifest.parse_manifest(_alias_heavy(), "aliases.yaml")
    assert str(refused.value).startswith("aliases.yaml: line 2: a YAML anchor (&big); anchors and aliases are "
                                         "refused"), refused.value
    assert validated == [], f"{len(validated)} targets validated before the refusal"
    assert len(events) < 20, f"{len(events)} YAML events consumed before the refusal"
    # Negative control: the counters see a manifest written out in full.
    events.clear()
    manifest.parse_manifest(manifest_text({"targets": [f"d3p_gen{i}:greet" for i in range(50)]}))
    assert len(validated) == 50 and len(events) > 50


class Counted(str):
    """A name that counts equality tests against it (a list lookup makes one per element); the
    text methods the scan uses hand back Counted names."""

    eq = 0
    __hash__ = str.__hash__

    def __eq__(self, other):
        Counted.eq += 1
        return str.__eq__(self, other)

    def __ne__(self, other):
        return not self.__eq__(other)

    def _again(name):
        def method(self, *args):
            out = getattr(str, name)(self, *args)
            return [Counted(x) for x in out] if isinstance(out, list) else Counted(out)
        return method

    strip, lstrip, rstrip, split, splitlines, __getitem__ = map(
        _again, ("strip", "lstrip", "rstrip", "split", "splitlines", "__getitem__"))


def test_the_start_up_scan_deduplicates_targets_in_linear_time():
    from drama3_patches._bootstrap import scan_target_modules

    n = 2000
    names = [f"d3p_gen{i}" for i in range(n)]
    text = manifest_text({"targets": [f"{m}:greet" for m in names] + [f"{m}:other" for m in names]})
    Counted.eq = 0
    got = scan_target_modules(Counted(text))
    compared = Counted.eq
    assert got == names
    lines = text.count("\n") + 1
    # Each repeated name is compared with its first once; a list lookup compares with every earlier one.
    assert n <= compared <= n + lines, compared


def test_the_engines_target_modules_are_deduplicated_in_linear_time():
    from drama3_patches.manifest import PatchSpec, Target

    n = 2000
    names = [Counted(f"d3p_gen{i}") for i in range(n)]
    targets = tuple(Target(spec=f"{m}:{q}", module=Counted(m), qualname=q) for q in ("f", "g") for m in names)
    spec = PatchSpec(id="big", summary="s", targets=targets, requires={}, platforms=("cpu",),
                     implementation="drama3_patches.patches.selftest:plan", why="w", how="h", upstream="u",
                     remove_when="r")
    Counted.eq = 0
    asked = [spec.modules, spec.modules]  # asked again and again by the engine
    compared = Counted.eq
    assert asked == [tuple(names)] * 2
    # Each repeated name is compared with its first once, and only the first time it is asked.
    assert n <= compared <= 2 * n, compared


@pytest.mark.forked
def test_a_start_up_cache_entry_is_not_used_for_a_manifest_others_can_write(tmp_path, monkeypatch):
    """The start-up list cached for a manifest (as an older version cached any) is not used once
    the manifest is one the scan refuses: start-up then scans, and refuses it with the warning."""
    import time

    from drama3_patches import _bootstrap

    monkeypatch.setenv("DRAMA3_PATCHES_CACHE_DIR", str(tmp_path / "cache"))
    paths = {}
    for name, mode in (("writable", 0o666), ("closed", 0o644)):
        paths[name] = tmp_path / f"{name}.yaml"
        paths[name].write_text(GOOD)
        os.chmod(paths[name], mode)
    time.sleep(_bootstrap.RACY_NS / 1e9 + 0.1)  # a manifest changed within the last second is not cached
    for path in paths.values():
        _bootstrap._store(str(path), os.stat(path), ["d3p_target"])
    assert _bootstrap._from_cache(str(paths["writable"])) is None
    assert _bootstrap._from_cache(str(paths["closed"])) == ["d3p_target"]  # negative control: the entry is there

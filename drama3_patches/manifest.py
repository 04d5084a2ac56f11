"""Load and validate ``patches_manifest.yaml``.

A malformed manifest fails with one message naming the file, the entry id and
the field, so an operator who edits module names for their build can fix it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cache, cached_property
from pathlib import Path

from drama3_patches._bootstrap import manifest_path
from drama3_patches.env import PLATFORMS
from drama3_patches.reader import read_manifest_text

IMPLEMENTATION_PREFIX = "drama3_patches.patches."
TEXT_FIELDS = ("summary", "why", "how", "upstream", "remove_when")
KNOWN_FIELDS = {"id", "targets", "requires", "platforms", "implementation", "reviewed_source", *TEXT_FIELDS}
_FINGERPRINT = re.compile(r"^[0-9a-f]{16}$")


class ManifestError(ValueError):
    """The manifest cannot be used; the message says where and why."""


@dataclass(frozen=True)
class Target:
    spec: str
    module: str
    qualname: str

    @property
    def attr_path(self) -> tuple[str, ...]:
        return tuple(self.qualname.split("."))


@dataclass(frozen=True)
class PatchSpec:
    id: str
    summary: str
    targets: tuple[Target, ...]
    requires: dict[str, str]
    platforms: tuple[str, ...]
    implementation: str
    why: str
    how: str
    upstream: str
    remove_when: str
    specifiers: dict = field(default_factory=dict, compare=False, repr=False)
    # target spec -> {version of the target's distribution: fingerprint} (drama3_patches/tools/fingerprint.py)
    reviewed_source: dict = field(default_factory=dict, compare=False, repr=False)

    @cached_property
    def modules(self) -> tuple[str, ...]:
        """The target modules, in order, each once (linear: the engine asks at every import)."""
        return tuple(dict.fromkeys(t.module for t in self.targets))


@dataclass(frozen=True)
class Manifest:
    path: Path
    patches: tuple[PatchSpec, ...]

    def get(self, patch_id: str) -> PatchSpec:
        for p in self.patches:
            if p.id == patch_id:
                return p
        raise KeyError(patch_id)

    @property
    def ids(self) -> tuple[str, ...]:
        return tuple(p.id for p in self.patches)


def _is_dotted(name: str) -> bool:
    return bool(name) and all(part.isidentifier() for part in name.split("."))


def parse_target(text: str) -> Target:
    """``module.path:Qualified.name`` -> Target, or ValueError saying what is wrong."""
    if not isinstance(text, str) or text.count(":") != 1:
        raise ValueError(f"{text!r} is not of the form 'module.path:Qualified.name'")
    module, qualname = (s.strip() for s in text.split(":"))
    if not _is_dotted(module):
        raise ValueError(f"{text!r}: {module!r} is not a dotted module name")
    if not _is_dotted(qualname):
        raise ValueError(f"{text!r}: {qualname!r} is not a dotted attribute name")
    return Target(spec=f"{module}:{qualname}", module=module, qualname=qualname)


def _entry(raw: dict, index: int, path: Path) -> PatchSpec:
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    pid = raw.get("id") if isinstance(raw, dict) else None
    where = f"{path}: patch {pid!r}" if isinstance(pid, str) else f"{path}: entry #{index + 1}"

    def fail(fld: str, problem: str) -> ManifestError:
        return ManifestError(f"{where}: field {fld!r}: {problem}")

    if not isinstance(raw, dict):
        raise ManifestError(f"{where}: an entry must be a mapping, got {type(raw).__name__}")
    unknown = sorted(set(raw) - KNOWN_FIELDS)
    if unknown:
        raise fail(unknown[0], f"unknown field (known: {', '.join(sorted(KNOWN_FIELDS))})")
    if not isinstance(pid, str) or not pid or pid != pid.strip() or " " in pid:
        raise fail("id", "must be a non-empty string without spaces")

    targets_raw = raw.get("targets")
    if not isinstance(targets_raw, list) or not targets_raw:
        raise fail("targets", "must be a non-empty list of 'module:Qualified.name'")
    targets = []
    for t in targets_raw:
        try:
            targets.append(parse_target(t))
        except ValueError as exc:
            raise fail("targets", str(exc)) from None
    if len({t.spec for t in targets}) != len(targets):
        raise fail("targets", "lists a target twice")

    requires_raw = raw.get("requires", {}) or {}
    if not isinstance(requires_raw, dict):
        raise fail("requires", "must map distribution names to PEP 440 specifiers")
    requires: dict[str, str] = {}
    specifiers = {}
    for dist, spec in requires_raw.items():
        if not isinstance(dist, str) or not isinstance(spec, str):
            raise fail("requires", f"{dist!r}: {spec!r} must be a string specifier")
        try:
            specifiers[dist] = SpecifierSet(spec, prereleases=True)
        except InvalidSpecifier as exc:
            raise fail("requires", f"{dist}: {exc}") from None
        requires[dist] = spec

    platforms = raw.get("platforms")
    if not isinstance(platforms, list) or not platforms:
        raise fail("platforms", f"must be a non-empty list drawn from {list(PLATFORMS)}")
    bad = [p for p in platforms if p not in PLATFORMS]
    if bad:
        raise fail("platforms", f"{bad[0]!r} is not one of {list(PLATFORMS)}")

    impl = raw.get("implementation")
    if not isinstance(impl, str) or impl.count(":") != 1:
        raise fail("implementation", "must be 'drama3_patches.patches.<module>:<function>'")
    impl_module, impl_func = impl.split(":")
    if not impl_module.startswith(IMPLEMENTATION_PREFIX) or not _is_dotted(impl_module):
        raise fail("implementation", f"{impl!r} names code outside {IMPLEMENTATION_PREFIX}*")
    if not impl_func.isidentifier():
        raise fail("implementation", f"{impl_func!r} is not a function name")

    reviewed = raw.get("reviewed_source", {}) or {}
    if not isinstance(reviewed, dict):
        raise fail("reviewed_source", "must map targets to {version: fingerprint}")
    known = {t.spec for t in targets}
    for spec, versions in reviewed.items():
        if spec not in known:
            raise fail("reviewed_source", f"{spec!r} is not one of this patch's targets")
        if not isinstance(versions, dict) or not versions or not all(
                isinstance(v, str) and isinstance(h, str) and _FINGERPRINT.match(h) for v, h in versions.items()):
            raise fail("reviewed_source", f"{spec}: must map version strings to 16 hex digits")

    texts = {}
    for fld in TEXT_FIELDS:
        value = raw.get(fld)
        if not isinstance(value, str) or not value.strip():
            raise fail(fld, "is missing or empty (every patch records why/how/upstream/remove_when)")
        texts[fld] = " ".join(value.split())

    return PatchSpec(
        id=pid,
        targets=tuple(targets),
        requires=requires,
        platforms=tuple(platforms),
        implementation=impl,
        specifiers=specifiers,
        reviewed_source={spec: dict(v) for spec, v in reviewed.items()},
        **texts,
    )


@cache
def _loader():
    """PyYAML's safe loader, refusing anchors and aliases as the parser meets them: an alias is
    the YAML node graph's only way to repeat an entry without its bytes (200 aliases of a 2,000-target
    entry validated 402,000 targets before the duplicate ids were seen), and no manifest needs one."""
    import yaml

    class Refused(yaml.YAMLError):
        pass

    class ManifestLoader(yaml.SafeLoader):
        refused = Refused

        def compose_node(self, parent, index):
            event = self.peek_event()
            alias = isinstance(event, yaml.AliasEvent)
            if alias or getattr(event, "anchor", None) is not None:
                raise Refused(f"line {event.start_mark.line + 1}: a YAML {'alias' if alias else 'anchor'} "
                              f"({'*' if alias else '&'}{event.anchor}); anchors and aliases are refused in a "
                              "manifest: write each entry out in full")
            return super().compose_node(parent, index)

    return ManifestLoader


def parse_manifest(text: str, path: Path | str = "<manifest>") -> Manifest:
    import yaml

    path = Path(path)
    loader = _loader()
    try:
        data = yaml.load(text, Loader=loader)  # noqa: S506 (a SafeLoader)
    except loader.refused as exc:
        raise ManifestError(f"{path}: {exc}") from None
    except yaml.YAMLError as exc:
        raise ManifestError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("patches"), list):
        raise ManifestError(f"{path}: the top level must be a mapping with a 'patches' list")
    patches = tuple(_entry(raw, i, path) for i, raw in enumerate(data["patches"]))
    seen: set[str] = set()
    for p in patches:
        if p.id in seen:
            raise ManifestError(f"{path}: patch {p.id!r}: field 'id': used by two entries")
        seen.add(p.id)
    return Manifest(path=path, patches=patches)


def load_manifest(path: Path | str | None = None) -> Manifest:
    path = Path(path) if path is not None else Path(manifest_path())
    try:
        text = read_manifest_text(str(path))
    except OSError as exc:  # reader.UnreadableFile: one line naming the path and the problem
        raise ManifestError(str(exc)) from None
    return parse_manifest(text, path)

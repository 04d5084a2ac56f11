"""``drama3-patches drift``: what moved upstream under each patch, read from a source tree.

Given folders holding vLLM's (and, where present, vLLM-Omni's and vLLM-Ascend's) packages, as
installed (``site-packages``), as an unpacked source distribution (vLLM-Ascend publishes no wheel
here; its sdist is its newest public source) or as a recorded extract, the report says per patch
and target:

* whether the module and the name resolve (read from the source, nothing is imported);
* whether the target's source fingerprint (``drama3_patches/tools/fingerprint.py``) differs from the
  one the manifest's ``reviewed_source`` records for the newest reviewed version;
* whether the names the patch's implementation reads around its targets (its imports of, and
  string constants naming, ``vllm``/``vllm_omni``/``vllm_ascend`` modules and attributes, and those
  of the private helper modules it imports or a target of its own lives in) exist;
* whether the version guard would take the patch at the tree's versions.

It writes ``report.md`` and ``report.json`` in ``--out`` and never edits the manifest: a reviewer
reads the report, reviews the patch on the new version and records the new fingerprints.
"""

from __future__ import annotations

import ast
import json
import os
import re
from pathlib import Path

# Top-level package -> the distribution that ships it.
PACKAGES = {"vllm": "vllm", "vllm_omni": "vllm-omni", "vllm_ascend": "vllm-ascend"}
_NAME = re.compile(r"^(vllm|vllm_omni|vllm_ascend)(\.\w+)+(:[\w.]+)?$")
# Names a patch looks up by feature that were absent when it was reviewed (a place a later release
# may fill, or another release's layout): their absence is not drift.
PROBES = {
    "vllm_omni.platforms.npu.worker_v2": "runner-selection: where a vLLM-Omni release would put an NPU V2 runner",
    "vllm_ascend.quantization.fp8_config": "fp8-expert-method: the 2026-08 layout (0.30.0rc2 has configs/)",
    "vllm_ascend.quantization.configs.fp8_config": "fp8-expert-method: the 0.30.0rc2 layout",
    "vllm_ascend.quantization.methods.registry": "fp8-expert-method: the block-FP8 MoE scheme's registry (0.30.0rc2)",
    "vllm_ascend.utils:get_ascend_device_type": "fp8-expert-method: older releases' device type",
    "vllm_ascend.utils:maybe_trans_nz": "fp8-expert-method: older releases' place of maybe_trans_nz",
}
_DIST_INFO = re.compile(r"^(vllm|vllm_omni|vllm_ascend)-([^-]+)\.dist-info$")


def register(sub) -> None:
    p = sub.add_parser("drift", help="report what moved upstream under each patch, from a source tree")
    p.add_argument("--tree", metavar="DIR", action="append", default=[],
                   help="folder holding the vllm package (default: where the installed vllm is); again "
                        "for another folder, e.g. an unpacked vllm-ascend sdist (the first folder that "
                        "holds a package is read for it)")
    p.add_argument("--version", metavar="DIST=VERSION", action="append", default=[],
                   help="a distribution's version in the trees (default: its .dist-info there, or an "
                        "unpacked sdist's PKG-INFO)")
    p.add_argument("--out", metavar="DIR", default="drift-out", help="where report.md and report.json go "
                                                                     "(default drift-out)")
    p.set_defaults(func=run)


def _sdist_version(root: str) -> tuple[str, str] | None:
    """(distribution, version) from the headers of an unpacked sdist's ``PKG-INFO``."""
    from email.parser import HeaderParser

    from drama3_patches.reader import read_text

    try:
        text = read_text(os.path.join(root, "PKG-INFO"), 1024 * 1024, "PKG-INFO")
    except OSError:
        return None
    headers = HeaderParser().parsestr(text)  # the headers end at the first blank line
    dist = PACKAGES.get((headers.get("Name") or "").replace("-", "_"))
    version = (headers.get("Version") or "").strip()
    return (dist, version) if dist and version else None


def tree_versions(root: str) -> dict[str, str]:
    """Versions of the watched distributions in ``root``: its ``.dist-info`` folders, or the
    ``PKG-INFO`` of an unpacked sdist."""
    out = {}
    try:
        entries = os.listdir(root)
    except OSError:
        return out
    for entry in entries:
        m = _DIST_INFO.match(entry)
        if m:
            out[PACKAGES[m.group(1)]] = m.group(2)
    sdist = _sdist_version(root)
    if sdist:
        out.setdefault(*sdist)
    return out


def versions_of(trees: list[str]) -> dict[str, str]:
    """``tree_versions`` of each folder; the first folder's win, as its packages do."""
    out: dict[str, str] = {}
    for root in reversed(trees):
        out.update(tree_versions(root))
    return out


def package_roots(trees: list[str]) -> dict[str, str]:
    """Top-level package -> the first of ``trees`` that holds it."""
    out: dict[str, str] = {}
    for root in trees:
        for pkg in PACKAGES:
            if pkg not in out and os.path.isdir(os.path.join(root, pkg)):
                out[pkg] = root
    return out


_HELPERS = "drama3_patches.patches._"  # the patches' private helper modules (shared runner classes)


def _module_reads(base: str, module: str) -> tuple[set, set]:
    """(upstream names, private helper modules) that ``module``'s source under ``base`` imports or
    names in string constants."""
    from drama3_patches.tools import fingerprint

    path = fingerprint.module_file(base, module)
    text = fingerprint.read_source(path) if path else None
    if text is None:
        return set(), set()
    names, helpers = set(), set()
    package = module.rpartition(".")[0]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom):
            source = node.module or ""
            if node.level == 1:  # `from ._helper import X` / `from . import _helper` in the patches package
                source = f"{package}.{source}" if source else package
            elif node.level:
                continue
            if source.split(".")[0] in PACKAGES:
                names.update(f"{source}:{a.name}" for a in node.names)
            helpers.update(m for m in [source, *(f"{source}.{a.name}" for a in node.names)] if m.startswith(_HELPERS))
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names if a.name.split(".")[0] in PACKAGES)
            helpers.update(a.name for a in node.names if a.name.startswith(_HELPERS))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _NAME.match(node.value):
            names.add(node.value)
    return names, {h for h in helpers if fingerprint.module_file(base, h)}


def reads(implementation: str, root: str | None = None, also: tuple = ()) -> list[str]:
    """The upstream names the implementation module reads (imports and string constants), with those
    of the private helper modules it imports and of ``also`` (modules of this package a target
    lives in), one level deep."""
    module = implementation.split(":")[0]
    base = root or str(Path(__file__).resolve().parents[2])  # the folder holding drama3_patches
    names, helpers = _module_reads(base, module)
    for helper in sorted((helpers | {m for m in also if m.startswith(_HELPERS)}) - {module}):
        names |= _module_reads(base, helper)[0]
    return sorted(names)


def resolves(root: str, name: str) -> bool:
    """Whether ``module`` or ``module:attr.path`` exists in the tree's source."""
    from drama3_patches.tools import fingerprint

    module, _, attr = name.partition(":")
    if not attr:
        return fingerprint.module_file(root, module) is not None
    first, _, rest = attr.partition(".")
    if not rest and fingerprint.module_file(root, f"{module}.{first}"):  # `from package import submodule`
        return True
    return fingerprint.find(root, module, attr)[0] is not None


def _newest(versions: dict) -> tuple[str, str] | None:
    from packaging.version import InvalidVersion, Version

    def key(item):
        try:
            return Version(item[0])
        except InvalidVersion:
            return Version("0")

    return max(versions.items(), key=key) if versions else None


def guard(spec, versions: dict) -> tuple[bool, list[str]]:
    """Whether the patch's version guard takes the tree's versions, and what refuses."""
    refused = []
    for dist, specifier in spec.specifiers.items():
        version = versions.get(dist)
        if version is None:
            refused.append(f"{dist} not in the tree")
        elif not specifier.contains(version, prereleases=True):
            refused.append(f"{dist} {version} outside {spec.requires[dist]}")
    return not refused, refused


def drift(trees: list[str], manifest, versions: dict) -> dict:
    """The report, as data: one entry per patch. Each package is read from the first of ``trees``
    that holds it."""
    from drama3_patches.tools import fingerprint

    roots = package_roots(trees)
    held = {PACKAGES[pkg] for pkg in roots}
    patches = []
    for spec in manifest.patches:
        targets = []
        for target in spec.targets:
            dist = PACKAGES.get(target.module.split(".")[0])
            row = {"target": target.spec, "dist": dist}
            recorded = spec.reviewed_source.get(target.spec, {})
            if dist is None or dist not in held:
                row["state"] = "not in this tree"
                targets.append(row)
                continue
            got, where = fingerprint.of_target(roots[target.module.split(".")[0]], target.spec)
            row["resolves"] = got is not None
            row["fingerprint"] = got
            newest = _newest(recorded)
            same = [v for v, h in recorded.items() if h == got]
            if got is None:
                row["state"] = where  # 'module absent' / 'name absent'
            elif newest is None:
                row["state"] = "no fingerprint recorded"
            elif same:
                row["state"] = f"unchanged: as reviewed on {dist} {', '.join(sorted(same))}"
            else:
                row["state"] = f"changed since {dist} {newest[0]}"
            if newest is not None:
                row["reviewed"] = dict(recorded)
            targets.append(row)
        own = {t.spec for t in spec.targets}
        read_rows = []
        for name in reads(spec.implementation, also=tuple(t.module for t in spec.targets)):
            if name in own:
                continue
            pkg = name.split(".")[0].split(":")[0]
            state = "not in this tree" if pkg not in roots else ("exists" if resolves(roots[pkg], name) else "absent")
            if state == "absent" and name in PROBES:
                state = "absent, looked up by feature"
            read_rows.append({"name": name, "state": state})
        takes, refused = guard(spec, versions)
        in_tree = [t for t in targets if t["state"] != "not in this tree"]
        moved = [t for t in in_tree if not t["state"].startswith(("unchanged", "no fingerprint"))]
        missing = [r for r in read_rows if r["state"] == "absent"]
        # "unchanged" speaks of targets: a patch none of whose targets is in the tree is "not in this
        # tree" even where the names it reads around them are (an absent one still makes it affected)
        verdict = "affected" if moved or missing else ("unchanged" if in_tree else "not in this tree")
        patches.append({"id": spec.id, "verdict": verdict, "targets": targets, "reads": read_rows,
                        "guard": {"takes": takes, "refused": refused}})
    return {"tree": {"versions": versions, "packages": sorted(held)}, "patches": patches}


def markdown(report: dict) -> str:
    versions = ", ".join(f"{d} {v}" for d, v in sorted(report["tree"]["versions"].items())) or "unknown"
    counts = {}
    for p in report["patches"]:
        counts[p["verdict"]] = counts.get(p["verdict"], 0) + 1
    lines = [f"# Drift against {versions}", "",
             "Per patch: each target (resolves? its source fingerprint against those recorded for the reviewed "
             "versions), the names the patch reads around it, and whether the version guard takes it. "
             "The manifest is not edited.", "",
             "Summary: " + ", ".join(f"{n} {v}" for v, n in sorted(counts.items())) + ".", "",
             "| patch | verdict | guard takes it |", "| --- | --- | --- |"]
    for p in report["patches"]:
        g = p["guard"]
        lines.append(f"| `{p['id']}` | {p['verdict']} | {'yes' if g['takes'] else 'no: ' + '; '.join(g['refused'])} |")
    for p in report["patches"]:
        lines += ["", f"## `{p['id']}`: {p['verdict']}", ""]
        for t in p["targets"]:
            fp = f" (fingerprint {t['fingerprint']})" if t.get("fingerprint") else ""
            lines.append(f"- target `{t['target']}`: {t['state']}{fp}")
        absent = [r["name"] for r in p["reads"] if r["state"] == "absent"]
        present = [r for r in p["reads"] if r["state"] == "exists"]
        if absent:
            lines.append("- reads, absent: " + ", ".join(f"`{n}`" for n in absent))
        if present:
            lines.append(f"- reads, present: {len(present)}")
        probes = [r["name"] for r in p["reads"] if r["state"] == "absent, looked up by feature"]
        if probes:
            lines.append("- reads, absent but looked up by feature (absent at review too): "
                         + ", ".join(f"`{n}`" for n in probes))
    return "\n".join(lines) + "\n"


def write(report: dict, out: Path) -> None:
    """``report.json`` and ``report.md`` in ``out``, each replaced whole."""
    from drama3_patches.tools.files import InputError

    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise InputError(f"--out {out} is not a folder; give another")
    out.mkdir(parents=True, exist_ok=True)
    for name, text in (("report.json", json.dumps(report, indent=2) + "\n"), ("report.md", markdown(report))):
        tmp = out / f".{name}.tmp"
        tmp.write_text(text)
        os.replace(tmp, out / name)


def run(args) -> int:
    from drama3_patches.tools import fingerprint
    from drama3_patches.manifest import ManifestError, load_manifest
    from drama3_patches.tools.files import InputError

    trees = args.tree or [root for root in [fingerprint.root_of("vllm")] if root]
    if "vllm" not in package_roots(trees):
        raise InputError(f"no vllm package in {', '.join(trees) or 'this environment'}; "
                         "give --tree DIR (the folder holding vllm/)")
    versions = versions_of(trees)
    for item in args.version:
        dist, sep, version = item.partition("=")
        if not sep or not dist or not version:
            raise InputError(f"--version {item!r}: give DIST=VERSION, e.g. vllm=0.34.0")
        versions[dist] = version
    try:
        manifest = load_manifest()
    except ManifestError as exc:
        raise InputError(str(exc)) from None
    report = drift(trees, manifest, versions)
    write(report, Path(args.out))
    affected = [p["id"] for p in report["patches"] if p["verdict"] == "affected"]
    print(f"drift against {', '.join(f'{d} {v}' for d, v in sorted(versions.items())) or ', '.join(trees)}: "
          f"{len(affected)} patch(es) affected{': ' + ', '.join(affected) if affected else ''}; "
          f"report in {args.out}/report.md")
    return 0

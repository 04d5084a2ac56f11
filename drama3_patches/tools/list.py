"""``drama3-patches list``: the manifest, for reviewers and operators."""

from __future__ import annotations

import sys


def register(sub) -> None:
    p = sub.add_parser("list", help="list the patches of the manifest")
    p.add_argument("--verbose", "-v", action="store_true", help="add why / how / upstream / remove-when")
    p.set_defaults(func=run)


def run(args) -> int:
    from drama3_patches.manifest import ManifestError, load_manifest
    from drama3_patches.tools.report import field_lines

    try:
        manifest = load_manifest()
    except ManifestError as exc:
        print(f"drama3-patches: {exc}", file=sys.stderr)
        return 1
    print(f"{len(manifest.patches)} patches in {manifest.path}\n")
    for p in manifest.patches:
        req = ", ".join(f"{d}{s}" for d, s in p.requires.items()) or "no version guard"
        print(f"{p.id}: {p.summary}")
        print(f"    platforms: {', '.join(p.platforms)}; requires: {req}")
        for t in p.targets:
            print(f"    target: {t.spec}")
        if args.verbose:
            for label, text in (("why", p.why), ("how", p.how), ("upstream", p.upstream),
                                ("remove when", p.remove_when)):
                print(field_lines(label, text))
        print()
    return 0

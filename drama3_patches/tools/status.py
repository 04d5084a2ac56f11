"""``drama3-patches status``: one row per patch, or the collected per-process reports."""

from __future__ import annotations

import json
import sys


def register(sub) -> None:
    p = sub.add_parser("status", help="show each patch's state in this process (or collected reports)")
    p.add_argument("--json", action="store_true", help="print the status as JSON")
    p.add_argument(
        "--import-targets", action="store_true",
        help="import every target module first, so the patches that apply here apply",
    )
    p.add_argument(
        "--collect", metavar="DIR",
        help="aggregate the <pid>.json files that DRAMA3_PATCHES_REPORT_DIR made processes write",
    )
    p.set_defaults(func=run)


def _collect(args) -> int:
    from drama3_patches.tools.report import collect, render_collected

    try:
        collected = collect(args.collect)
    except OSError as exc:
        print(f"drama3-patches: cannot read report directory {args.collect}: {exc.strerror or exc}",
              file=sys.stderr)
        return 2
    for path, why in collected.skipped:
        print(f"drama3-patches: skipping report {path}: {why}", file=sys.stderr)
    if args.json:
        print(json.dumps({
            "processes": collected.processes,
            "skipped": [{"file": f, "reason": r} for f, r in collected.skipped],
        }, indent=1))
    else:
        print(render_collected(collected, args.collect))
    failed = any(p["state"] == "failed" for proc in collected.processes for p in proc["patches"])
    return 1 if failed else 0


def run(args) -> int:
    if args.collect:
        return _collect(args)
    from drama3_patches.engine import PatchError, get_engine
    from drama3_patches.manifest import ManifestError
    from drama3_patches.tools.report import render_status

    engine = get_engine()
    try:
        if args.import_targets:
            engine.import_targets()
        data = engine.status()
    except ManifestError as exc:
        print(f"drama3-patches: {exc}", file=sys.stderr)
        return 1
    except PatchError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    print(json.dumps(data, indent=1) if args.json else render_status(data))
    return 1 if any(p["state"] == "failed" for p in data["patches"]) else 0

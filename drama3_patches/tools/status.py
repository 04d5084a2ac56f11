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
        help="aggregate the <host>-<pid>.json files that DRAMA3_PATCHES_REPORT_DIR made processes write, "
             "grouped by host (only regular files owned by you or root; see --trust)",
    )
    p.add_argument(
        "--trust", metavar="USER", action="append", default=[],
        help="with --collect: also show reports owned by USER (a name or uid), e.g. the account the "
             "servers run as; reports of any other owner are skipped as possibly planted",
    )
    p.set_defaults(func=run)


def _uid(user: str) -> int:
    from drama3_patches.tools.files import InputError

    if user.isdigit():
        return int(user)
    try:
        import pwd

        return pwd.getpwnam(user).pw_uid
    except (ImportError, KeyError):
        raise InputError(f"--trust {user!r}: no such user") from None


def _collect(args) -> int:
    from drama3_patches.tools.files import printable
    from drama3_patches.tools.report import collect, render_collected

    trust = tuple(_uid(u) for u in args.trust)
    try:
        collected = collect(args.collect, trust)
    except OSError as exc:
        print(f"drama3-patches: cannot read report directory {printable(args.collect)}: {exc.strerror or exc}",
              file=sys.stderr)
        return 2
    for note in collected.notes:
        print(f"drama3-patches: {printable(args.collect)}: {printable(note)}", file=sys.stderr)
    for path, why in collected.skipped:
        print(f"drama3-patches: skipping report {printable(path)}: {printable(why)}", file=sys.stderr)
    if args.json:
        print(json.dumps({
            "processes": collected.processes,
            "skipped": [{"file": f, "reason": r} for f, r in collected.skipped],
        }, indent=1))
    else:
        print(render_collected(collected, args.collect))
    failed = any(p["state"] == "failed" for proc in collected.processes for p in proc["patches"])
    return 1 if failed else 0


def _mark_review_changes(data: dict) -> None:
    """Each applying patch whose target's installed source differs from the reviewed fingerprints
    gets ``changed_since_review`` (the targets; unchanged targets say nothing). Never fails status:
    a manifest or source that cannot be read marks nothing."""
    from drama3_patches.manifest import ManifestError, load_manifest
    from drama3_patches.tools.fingerprint import review_changes

    try:
        changes = review_changes(load_manifest(), data)
    except (ManifestError, OSError, SyntaxError, ValueError):
        return
    for p in data["patches"]:
        if p["id"] in changes:
            p["changed_since_review"] = changes[p["id"]]


def run(args) -> int:
    if args.collect:
        return _collect(args)
    if args.trust:
        print("drama3-patches status: --trust goes with --collect DIR", file=sys.stderr)
        return 2
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
    _mark_review_changes(data)
    print(json.dumps(data, indent=1) if args.json else render_status(data))
    return 1 if any(p["state"] == "failed" for p in data["patches"]) else 0

"""``drama3-patches frame-time TRACE``: where stage 0's decode step goes, from a saved trace.

Reads any trace vLLM's torch profiler writes (``*.pt.trace.json[.gz]`` after ``/start_profile``
and ``/stop_profile``, vLLM-Omni's ``trace_rank0.json.gz``) or torch-npu's ``trace_view.json``,
and prints the per-frame table ``validate`` puts in its report, from the same code
(:mod:`drama3_patches.tools.validate.profile`). Exit 1 when the table has problems (a component
that must run at stage 0 with no record, a sampler call nested in another component).
"""

from __future__ import annotations

import argparse
import json
import sys
import zlib
from pathlib import Path


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError("--steps must be at least 1")
    return value


def register(sub) -> None:
    p = sub.add_parser("frame-time", help="the per-frame table (backbone, tower, sampler, the rest) of a saved "
                                          "vLLM or torch-npu profiler trace")
    p.add_argument("trace", metavar="TRACE", help="a trace file: *.pt.trace.json[.gz], trace_rank0.json.gz, "
                                                  "trace_view.json")
    p.add_argument("--json", action="store_true", help="print the figures as JSON (report.json's frame_time)")
    p.add_argument("--steps", type=_positive, metavar="N", help="read the first N decode steps only (default all)")
    p.set_defaults(func=run)


def run(args) -> int:
    from drama3_patches.tools.files import InputError
    from drama3_patches.tools.validate import profile

    path = Path(args.trace)
    try:
        ft = profile.read(path, limit=args.steps)
    except (profile.ProfileError, ValueError, EOFError, OSError, zlib.error) as exc:
        raise InputError(f"{path}: {exc}") from None
    if args.json:
        json.dump(ft, sys.stdout, indent=1)
        print()
    else:
        print("\n".join(profile.table(ft)) + f"\nTrace: `{path}`")
    return 1 if ft["problems"] else 0

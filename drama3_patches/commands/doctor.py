"""``drama3-patches doctor``: is this host ready to serve Drama 3 on NPUs? Exit 0 only when it is."""

from __future__ import annotations

import sys


def register(sub) -> None:
    p = sub.add_parser("doctor", help="check versions, activation hooks and NPUs; print a fix for each problem")
    p.set_defaults(func=run)


def run(args) -> int:
    from drama3_patches import doctor

    print(f"drama3-patches doctor: {sys.executable}")
    return doctor.report(doctor.run_checks(), sys.stdout)

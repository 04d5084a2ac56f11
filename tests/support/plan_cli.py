"""``drama3-patches plan`` run in the test's own process (FishOmniConfig is imported once per test
process): (exit status, the output parsed when ``--json`` was asked and the run was not a usage
error, else its text, stderr)."""

from __future__ import annotations

import argparse
import contextlib
import io
import json

from drama3_patches.tools import plan as plan_cmd


def plan_here(ckpt, *args):
    parser = argparse.ArgumentParser()
    plan_cmd.register(parser.add_subparsers())
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        parsed = parser.parse_args(["plan", str(ckpt), *args])
        rc = parsed.func(parsed)
    text = out.getvalue()
    return rc, (json.loads(text) if "--json" in args and rc != 2 else text), err.getvalue()

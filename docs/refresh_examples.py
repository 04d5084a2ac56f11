"""Refresh docs/recipe.md's examples from real runs: ``nox -s docs``, or

    python docs/refresh_examples.py [--validate-out validate-out] [--only doctor,plan,validate-report]

with an interpreter that has the tested pair installed (vLLM 0.32.0 and vLLM-Omni 0.32.0rc1: the
environment ``nox -s validate`` builds). Each example sits between ``<!-- example:NAME -->`` and
``<!-- /example -->`` and is replaced whole:

- ``doctor``: ``drama3-patches doctor`` on this host, with DRAMA3_PATCHES=1;
- ``plan``: ``drama3-patches plan DIR ...`` (the command line written above the example) on a
  checkpoint of the published class's shape, written by ``tests/support/checkpoints.py``;
- ``validate-report``: the ``report.md`` that ``nox -s validate`` left in ``validate-out/`` (the
  rehearsal takes minutes, so it is read, not rerun).

Paths of this host never reach the page: the report's folder becomes its path relative to the
repository, the interpreter's prefix ``<venv>``; any other path of this host left is an error.
tests/tools/test_docs.py checks the examples against the code.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "docs" / "recipe.md"
NAMES = ("doctor", "plan", "validate-report")


def child_env(**extra: str) -> dict:
    """This repository's package first on the path (the start-up line imports it, not another
    install's), no DRAMA3_* or device selection of the calling shell."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("DRAMA3_") and k not in ("ASCEND_RT_VISIBLE_DEVICES", "VLLM_PLUGINS")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def run(argv: list, ok=(0,), **kw) -> str:
    proc = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=900, **kw)
    if proc.returncode not in ok:
        sys.exit(f"refresh_examples: {shlex.join(map(str, argv))} exited {proc.returncode}:\n{proc.stderr}")
    return proc.stdout


def private_paths(**shown: str) -> dict[str, str]:
    """This host's paths (the repository, the interpreter's prefix, and ``shown``'s) and what the
    page shows instead, longest first so that a path inside another is replaced whole."""
    subs = {str(ROOT): ".", sys.prefix: "<venv>", **shown}
    return dict(sorted(subs.items(), key=lambda kv: -len(kv[0])))


def scrub(text: str, subs: dict[str, str]) -> str:
    for path, shown in subs.items():
        text = text.replace(path, shown)
    for path in (str(Path.home()), tempfile.gettempdir(), os.path.realpath(tempfile.gettempdir())):
        if path not in ("/", "") and re.search(re.escape(path) + r"/", text):
            sys.exit(f"refresh_examples: a path of this host ({path}/...) is left in the example:\n{text}")
    return text


def doctor() -> str:
    out = run([sys.executable, "-m", "drama3_patches.tools", "doctor"], ok=(0, 1),
              env=child_env(DRAMA3_PATCHES="1"), cwd=ROOT)
    return scrub(out, private_paths())


def plan_argv(recipe: str) -> list[str] | None:
    """The recipe's ``drama3-patches plan DIR ...`` command line (its arguments from ``plan`` on,
    a trailing comment left out), whose output is the plan example; None when there is none.
    tests/tools/test_docs.py runs the same line."""
    found = re.search(r"^ +drama3-patches (plan DIR [^\n#]*)", recipe, re.M)
    return shlex.split(found.group(1)) if found else None


def plan(recipe: str) -> str:
    argv = plan_argv(recipe)
    if argv is None:
        sys.exit("refresh_examples: docs/recipe.md has no `drama3-patches plan DIR ...` line for the example")
    with tempfile.TemporaryDirectory() as tmp:
        # DIR itself, so the output names the checkpoint as the command line does
        run([sys.executable, ROOT / "tests" / "support" / "checkpoints.py", Path(tmp) / "DIR"],
            env=child_env(), cwd=ROOT)
        out = run([sys.executable, "-m", "drama3_patches.tools", *argv, "--quiet"], ok=(0, 1), env=child_env(),
                  cwd=tmp)
        return scrub(out, private_paths(**{tmp: "."}))


def validate_report(out_dir: Path) -> str:
    report = out_dir / "report.md"
    if not report.is_file():
        sys.exit(f"refresh_examples: no {report}: run `nox -s validate` first (or pass --validate-out DIR)")
    text = report.read_text(encoding="utf-8")
    where = out_dir.resolve()
    shown = os.path.relpath(where, ROOT) if where.is_relative_to(ROOT) else "validate-out"
    return scrub(text, private_paths(**{str(where): shown}))


def replace(page: str, name: str, body: str) -> str:
    block = re.compile(rf"(<!-- example:{re.escape(name)} -->\n).*?(<!-- /example -->)", re.S)
    if not block.search(page):
        sys.exit(f"refresh_examples: docs/recipe.md has no <!-- example:{name} --> ... <!-- /example --> block")
    indented = "\n".join(("    " + ln).rstrip() for ln in body.rstrip("\n").splitlines())
    return block.sub(lambda m: f"{m.group(1)}\n{indented}\n\n{m.group(2)}", page, count=1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--validate-out", type=Path, default=ROOT / "validate-out",
                        help="the folder `nox -s validate` wrote (default validate-out/)")
    parser.add_argument("--only", default=",".join(NAMES), help=f"which examples (default {','.join(NAMES)})")
    args = parser.parse_args(argv)
    only = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = sorted(set(only) - set(NAMES))
    if unknown:
        parser.error(f"unknown example(s) {', '.join(unknown)}; known: {', '.join(NAMES)}")
    page = RECIPE.read_text(encoding="utf-8")
    before = page
    for name in only:
        print(f"refreshing example {name} ...", file=sys.stderr)
        body = {"doctor": doctor, "plan": lambda: plan(page),
                "validate-report": lambda: validate_report(args.validate_out)}[name]()
        page = replace(page, name, body)
    if page != before:
        RECIPE.write_text(page, encoding="utf-8")
    print(f"docs/recipe.md: {'updated' if page != before else 'unchanged'} ({', '.join(only)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

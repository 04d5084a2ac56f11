"""README.md and docs/*.md against the code they describe: what an operator copies or relies on
is checked here, each list derived from the code so that it follows the code.

- every ``drama3-patches ...`` line (code blocks and inline code) parses with the real parser;
- every test, benchmark and package path cited exists, and a cited ``file::test`` holds that test;
- the README's patch table lists exactly the manifest's ids; the states and ``DRAMA3_PATCHES*``
  variables of README and design.md are the engine's states and the variables the package reads,
  with the values the code accepts;
- the modules the docs say start-up imports (between ``<!-- start-up imports -->`` markers) are
  imported by the ``.pth`` line, and nothing heavy is;
- ``status --json``'s shape in design.md has the keys the command prints;
- recipe.md's examples (between ``<!-- example:NAME -->`` markers, refreshed by
  ``docs/refresh_examples.py``): the validate report has the rows, tables and notes the code
  writes; the doctor example's patch list is the manifest's; the plan example has every line
  ``plan`` prints;
- no path of the machine the docs were written on, and no indented block that renders as text.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib.util
import io
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

from drama3_patches.engine.state import STATES
from drama3_patches.tools import build_parser
from support.subproc import ROOT, child_env, run_cli

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PACKAGE = ROOT / "drama3_patches"
EXAMPLE = re.compile(r"<!-- example:([\w-]+) -->\n(.*?)<!-- /example -->", re.S)
STARTUP = re.compile(r"<!-- start-up imports -->\n(.*?)<!-- /start-up imports -->", re.S)


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _outside_examples(text: str) -> str:
    """The text with the examples (program output, not commands) blanked, line numbers kept."""
    return EXAMPLE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def _example(name: str) -> str:
    """An example block of docs/recipe.md, its code indentation removed."""
    found = {m.group(1): m.group(2) for m in EXAMPLE.finditer(_text(ROOT / "docs" / "recipe.md"))}
    assert name in found, f"docs/recipe.md has no <!-- example:{name} --> block"
    lines = found[name].strip("\n").splitlines()
    return "\n".join(ln[4:] if ln.startswith("    ") else ln for ln in lines) + "\n"


def _section(text: str, heading: str) -> str:
    start = text.index(heading)
    end = text.find("\n#", start + len(heading))
    return text[start:end if end >= 0 else len(text)]


def _table_first_cells(text: str) -> list[str]:
    """The first column of the first table in ``text``, header left out."""
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("| "))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return [_cells(row)[0] for row in lines[start:end] if not row.startswith("| ---")][1:]


def _cells(row: str) -> list[str]:
    """A table row's cells (a pipe escaped as \\| stays in its cell)."""
    return [c.strip() for c in re.split(r"(?<!\\)\|", row)[1:-1]]


def _ticked(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", text)


# -- command lines -----------------------------------------------------------------------------


def command_lines() -> list[tuple[str, str, bool]]:
    """(where, command, inline) for each ``drama3-patches`` command in code blocks and inline code."""
    found = []
    for doc in DOCS:
        lines = _outside_examples(_text(doc)).splitlines()
        i = 0
        while i < len(lines):
            line, where = lines[i], f"{_rel(doc)}:{i + 1}"
            while line.endswith("\\") and i + 1 < len(lines):  # a command continued on the next line
                i += 1
                line = line[:-1] + " " + lines[i].strip()
            i += 1
            if line.startswith("    "):
                for part in re.split(r"&&|;|\|\|", line.split(" #")[0]):
                    if part.strip().startswith("drama3-patches "):
                        found.append((where, part.strip(), False))
            else:
                found += [(where, span, True) for span in _ticked(line) if span.startswith("drama3-patches ")]
    return found


def _subparsers(parser: argparse.ArgumentParser) -> dict:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return action.choices


def _parses(argv: list[str]) -> str | None:
    """None when the real parser takes ``argv``, else its error."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            build_parser().parse_args(argv)
    except SystemExit as exc:
        return f"exit {exc.code}: {err.getvalue().strip()}"
    return None


def _check_command(line: str, subs: dict, inline: bool = False) -> str | None:
    words = shlex.split(line)[1:]
    if not words:
        return "no subcommand"
    if words[0] not in subs:
        return f"no subcommand {words[0]!r} (known: {', '.join(subs)})"
    sub = subs[words[0]]
    options = sub._option_string_actions
    if len(words) == 1 and inline:
        return None  # the command named, in prose
    if any(ch in line for ch in "[]|") or "..." in words:
        # a synopsis (README's "Command line", design.md): every option it names exists
        names = [p for w in words for p in w.strip("[]").split("|") if p.startswith("-")]
        missing = [n for n in names if n not in options]
        return f"unknown option(s) {missing}" if missing else None
    argv = list(words)
    for k in range(1, len(argv) - 1):  # a placeholder (N, GIB) for a number: any number
        action = options.get(argv[k])
        if action is not None and action.type in (int, float) and re.fullmatch(r"[A-Z][A-Z_]*", argv[k + 1]):
            argv[k + 1] = "1"
    return _parses(argv)


def test_every_command_line_in_the_docs_parses():
    lines = command_lines()
    subs = _subparsers(build_parser())
    bad = [f"{where}: {line}: {why}" for where, line, inline in lines if (why := _check_command(line, subs, inline))]
    assert not bad, "\n".join(bad)
    # the docs show every subcommand somewhere
    shown = {shlex.split(line)[1] for _, line, _ in lines}
    assert shown == set(subs), sorted(set(subs) - shown)


def test_the_command_check_refuses_a_line_the_parser_refuses():
    subs = _subparsers(build_parser())
    assert _check_command("drama3-patches plan DIR --card 910b1 --tp 1", subs) is None
    assert "--tpp" in _check_command("drama3-patches plan DIR --tpp 1", subs)
    assert "unknown option" in _check_command("drama3-patches list [--verbos]", subs)
    assert "no subcommand" in _check_command("drama3-patches lst", subs)
    assert _check_command("drama3-patches tiny-model", subs, inline=True) is None  # named in prose
    assert "required" in _check_command("drama3-patches tiny-model", subs)  # a command line: DIR missing


# -- cited paths -------------------------------------------------------------------------------

CITED = re.compile(r"(?<![\w./-])((?:tests|benchmarks|drama3_patches|docs)/[\w./-]*[\w/])(?:::(\w+))?")


def _defined(path: Path) -> set[str]:
    tree = ast.parse(_text(path))
    return {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}


def test_every_cited_path_exists_and_holds_the_named_test():
    bad, tests_cited = [], 0
    for doc in DOCS:
        for n, line in enumerate(_text(doc).splitlines(), 1):
            for path, name in CITED.findall(line):
                target = ROOT / path
                if "<" in path or "*" in path:
                    continue
                if not target.exists():
                    bad.append(f"{_rel(doc)}:{n}: {path} does not exist")
                elif name:
                    tests_cited += 1
                    if name not in _defined(target):
                        bad.append(f"{_rel(doc)}:{n}: {path} has no {name}")
    assert not bad, "\n".join(bad)
    assert tests_cited >= 20  # the known-limits list cites its tests by name


# -- patches, states, variables ----------------------------------------------------------------


def _manifest_ids() -> list[str]:
    return [p["id"] for p in yaml.safe_load(_text(ROOT / "patches_manifest.yaml"))["patches"]]


def test_the_readme_patch_table_lists_exactly_the_manifest_ids():
    table = _table_first_cells(_section(_text(ROOT / "README.md"), "## The patches"))
    assert [cell.strip("`") for cell in table] == _manifest_ids()


def test_the_states_the_docs_list_are_the_engines():
    readme = _text(ROOT / "README.md")
    sentence = re.search(r"States: (.*?)\.\s", readme, re.S)
    assert sentence, "README.md: no 'States: ...' sentence"
    assert {t for t in _ticked(sentence.group(1)) if " " not in t} == set(STATES)
    design = _section(_text(ROOT / "docs" / "design.md"), "States:")
    assert [c.strip("`") for c in _table_first_cells(design)] == list(STATES)


def _string_constants(path: Path):
    for node in ast.walk(ast.parse(_text(path))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.value


def package_variables() -> set[str]:
    """Every DRAMA3_PATCHES* name the package spells out (each is read from os.environ)."""
    return {s for p in PACKAGE.rglob("*.py") for s in _string_constants(p)
            if re.fullmatch(r"DRAMA3_PATCHES(_[A-Z0-9]+)*", s)}


def _variable_rows(text: str) -> dict[str, str]:
    """{variable: its spelled values} of an environment table's first column."""
    rows = {}
    for cell in _table_first_cells(text):
        for ticked in _ticked(cell):
            name, _, values = ticked.partition("=")
            rows[name] = values
    return rows


def _literal(path: Path, name: str):
    for node in ast.parse(_text(path)).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"{_rel(path)} defines no {name}")


def test_the_variables_the_docs_list_are_those_the_package_reads():
    from drama3_patches import env

    readme = _variable_rows(_section(_text(ROOT / "README.md"), "## Environment"))
    design = _variable_rows(_section(_text(ROOT / "docs" / "design.md"), "Environment variables:"))
    code = package_variables()
    assert set(readme) == code, (sorted(code - set(readme)), sorted(set(readme) - code))
    assert set(design) == code, (sorted(code - set(design)), sorted(set(design) - code))
    # the values the docs spell out are the ones the code accepts
    kernels = _literal(PACKAGE / "kernels" / "fp8.py", "KERNELS")
    for doc, rows in (("README.md", readme), ("docs/design.md", design)):
        for name, accepted in ((env.FAULT, env.FAULTS), (env.PLATFORM, env.PLATFORMS),
                               ("DRAMA3_PATCHES_FP8_KERNEL", kernels)):
            assert tuple(rows[name].split("\\|")) == tuple(accepted), (doc, name)


# -- start-up ----------------------------------------------------------------------------------


def _is_module(name: str) -> bool:
    path = ROOT / name.replace(".", "/")
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def startup_modules_named() -> dict[str, set[str]]:
    """{doc: modules of the package named between start-up markers} (``env`` is drama3_patches.env)."""
    named = {}
    for doc in DOCS:
        for span in STARTUP.findall(_text(doc)):
            for token in _ticked(span):
                name = token if token.split(".")[0] == "drama3_patches" else f"drama3_patches.{token}"
                if re.fullmatch(r"[\w.]+", token) and _is_module(name):
                    named.setdefault(_rel(doc), set()).add(name.removesuffix(".__init__"))
    return named


def startup_imports() -> set[str]:
    """What the ``.pth`` line imports with DRAMA3_PATCHES=1 (``-X importtime``), over a first start
    and a second one sharing the first's home and cache folders (any start-up cache then hits)."""
    line = _text(ROOT / "drama3_patches.pth").strip()
    seen = set()
    with tempfile.TemporaryDirectory() as home:
        env = child_env({"DRAMA3_PATCHES": "1", "HOME": home, "XDG_CACHE_HOME": os.path.join(home, "cache")})
        for _ in range(2):
            proc = subprocess.run([sys.executable, "-X", "importtime", "-c", line], env=env, capture_output=True,
                                  text=True, timeout=120, cwd=home)
            assert proc.returncode == 0, proc.stderr
            seen |= {ln.rsplit("|", 1)[1].strip() for ln in proc.stderr.splitlines() if ln.startswith("import time:")}
    return seen


def test_the_start_up_modules_the_docs_name_are_those_the_hook_imports():
    named = startup_modules_named()
    assert "README.md" in named, "README.md: no <!-- start-up imports --> block"
    imported = startup_imports()
    ours = {m for m in imported if m.split(".")[0] == "drama3_patches"}
    assert "drama3_patches._bootstrap" in ours  # the run measured the hook
    for doc, names in named.items():
        assert names <= ours, f"{doc} says start-up imports {sorted(names - ours)}; it imports {sorted(ours)}"
    # README, design.md, architecture.md: nothing heavy at start-up
    heavy = ("yaml", "wrapt", "packaging", "torch", "vllm", "drama3_patches.engine", "drama3_patches.manifest")
    loaded = sorted(m for m in imported for h in heavy if m == h or m.startswith(h + "."))
    assert not loaded


# -- status --json -----------------------------------------------------------------------------


def _shape_keys(shape: str) -> tuple[set[str], set[str]]:
    """Top-level keys and the keys of a ``patches`` entry in design.md's pseudo-JSON shape."""
    top, entry, depth, patches_at = set(), set(), 0, None
    for m in re.finditer(r'"(\w+)"|[{}\[\]]', shape):
        tok = m.group(0)
        if tok in "{[":
            depth += 1
        elif tok in "}]":
            depth -= 1
            if patches_at is not None and depth < patches_at:
                patches_at = None
        elif depth == 1:
            top.add(m.group(1))
            if m.group(1) == "patches":
                patches_at = 3  # inside [{ ... }]
        elif patches_at is not None and depth == patches_at:
            entry.add(m.group(1))
    return top, entry


def test_the_status_json_shape_in_design_has_the_keys_the_command_prints():
    design = _text(ROOT / "docs" / "design.md")
    shape = re.search(r"`status --json` shape: `(.*?)`\.", design, re.S)
    assert shape, "docs/design.md: no `status --json` shape"
    top, entry = _shape_keys(shape.group(1))
    proc = run_cli("status", "--json", timeout=120)
    status = json.loads(proc.stdout)
    assert top == set(status), (sorted(set(status) - top), sorted(top - set(status)))
    assert entry <= set(status["patches"][0]) and {"id", "state", "reason"} <= entry


# -- the examples ------------------------------------------------------------------------------


def _check_names() -> set[str]:
    """Every row name validate writes: the names its ``Check(...)`` calls are given."""
    names = set()
    for path in (PACKAGE / "tools" / "validate").glob("*.py"):
        for node in ast.walk(ast.parse(_text(path))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "Check" \
                    and node.args and isinstance(node.args[0], ast.Constant):
                names.add(node.args[0].value)
    return names


def _headers(markdown: str) -> list[str]:
    lines = markdown.splitlines()
    return [lines[i - 1] for i in range(1, len(lines)) if lines[i].startswith("| ---")]


def _rendered_report(check_names: set[str]) -> str:
    """report.md as the code writes it for a passing TP2 run with every row and a note."""
    from drama3_patches.tools.validate import deploy, verdict

    run = verdict.Run(profile="PROFILE", model="MODEL", tp=2, ep=False, compiled=False,
                      scale=deploy.Scale(kv_blocks=1, max_model_len=1, frames=1))
    run.notes, run.versions = ["NOTE"], dict.fromkeys(verdict.VERSIONED, "0")
    for name in check_names:
        run.checks[name.split(".")[0]] = verdict.Check(name, True, "detail")
    # the rehearsal profiles its per-frame time (attributed) and stops its server
    from drama3_patches.tools.validate import profile

    comps = dict.fromkeys(profile.COMPONENTS, 1.0)
    run.frame_time = {"steps": 2, "rank": "0", "steps_from": "S", "step_ms": {"p50": 5.0, "p90": 5.0, "mean": 5.0},
                      "components_ms": comps, "unattributed_ms": 0.0, "rules": dict.fromkeys(profile.MUST_RUN, "R"),
                      "problems": [], "trace": "T", "window_s": 1,
                      "top_ops": [{"name": "op", "ms_per_step": 1.0, "share": 0.2}]}
    run.stopped = {"terminated": 1, "killed": 0, "left": []}
    return run.markdown()


def _stem(line: str) -> str:
    """A line's fixed start: up to its first figure, quoted name or placeholder."""
    return re.split(r"(?<![A-Za-z])[0-9]|`|PROFILE|MODEL|NOTE", line, maxsplit=1)[0]


def _string_starts(paths) -> list[str]:
    """The literal start of every string (and f-string) in ``paths``."""
    starts = []
    for path in paths:
        for node in ast.walk(ast.parse(_text(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                starts.append(node.value)
            elif isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
                starts.append(node.values[0].value)
    return [s for s in starts if len(s) >= 12]


def test_the_example_validate_report_has_the_rows_tables_and_notes_the_code_writes():
    example = _example("validate-report")
    names = _check_names()
    code = _rendered_report(names)
    assert _headers(example) == _headers(code)
    checks_block = example.split("| check | result |", 1)[1].split("\n\n", 1)[0]  # the first table: the checks
    check_table = [_cells(ln) for ln in checks_block.splitlines() if ln.startswith("| ") and len(_cells(ln)) == 4][1:]
    assert {cells[0] for cells in check_table} == names
    assert all(cells[1] in ("pass", "**FAIL**", "n/a") for cells in check_table)
    for line in code.splitlines():
        if line and not line.startswith("|") and (stem := _stem(line)).strip(" -"):
            assert any(ln.startswith(stem) for ln in example.splitlines()), f"the example lacks {line!r}"
    notes = [ln[2:] for ln in example.split("Notes:\n", 1)[-1].splitlines() if ln.startswith("- ")]
    assert "Notes:" not in example or notes
    written = _string_starts([*(PACKAGE / "tools" / "validate").glob("*.py"), ROOT / "tests" / "e2e" / "rehearsal.py"])
    for note in notes:
        assert any(note.startswith(s) for s in written), f"no code writes the example's note {note!r}"


def test_the_example_doctor_output_lists_every_patch_of_the_manifest():
    example = _example("doctor")
    block = example.split("patches on npu", 1)[1].splitlines()[1:]
    rows = [ln.split() for ln in block if ln.startswith("  ") and not re.match(r"\s+\d+ of \d+", ln)]
    assert [r[0] for r in rows] == _manifest_ids()
    summary = re.search(r"(\d+) of (\d+) would apply", example)
    assert summary and int(summary.group(2)) == len(_manifest_ids())
    assert int(summary.group(1)) == sum(r[1] == "applies" for r in rows)


def _plan_stem(line: str) -> str:
    return re.match(r"\s*([A-Za-z_ (),.-]*)", line).group(1).strip()


def test_the_example_plan_output_has_every_line_plan_prints(tmp_path, capsys):
    from drama3_patches.tools import main
    from drama3_patches.tools.tiny_model import DRAMA3_CFG, write_fish_checkpoint

    write_fish_checkpoint(tmp_path / "DIR", DRAMA3_CFG, shards=4, sparse=True)
    spec = importlib.util.spec_from_file_location("refresh_examples_under_test", ROOT / "docs" / "refresh_examples.py")
    refresh = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(refresh)
    argv = refresh.plan_argv(_text(ROOT / "docs" / "recipe.md"))  # the line the example was made from
    assert argv, "docs/recipe.md: no `drama3-patches plan DIR ...` line above the example"
    argv[1] = str(tmp_path / "DIR")
    main([*argv, "--quiet"])
    printed = {_plan_stem(ln) for ln in capsys.readouterr().out.splitlines() if ln.strip()}
    shown = {_plan_stem(ln) for ln in _example("plan").splitlines() if ln.strip()}
    assert shown == printed, (sorted(printed - shown), sorted(shown - printed))


# -- the pages themselves ----------------------------------------------------------------------


def test_no_path_of_this_machine_is_in_the_docs():
    here = {str(ROOT), sys.prefix, os.path.expanduser("~"), tempfile.gettempdir() + "/pytest"}
    bad = [f"{_rel(doc)}: {p}" for doc in DOCS for p in here
           if p not in ("", "/") and re.search(r"(?<![\w./-])" + re.escape(p) + r"(?![\w.-])", _text(doc))]
    assert not bad


def test_every_indented_block_starts_as_a_code_block():
    # An indented line right after a paragraph line continues the paragraph: it renders as text.
    bad = []
    for doc in DOCS:
        lines = _text(doc).splitlines()
        for n in range(1, len(lines)):
            prev, line = lines[n - 1], lines[n]
            if line.startswith("    ") and prev.strip() and not prev.startswith((" ", "-", "*", "|", "#", "<!--")) \
                    and not re.match(r"\d+\. ", prev):
                bad.append(f"{_rel(doc)}:{n + 1}: {line.strip()[:60]}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_each_example_block_is_closed(doc):
    text = _text(doc)
    assert text.count("<!-- example:") == text.count("<!-- /example -->")
    assert text.count("<!-- start-up imports -->") == text.count("<!-- /start-up imports -->")

"""docs/validate-controls.md lists a negative control and its test for every row of validate and
every figure of its frame_time and playout: a row or figure without one, or a test named there
that does not exist, fails here. The rows and figures are read from the code, not from the page."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "validate-controls.md"
_TEST = re.compile(r"^`(tests/[\w/]+\.py)::(\w+)(?:\[([^\]]+)\])?`$")


def _rows() -> list[tuple[str, str, str, str]]:
    """(section, row or figure, control, test) of every table row on the page."""
    out, section = [], ""
    for line in PAGE.read_text().splitlines():
        if line.startswith("## "):
            section = line[3:].strip()
        elif line.startswith("| ") and not line.startswith("| ---"):
            cells = [c.strip() for c in line.strip("|").split(" | ")]
            if len(cells) == 3 and cells[0] not in ("row", "figure"):
                out.append((section, *cells))
    return out


def _figures() -> dict[str, set[str]]:
    from drama3_patches.tools.bench import playout
    from drama3_patches.tools.validate import profile

    tools = Path(__file__).resolve().parent
    import sys

    sys.path.insert(0, str(tools))
    try:
        import test_profile as traces
    finally:
        sys.path.remove(str(tools))
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        tr = traces.Trace()
        traces._steps(tr, n=3, t=0.0)
        ft = profile.read(tr.write(Path(tmp) / "t.pt.trace.json.gz"))
    frame = {k for k in ft if k not in ("components_ms", "frame_ms", "steps_from", "trace")}
    frame |= {f"components_ms.{k}" for k in ft["components_ms"]}
    request = playout.request_figures([(0.1, 0.1), (0.5, 0.1)], 0.1)
    level = playout.level_figures([request | {"audio_s": 0.2}])
    play = {f"request.{k}" for k in request} | {f"level.{k}" for k in level}
    return {"Rows": set("abcdefg"), "frame_time": frame, "playout": play}


def test_every_row_and_figure_has_a_control_listed():
    listed: dict[str, set[str]] = {}
    for section, what, control, _ in _rows():
        assert control, (section, what)
        listed.setdefault(section, set()).add(what)
    for section, wanted in _figures().items():
        missing = wanted - listed.get(section, set())
        assert not missing, f"{section}: no control listed in {PAGE.name} for {sorted(missing)}"
        unknown = listed.get(section, set()) - wanted
        assert not unknown, f"{section}: {PAGE.name} lists {sorted(unknown)}, which the code does not write"


def _defined(path: Path) -> set[str]:
    return {n.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.FunctionDef)}


@pytest.mark.parametrize("row", _rows(), ids=lambda r: f"{r[0]}:{r[1]}:{r[3][-40:]}")
def test_each_listed_test_exists(row):
    section, what, _, test = row
    m = _TEST.match(test)
    assert m, f"{section} {what}: {test!r} is not `tests/....py::function[id]`"
    path, func, case = ROOT / m.group(1), m.group(2), m.group(3)
    assert path.is_file(), f"{section} {what}: no file {m.group(1)}"
    assert func.startswith("test_") and func in _defined(path), f"{section} {what}: no test {func} in {m.group(1)}"
    if case is not None:  # a case of a parametrized test: its id is written in that file
        assert re.search(rf"[\"']{re.escape(case)}[\"']", path.read_text()), f"{section} {what}: no case {case!r}"

"""Python children the tools start never import from the folder they were started in: run as root
from a folder every user can write (``/tmp``-like, mode 1777), a module another user planted there
(``json.py``, ``argparse.py``) never runs.

The planter is a throwaway local user (``support.hostile``); run as root, skipped with the reason
elsewhere. Each planted module leaves a marker naming the uid it ran as.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from support.hostile import hostile_user  # noqa: F401 (a fixture)

PLANTED = ("json", "argparse", "runpy")
MARKER = 'import os; open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "ran-as-%d" % os.getuid()), "w")\n'
PACKAGE = Path(__file__).resolve().parents[2] / "drama3_patches"


def _plant(hostile) -> Path:
    for name in PLANTED:
        hostile.sh('printf %s "$1" > "$2"', MARKER, hostile.shared / f"{name}.py")
    return hostile.shared


def _doctor_status_child():
    from drama3_patches.tools import doctor

    return doctor.patch_status(timeout=120)


def _validate_facts_children():
    from drama3_patches.tools.validate import facts

    return facts.collect(timeout=60, doctor_timeout=120)


@pytest.mark.parametrize("caller", [_doctor_status_child, _validate_facts_children],
                         ids=["doctor's status child", "validate's facts children (probe, doctor)"])
def test_a_module_planted_in_the_working_folder_never_runs(hostile_user, monkeypatch, caller):
    shared = _plant(hostile_user)
    monkeypatch.chdir(shared)
    got = caller()
    assert sorted(p.name for p in shared.glob("ran-as-*")) == [], got
    # the children ran and answered: not a pass by a child that never started
    if caller is _doctor_status_child:
        assert "patches" in got, got
    else:
        assert isinstance(got["versions"], dict) and "exit" in got["doctor"], got


@pytest.mark.parametrize("safe_path_flag", [True, False], ids=["-P", "the 3.10 prologue"])
def test_the_helper_drops_the_working_folder_either_way(hostile_user, monkeypatch, safe_path_flag):
    from drama3_patches.tools import isolated_python

    shared = _plant(hostile_user)
    monkeypatch.chdir(shared)
    monkeypatch.setenv("PYTHONPATH", f"{isolated_python.__file__.rsplit('/drama3_patches/', 1)[0]}::.")
    for mode, what in (("-c", "import json, argparse; print(json.dumps([1]))"), ("-m", "json.tool")):
        done = isolated_python.run(mode, what, timeout=60, text=True, input="[1]",
                                   safe_path_flag=safe_path_flag)
        assert done.returncode == 0 and "1" in done.stdout, done.stderr
    assert sorted(p.name for p in shared.glob("ran-as-*")) == []
    # control: a plain child from the same folder runs the planted module
    import subprocess
    import sys

    subprocess.run([sys.executable, "-c", "import json"], capture_output=True, timeout=60)
    assert sorted(p.name for p in shared.glob("ran-as-*")) == ["ran-as-0"]


def test_no_python_child_is_started_outside_the_helper():
    """The package builds no ``[sys.executable, ...]`` command line but in ``isolated_python``."""
    pattern = r"\[\s*sys\.executable\b"
    assert re.search(pattern, (PACKAGE / "tools" / "isolated_python.py").read_text())  # the pattern finds one
    found = [f"{path.relative_to(PACKAGE)}:{n}" for path in PACKAGE.rglob("*.py") if path.name != "isolated_python.py"
             for n, line in enumerate(path.read_text().splitlines(), 1) if re.search(pattern, line)]
    assert found == []

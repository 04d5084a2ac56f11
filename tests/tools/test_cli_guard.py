"""The command line's last word on errors (``drama3_patches.tools.main``): bad input is one line and
exit 2; anything else is a bug, shown whole and said to be one (exit 70), never passed off as input."""

from __future__ import annotations

from support.subproc import call


def main_with_list_raising(kind: str) -> int:
    """Runs in a fresh interpreter: ``list``'s command replaced by one that raises."""
    from drama3_patches import tools
    from drama3_patches.tools import list as list_cmd
    from drama3_patches.tools.files import InputError

    def run(args):
        if kind == "input":
            raise InputError("settings.yaml: \x1b[2Jbad value")
        return {}["missing"]  # a real bug: KeyError

    list_cmd.run = run
    return tools.main(["list"])


def test_bad_input_is_one_line_exit_2():
    out = call(main_with_list_raising, "input", with_output=True)
    assert out["result"] == 2
    assert out["stderr"].splitlines() == ["drama3-patches list: settings.yaml: \\x1b[2Jbad value"]


def test_a_bug_is_shown_whole_and_called_one():
    out = call(main_with_list_raising, "bug", with_output=True)
    assert out["result"] == 70
    lines = out["stderr"].splitlines()
    assert lines[0] == "Traceback (most recent call last):" and "KeyError: 'missing'" in lines
    assert lines[-1].startswith("drama3-patches list: this is a bug in drama3-patches, not a problem with your "
                                "input; please report it")

"""Another local user's link at the report folder's name must not get root's report written through
it (issue 41, item 6).

The recipe used to suggest a folder in ``/tmp``; there anybody may plant ``drama3-status`` first,
as a link to a folder of root's. The writer's checks (owner, mode) then looked at the link's
target, which is root's own and private, and wrote the report into it.
"""

from __future__ import annotations

import os

from support.hostile import hostile_user  # noqa: F401 (a fixture)
from support.subproc import call


def write_one_report() -> int:
    """Runs in a fresh interpreter: the engine's own writer, once; this process's pid."""
    from drama3_patches.engine import get_engine, state

    state.write_report(get_engine())
    return os.getpid()


def test_a_planted_link_at_the_report_folder_is_refused_with_one_warning_naming_it(tmp_path, hostile_user):
    root_only = tmp_path / "root-only"
    root_only.mkdir(mode=0o700)
    planted = hostile_user.shared / "drama3-status"
    hostile_user.sh('ln -s "$1" "$2"', root_only, planted)
    got = call(write_one_report, env={"DRAMA3_PATCHES_REPORT_DIR": str(planted)}, with_output=True)
    assert sorted(os.listdir(root_only)) == [], "root's report was written through the planted link"
    warnings = [line for line in got["stderr"].splitlines() if "warning" in line]
    assert len(warnings) == 1 and str(planted) in warnings[0] and "symbolic link" in warnings[0], warnings
    # The link is left as it was: the writer neither followed nor replaced it.
    assert os.readlink(planted) == str(root_only)

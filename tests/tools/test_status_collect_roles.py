"""`drama3-patches status --collect DIR` on reports real processes wrote: each process shown with
its role, stage, rank and parent, and a report whose pid another process has since shown gone.
"""

from __future__ import annotations

import json
import os
import subprocess
import time

from support.exits import named_tree
from support.selftest import write_manifest, write_target
from support.subproc import call, run_cli

TREE = [("StageEngineCoreProc_stage0_replica0", [("VllmWorker-1", [], "fork")], "spawn")]


def test_collect_names_each_processs_role_and_calls_a_reused_pid_gone(tmp_path):
    from drama3_patches.engine.state import host_label
    from drama3_patches.report_dir import START_SLACK_S

    write_target(tmp_path)
    manifest = write_manifest(tmp_path, {"targets": ["d3p_target:greet"]})
    reports = tmp_path / "reports"
    got = call(named_tree, TREE, env={"DRAMA3_PATCHES": "1", "DRAMA3_PATCHES_MANIFEST": str(manifest),
                                      "DRAMA3_PATCHES_REPORT_DIR": str(reports)}, pythonpath=[tmp_path], timeout=120)
    by_name = {proc["name"]: int(pid) for pid, proc in got["reports"].items()}
    core, worker = by_name["StageEngineCoreProc_stage0_replica0"], by_name["VllmWorker-1"]
    # The worker's report, now naming a pid a process started since holds (its start is not the writer's).
    time.sleep(5 * START_SLACK_S)
    sleeper = subprocess.Popen(["sleep", "120"])
    try:
        here = host_label()
        data = json.loads((reports / f"{here}-{worker}.json").read_text())
        (reports / f"{here}-{sleeper.pid}.json").write_text(json.dumps(dict(data, pid=sleeper.pid)))
        os.chmod(reports / f"{here}-{sleeper.pid}.json", 0o600)
        r = run_cli("status", "--collect", str(reports), timeout=60)
    finally:
        sleeper.kill()
        sleeper.wait()
    assert r.returncode == 0, r.stderr
    assert f"(process: engine-core stage 0, ppid {got['me']}: " in r.stdout
    assert f"(process: worker rank 1, ppid {core}: " in r.stdout
    rows = {line.split()[0]: line for line in r.stdout.splitlines() if line.strip()[:1].isdigit()}
    assert "(gone)" in rows[str(sleeper.pid)], r.stdout  # running, but not the process that wrote it
    assert "4 process report(s)" in r.stdout

"""``drama3-patches validate``'s server lifecycle, with a fake ``vllm`` whose process group holds a
background child that ignores SIGINT, SIGTERM and SIGHUP (as a stuck worker would): however
validate ends -- SIGTERM, SIGHUP, Ctrl-C (twice), or a row failing because the leader exited at
once -- no process of the server remains, ``report.json`` is written and the exit code says how
it ended.

validate runs in a fresh interpreter (``support.subproc.call``) with its ``vllm`` command pointed
at the fake; the signals come from a thread of that process once the fake's child is up, as a
shell's Ctrl-C or a CI job's kill would reach it.
"""

from __future__ import annotations

import json
import os
import signal
import textwrap
import time
from pathlib import Path

import pytest

from support.replicas import needs_fish_omni
from support.subproc import call

# validate's host check wants vLLM and a vLLM-Omni with Drama 3 (0.32.0rc1), paired
pytestmark = [pytest.mark.vllm, needs_fish_omni]

FAKE_VLLM = """\
#!/bin/sh
# A stand-in for `vllm serve`: records its pid, starts a child that ignores the stop signals
# (background jobs ignore SIGINT too), then either exits at once or waits like a server.
echo $$ > "$FAKE_DIR/leader.pid"
( trap '' INT TERM HUP; exec sleep 300 ) &
echo $! > "$FAKE_DIR/child.pid"
if [ "$FAKE_MODE" = exit ]; then
    echo "(APIServer pid=$$) ERROR 12-04 [serve.py:1] ModuleNotFoundError: No module named 'vllm_ascend'"
    exit 1
fi
exec sleep 300
"""


def _alive(pid: int) -> bool:
    """Running, and not a zombie (an orphan's zombie waits for whoever reaps orphans here)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read().decode()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2:].split()[0] != "Z"


def run_validate(tmp: str, signals: list, stop_grace: float) -> dict:
    """The child: validate against the fake; ``signals`` (seconds after the fake's child is up,
    signal number) are sent to this process."""
    import threading

    from drama3_patches.tools import main
    from drama3_patches.tools.validate import server

    tmp_ = Path(tmp)
    server.vllm_command = lambda: str(tmp_ / "vllm")

    def send() -> None:
        deadline = time.monotonic() + 60
        while not (tmp_ / "child.pid").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        began = time.monotonic()
        for after, sig in signals:
            time.sleep(max(0.0, began + after - time.monotonic()))
            os.kill(os.getpid(), sig)

    threading.Thread(target=send, daemon=True).start()
    code = main(["validate", "--deploy", str(tmp_ / "deploy.yaml"), "--model", str(tmp_ / "model"),
                 "--out", str(tmp_ / "out"), "--start-timeout", "120", "--stop-grace", str(stop_grace)])
    return {"exit": code}


def _setup(tmp_path: Path) -> None:
    (tmp_path / "vllm").write_text(FAKE_VLLM)
    (tmp_path / "vllm").chmod(0o755)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "deploy.yaml").write_text(textwrap.dedent("""\
        stages:
          - stage_id: 0
            tensor_parallel_size: 2
            enforce_eager: true
          - stage_id: 1
        """))


CASES = {
    # name: (fake's mode, signals to validate, expected exit, how report.json says it ended)
    "sigterm": ("wait", [(1.0, signal.SIGTERM)], 128 + signal.SIGTERM, "interrupted by SIGTERM"),
    "sighup": ("wait", [(1.0, signal.SIGHUP)], 128 + signal.SIGHUP, "interrupted by SIGHUP"),
    # the second Ctrl-C lands while validate waits for the server's processes to end on TERM
    "ctrl-c twice": ("wait", [(1.0, signal.SIGINT), (3.5, signal.SIGINT)], 128 + signal.SIGINT,
                     "interrupted by SIGINT"),
    "row fails": ("exit", [], 1, "completed"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_no_process_of_the_server_outlives_validate_and_the_report_is_written(tmp_path, case):
    mode, signals, exit_code, ended = CASES[case]
    _setup(tmp_path)
    began = time.monotonic()
    result = call(run_validate, str(tmp_path), signals, 3.0, env={"FAKE_DIR": str(tmp_path), "FAKE_MODE": mode},
                  timeout=300)
    took = time.monotonic() - began
    leader = int((tmp_path / "leader.pid").read_text())
    child = int((tmp_path / "child.pid").read_text())
    assert not _alive(leader) and not _alive(child), (case, _alive(leader), _alive(child))
    assert result["exit"] == exit_code
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["ended"] == ended and not report["passed"]
    # the child ignores TERM: only the KILL after the grace ended it, a second Ctrl-C or not
    assert report["server_stop"]["killed"] >= 1 and report["server_stop"]["left"] == []
    checks = {c["name"][0]: c for c in report["checks"]}
    assert not checks["a"]["passed"]
    if case == "row fails":
        assert "exited with status 1 before it was ready" in checks["a"]["detail"]
        assert report["first_failed"] == "a. start-up"
        assert any("missing module" in line for line in report["diagnosis"]), report["diagnosis"]
    else:
        assert checks["a"]["detail"].startswith("not run: interrupted by SIG")
    assert (tmp_path / "out" / "report.md").read_text().startswith("## drama3-patches validate: FAILED")
    print(f"{case}: exit {result['exit']}, {took:.1f} s, stop {report['server_stop']}")

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


# -- stopping never waits on the server -------------------------------------------------------


@pytest.mark.forked
def test_a_signal_in_the_profile_window_stays_interrupted_and_leaves_the_stop_to_validate(tmp_path):
    """A SIGTERM while the profiled request streams: ``Interrupted`` leaves the window as it is (no
    ``/stop_profile`` inside it to wait on or fail); the stop validate posts afterwards waits a
    bounded time on a server that never answers it, and says why it did not answer."""
    import threading

    from support.speech_server import SpeechServer, wav_header

    from drama3_patches.tools.bench.speech import MetaLine
    from drama3_patches.tools.validate import Interrupted, Signals, profile

    ref = tmp_path / "ref.wav"
    ref.write_bytes(wav_header(16000)[:-4] + (4).to_bytes(4, "little") + b"\0" * 4)
    line = MetaLine("line0", "a", str(ref), "mode=trickle trickle=30")
    release = threading.Event()
    with SpeechServer() as server:
        server.on_stop_profile = lambda: release.wait(30)  # a server that never answers /stop_profile
        timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM))
        try:
            with Signals(lambda msg: None):
                timer.start()
                with pytest.raises(Interrupted) as caught:
                    profile.measure(server.url, line, tmp_path / "profile", steps=2, delay=3, timeout=60)
            assert caught.value.signum == signal.SIGTERM
            assert [r["path"] for r in server.requests] == ["/start_profile", "/v1/audio/speech"]
            why = profile.stop_after_signal(server.url, timeout=1)
            assert [r["path"] for r in server.requests][-1] == "/stop_profile"
            assert why is not None and why.startswith(f"POST {server.url}/stop_profile:"), why
        finally:
            timer.cancel()
            release.set()


def test_the_host_facts_stop_waiting_when_the_run_is_ending():
    """A fact whose child would run a minute is given up once the run ends (the stop is set);
    without the stop the same child is waited for."""
    import threading

    from drama3_patches.tools.validate import facts

    stop = threading.Event()
    threading.Timer(0.5, stop.set).start()
    got = facts._run(["/bin/sh", "-c", "echo $$; exec sleep 60"], 120, stop=stop)
    assert got == {"absent": "not gathered: the run was ending"}
    assert facts._run(["/bin/sh", "-c", "echo waited"], 120, stop=threading.Event()) == \
        {"exit": 0, "output": "waited\n"}
    assert facts.collect(stop=stop)["doctor"] == {"absent": "not gathered: the run was ending"}

"""The alert rules of docs/grafana fire on a real Prometheus, with no vLLM server.

Three processes each serve vLLM's real ``attach_router`` ``/metrics`` (patch metrics-endpoint,
through the ``.pth`` route) on a loopback port, one per report folder:

- ``failed``: the folder holds the report of a live process of the deployment in which a patch
  failed (the ``selftest`` patch, its target missing: drift);
- ``healthy``: the same process, the patch applied;
- ``broken``: the folder is a regular file, so every collection fails.

One Prometheus scrapes all three every second and evaluates a copy of the documented rules in
which only ``Drama3PatchFailed``'s ``for:`` is shortened. Each alert's transitions are read from
``/api/v1/alerts`` and printed with their times (``pytest -s``).
"""

from __future__ import annotations

import datetime
import time

import pytest

from drama3_patches.manifest import load_manifest
from drama3_patches.versions import check
from support import prometheus as prom
from support.selftest import TARGET_SOURCE, manifest_text, write_target
from support.subproc import ROOT

SPEC = next(p for p in load_manifest().patches if p.id == "metrics-endpoint").requires["vllm"]
IN_RANGE, WHY = check("vllm", SPEC)
pytestmark = [pytest.mark.vllm, pytest.mark.skipif(not IN_RANGE, reason=f"metrics-endpoint: {WHY}"),
              pytest.mark.skipif(prom.PROMETHEUS is None, reason=prom.MISSING)]

FOR = "3s"  # the test copy's for: (the documented rule waits 1m)
DEADLINE_S = 45
ENABLED = {"DRAMA3_PATCHES": "1", "DRAMA3_PATCHES_PLATFORM": "cpu"}
QUIET_S = 5  # after both fired: time the healthy target had to fire too (longer than FOR plus a scrape)


def _setup(tmp_path):
    """The deployment's manifest (the project's, plus the selftest patch), the target module, and
    the three report folders."""
    write_target(tmp_path / "target")
    manifest = tmp_path / "manifest.yaml"
    selftest = manifest_text({"targets": ["d3p_target:greet"]}).split("\n", 1)[1]
    manifest.write_text((ROOT / "patches_manifest.yaml").read_text().rstrip("\n") + "\n" + selftest)
    broken = tmp_path / "broken-reports"
    broken.write_text("not a folder\n")
    return manifest, {"failed": tmp_path / "failed-reports", "healthy": tmp_path / "healthy-reports",
                      "broken": broken}


def _writer(tmp_path, manifest, folder, target_source):
    """A live process of the deployment writing its report into ``folder``."""
    root = tmp_path / f"target-{folder.name}"
    write_target(root, source=target_source)
    return prom.spawn(prom.WRITER, {**ENABLED, "DRAMA3_PATCHES_MANIFEST": str(manifest),
                                    "DRAMA3_PATCHES_REPORT_DIR": str(folder)}, pythonpath=[root])


def _transitions(p: prom.Prometheus, until, start: float) -> tuple[list, dict]:
    """Poll the alerts (every 0.2 s, bounded) until ``until(states)`` holds for QUIET_S seconds;
    the (seconds since start, UTC time, alert, job, state) of each change, and the last states."""
    states: dict = {}
    log = []
    held_since = None
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        now = {(a["labels"]["alertname"], a["labels"]["job"]): a["state"] for a in p.alerts()}
        t = round(time.monotonic() - start, 2)
        utc = datetime.datetime.now(datetime.timezone.utc).strftime("%H:%M:%S.%f")[:-3]
        for key in sorted(set(states) | set(now)):
            if states.get(key, "inactive") != now.get(key, "inactive"):
                log.append((t, utc, *key, now.get(key, "inactive")))
        states = now
        if until(states):
            held_since = held_since or time.monotonic()
            if time.monotonic() - held_since >= QUIET_S:
                return log, states
        else:
            held_since = None
        time.sleep(0.2)
    raise AssertionError(f"alerts not settled within {DEADLINE_S} s: {log}\n{p.log_text()}")


def test_patch_failed_and_collector_errors_fire_and_a_healthy_folder_stays_inactive(tmp_path):
    start = time.monotonic()
    manifest, folders = _setup(tmp_path)
    failing_source = "def not_greet():\n    return 'no greet here'\n"  # the patch's target is missing: drift
    writers = [_writer(tmp_path, manifest, folders["failed"], failing_source),
               _writer(tmp_path, manifest, folders["healthy"], TARGET_SOURCE)]
    servers = {}
    p = None
    try:
        for proc in writers:  # reports written before the first scrape
            assert prom.first_line(proc, 60) == "ready"
        for job, folder in folders.items():  # the three start side by side
            servers[job] = prom.spawn(prom.SERVE, {**ENABLED, "DRAMA3_PATCHES_MANIFEST": str(manifest),
                                                   "DRAMA3_PATCHES_REPORT_DIR": str(folder)})
        ports = {job: prom.first_line(proc, 120) for job, proc in servers.items()}
        p = prom.Prometheus(tmp_path / "prometheus", {job: f"127.0.0.1:{port}" for job, port in ports.items()},
                            prom.rules_with_for({"Drama3PatchFailed": FOR}))
        ready_s = p.wait_ready()
        log, states = _transitions(
            p, lambda s: s.get(("Drama3PatchFailed", "failed")) == "firing"
            and s.get(("Drama3PatchesCollectorErrors", "broken")) == "firing", p.started)
        print(f"\nprometheus ready in {ready_s:.2f} s, {p.started - start:.1f} s after the test began; "
              "transitions (s since prometheus started, UTC, alert, job, state):")
        for row in log:
            print("  ", *row)
        # All three targets were scraped, the healthy one with both processes' reports exported and
        # the patch applied in its writer (so the rule saw it, and its failed series is 0).
        assert {r["metric"]["job"] for r in p.query("up == 1")} == {"failed", "healthy", "broken"}
        live = {r["metric"]["job"]: r["value"][1] for r in p.query('drama3_patches_reports{status="live"}')}
        assert live == {"failed": "2", "healthy": "2"}, live
        selftest = {(r["metric"]["job"], r["metric"]["state"]) for r in p.query(
            'drama3_patches_patch_state{patch="selftest",role="other"} == 1')}
        assert selftest == {("failed", "failed"), ("healthy", "applied")}, selftest
        # The failed patch's alert waited its for: (pending first), then fired; the healthy folder
        # and the broken one never raised it; only the broken folder raised the collector's alert.
        failed_path = [state for _, _, alert, job, state in log if (alert, job) == ("Drama3PatchFailed", "failed")]
        assert failed_path == ["pending", "firing"], log
        assert states == {("Drama3PatchFailed", "failed"): "firing",
                          ("Drama3PatchesCollectorErrors", "broken"): "firing"}, states
        assert not [row for row in log if row[3] == "healthy"], log
        firing = next(a for a in p.alerts() if a["labels"]["alertname"] == "Drama3PatchFailed")
        assert firing["labels"]["patch"] == "selftest" and firing["labels"]["severity"] == "critical"
    finally:
        if p is not None:
            p.stop()
        for proc in servers.values():
            prom.end_child(proc)
        for proc in writers:
            prom.end_child(proc)

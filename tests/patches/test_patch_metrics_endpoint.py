"""metrics-endpoint on the installed vLLM: the real ``attach_router`` under FastAPI's test client,
reading a folder of real reports.

Each case runs in a fresh interpreter enabled by ``DRAMA3_PATCHES=1`` (the ``.pth`` route) that
plays the API server: it starts a miniature deployment under itself (``support.report_tree``:
engine cores per stage, their workers, each process writing its report through the real engine),
then builds an app with vLLM's ``attach_router`` and scrapes ``/metrics``. Files a hostile user or
a broken writer could leave (a link, a FIFO, another owner's report, an oversized one) and the
reports of processes that are gone (killed, ended, a pid another process got since) are planted
beside them.
"""

from __future__ import annotations

import json
import os

import pytest

from drama3_patches.manifest import load_manifest
from drama3_patches.tools.validate.metrics import parse, total
from drama3_patches.versions import check
from support.subproc import call

SPEC = next(p for p in load_manifest().patches if p.id == "metrics-endpoint").requires["vllm"]
IN_RANGE, WHY = check("vllm", SPEC)
pytestmark = [pytest.mark.vllm, pytest.mark.skipif(not IN_RANGE, reason=f"metrics-endpoint: {WHY}")]

ENABLED = {"DRAMA3_PATCHES": "1", "DRAMA3_PATCHES_PLATFORM": "cpu"}
FOREIGN_UID = 54321  # no account needed: root can chown to any uid


def _app():
    """vLLM's real /metrics on a bare app, plus real vLLM series (its WebSocket gauge and counter,
    registered at the import of its module) and a route."""
    import vllm.entrypoints.speech_to_text.realtime.metrics  # noqa: F401 (registers vllm:websocket_*)
    from fastapi import FastAPI
    from vllm.entrypoints.serve.instrumentator.metrics import attach_router

    app = FastAPI()

    @app.get("/ping")
    def ping():
        return "pong"

    attach_router(app)
    return app


def _scrape(app) -> dict:
    from fastapi.testclient import TestClient

    with TestClient(app) as client:
        client.get("/ping")
        r = client.get("/metrics")
    return {"status": r.status_code, "text": r.text}


def _row(patch_id: str) -> dict:
    import drama3_patches

    return next(p for p in drama3_patches.status()["patches"] if p["id"] == patch_id)


def _plant(reports: str, victim_pid: int, here: str) -> dict:
    """Files beside the real reports, each made from a real report (the killed process's)."""
    import shutil
    import subprocess
    import time

    from drama3_patches.report_dir import START_SLACK_S

    real = os.path.join(reports, f"{here}-{victim_pid}.json")
    data = json.loads(open(real).read())
    # Processes that started after that report was written, holding the pids two reports name;
    # clearly after: a start within report_dir.START_SLACK_S of the write counts as the writer's.
    time.sleep(5 * START_SLACK_S)
    sleepers = [subprocess.Popen(["sleep", "300"]) for _ in range(2)]
    reused = dict(data, pid=sleepers[0].pid)  # records the writer's start: another process has the pid
    old_format = dict(data, pid=sleepers[1].pid, process={k: v for k, v in data["process"].items()
                                                            if k != "start_ticks"})
    for report in (reused, old_format):
        with open(os.path.join(reports, f"{here}-{report['pid']}.json"), "w") as fh:
            json.dump(report, fh)
    remote = dict(data, host="node.b")
    with open(os.path.join(reports, f"node.b-{victim_pid}.json"), "w") as fh:
        json.dump(remote, fh)
    os.symlink(real, os.path.join(reports, f"{here}-1.json"))
    os.mkfifo(os.path.join(reports, f"{here}-2.json"))
    foreign = os.path.join(reports, f"{here}-3.json")
    shutil.copy(real, foreign)
    os.chown(foreign, FOREIGN_UID, FOREIGN_UID)
    with open(os.path.join(reports, f"{here}-4.json"), "w") as fh:
        fh.write(json.dumps(dict(data, pid=4)) + " " * (1024 * 1024))
    return {"sleepers": [p.pid for p in sleepers], "procs": sleepers}


def deployment_scraped(reports: str) -> dict:
    """The API server's view of a deployment: a tree of live processes, one killed, one ended, and
    planted files; then /metrics."""
    import signal

    from drama3_patches.engine.state import host_label
    from support import report_tree

    here = host_label()
    killed = ("VllmWorker-7", "Worker_TP7", {"preemptions": 5}, [], True)
    ended = ("VllmWorker-8", None, {"preemptions": 7}, [], False)
    tree = report_tree.grow(extra=[killed, ended])
    victim, done = tree.kids[-2], tree.kids[-1]
    os.kill(victim.pid, signal.SIGKILL)
    victim.join(30)
    done.join(30)
    planted = _plant(reports, victim.pid, here)
    try:
        page = _scrape(_app())
        return {**page, "pids": tree.pids, "here": here, "me": os.getpid(), "victim": victim.pid,
                "ended": done.pid, "reused": planted["sleepers"], "row": _row("metrics-endpoint")}
    finally:
        tree.stop()
        for proc in planted["procs"]:
            proc.kill()
            proc.wait()


def _labels(sample) -> tuple:
    return tuple(sample.labels.get(k, "") for k in ("role", "stage", "rank"))


def test_the_deployments_live_processes_are_on_metrics_and_the_rest_is_counted(tmp_path):
    reports = tmp_path / "reports"
    got = call(deployment_scraped, str(reports), env={**ENABLED, "DRAMA3_PATCHES_REPORT_DIR": str(reports)},
               timeout=240)
    assert got["status"] == 200 and got["row"]["state"] == "applied", got["row"]
    page = got["text"]
    # vLLM's own series are all still there
    assert "vllm:websocket_connections_active 0.0" in page and "vllm:websocket_connections_total 0.0" in page
    assert "\nhttp_request_duration_highr_seconds_count " in page  # vLLM's instrumentator
    assert "process_cpu_seconds_total" in page
    samples = parse(page)
    # One process_info row per live process: this API server, both engine cores, the three workers;
    # a worker's stage is its engine core's, its rank multiprocessing's name for it.
    info = {_labels(s): s.labels["pid"] for s in samples if s.name == "drama3_patches_process_info"}
    assert sorted(info) == sorted([("api-server", "", ""), ("engine-core", "0", ""), ("engine-core", "1", ""),
                                   ("worker", "0", "0"), ("worker", "0", "1"), ("worker", "1", "0")]), info
    assert info[("api-server", "", "")] == str(got["me"])
    tree = {int(pid) for pid in got["pids"]}  # every process the tree started, as JSON keys
    assert {int(p) for p in info.values()} == {got["me"], *tree} - {got["victim"], got["ended"]}
    assert all(s.labels["host"] == got["here"] for s in samples if "host" in s.labels)
    # Events: the two stage-0 ranks' counts, each under its rank; the killed and the ended
    # process's (5 and 7 preemptions) are not counted.
    assert total(samples, "drama3_patches_events_total", event="preemptions") == 6
    for rank in ("0", "1"):
        assert total(samples, "drama3_patches_events_total", event="tp_steps_checked", role="worker", stage="0",
                     rank=rank) == 40
    assert total(samples, "drama3_patches_events_total", event="resumes_verified") == 4
    # Patch states: one-hot per process and patch, the ids the manifest's and the states the engine's.
    ids = set(load_manifest().ids)
    states = [s for s in samples if s.name == "drama3_patches_patch_state"]
    assert {s.labels["patch"] for s in states} == ids
    for where in info:
        for patch_id in ids:
            row = [s.value for s in states if _labels(s) == where and s.labels["patch"] == patch_id]
            assert sorted(row) == [0, 0, 0, 0, 1], (where, patch_id, row)
    assert total(samples, "drama3_patches_patch_state", patch="metrics-endpoint", state="applied",
                 role="api-server") == 1
    assert total(samples, "drama3_patches_patch_state", patch="preemption-host-copy", state="skipped",
                 role="worker") == 3  # platform cpu
    # The folder: 6 live (this process included), 4 gone (killed, ended, a reused pid recorded by
    # its start and one by its write time), 1 remote, 4 skipped by kind.
    reports_ = {s.labels["status"]: s.value for s in samples if s.name == "drama3_patches_reports"}
    assert reports_ == {"live": 6, "gone": 4, "remote": 1, "skipped": 4, "folder-unset": 0}, reports_
    skipped = {s.labels["reason"]: s.value for s in samples if s.name == "drama3_patches_reports_skipped"}
    assert skipped == {"link": 1, "not-regular": 1, "foreign-owner": 1, "too-large": 1, "bad-name": 0,
                       "invalid": 0, "unreadable": 0, "over-limit": 0, "unlisted": 0}, skipped
    assert total(samples, "drama3_patches_collector_errors_total") == 0
    # Label values are from the fixed sets only: nothing from a report's text (reasons, argv, paths).
    for s in samples:
        assert set(s.labels.values()) <= ids | {"pending", "applied", "skipped", "not-needed", "failed",
                                                "preemptions", "resumes", "resumes_verified", "tp_steps_checked",
                                                "api-server", "engine-core", "worker", "other", "", "0", "1",
                                                "cpu", "true", "false", got["here"], *SKIPS, *STATUSES,
                                                *map(str, info.values())}, s


SKIPS = ("link", "not-regular", "too-large", "foreign-owner", "bad-name", "invalid", "unreadable", "over-limit",
         "unlisted")
STATUSES = ("live", "gone", "remote", "skipped", "folder-unset")


def _our_collectors() -> list:
    """The drama3-patches collectors in prometheus_client's default registry."""
    import prometheus_client

    return [c for c in prometheus_client.REGISTRY._collector_to_names if type(c).__name__ == "PatchCollector"]


def own_process_only() -> dict:
    return {**_scrape(_app()), "me": os.getpid()}


def test_without_a_report_folder_only_the_api_server_is_exported_and_the_page_says_so():
    got = call(own_process_only, env=ENABLED, timeout=120)
    samples = parse(got["text"])
    info = [s.labels for s in samples if s.name == "drama3_patches_process_info"]
    assert [(i["role"], i["pid"]) for i in info] == [("api-server", str(got["me"]))]
    assert total(samples, "drama3_patches_reports", status="folder-unset") == 1
    assert total(samples, "drama3_patches_reports", status="live") == 1


def failing_collection() -> dict:
    import drama3_patches.report_dir as report_dir

    app = _app()
    real = report_dir.collect

    def broken(*args, **kwargs):
        raise RuntimeError("a collector bug")

    report_dir.collect = broken
    first = _scrape(app)
    report_dir.collect = real
    return {"first": first, "second": _scrape(app)}


def test_a_collector_error_still_gives_the_page_with_vllms_series_and_counts_the_error(tmp_path):
    reports = tmp_path / "reports"
    got = call(failing_collection, env={**ENABLED, "DRAMA3_PATCHES_REPORT_DIR": str(reports)}, timeout=120,
               with_output=True)
    first, second = got["result"]["first"], got["result"]["second"]
    assert first["status"] == 200
    assert "vllm:websocket_connections_total 0.0" in first["text"] and "process_cpu_seconds_total" in first["text"]
    samples = parse(first["text"])
    assert [s.name for s in samples] == ["drama3_patches_collector_errors_total"]
    assert total(samples, "drama3_patches_collector_errors_total") == 1
    # the next scrape has the series again; the error stays counted
    again = parse(second["text"])
    assert total(again, "drama3_patches_collector_errors_total") == 1
    assert total(again, "drama3_patches_reports", status="live") == 1
    assert got["stderr"].count("the /metrics collector failed (RuntimeError: a collector bug)") == 1


def multiprocess_scrapes(set_late: bool) -> dict:
    from vllm.entrypoints.serve.instrumentator import metrics as vllm_metrics  # noqa: F401

    if set_late:  # after the patch applied: the wrapper decides at the call, as vLLM's registry does
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = os.environ["D3P_TEST_MULTIPROC"]
    pages = [_scrape(_app()), _scrape(_app())]
    ours = _our_collectors()
    import sys

    return {"pages": pages, "row": _row("metrics-endpoint"), "registered": len(ours),
            "collector_loaded": "drama3_patches.metrics" in sys.modules}


@pytest.mark.parametrize("set_late", [False, True], ids=["set-at-start", "set-after-import"])
def test_multiprocess_mode_exports_nothing_and_warns_once(tmp_path, set_late):
    """With PROMETHEUS_MULTIPROC_DIR (vLLM's several API servers) vLLM's page reads only its
    multiprocess collector: no series of ours, the target skipped with the reason (when the
    variable was there at the import), one warning however often attach_router runs."""
    multiproc = tmp_path / "prom"
    multiproc.mkdir()
    env = {**ENABLED, "DRAMA3_PATCHES_REPORT_DIR": str(tmp_path / "reports"), "D3P_TEST_MULTIPROC": str(multiproc)}
    if not set_late:
        env["PROMETHEUS_MULTIPROC_DIR"] = str(multiproc)
    got = call(multiprocess_scrapes, set_late, env=env, timeout=120, with_output=True)
    result = got["result"]
    for page in result["pages"]:
        assert page["status"] == 200 and "drama3_patches_" not in page["text"]
    assert result["registered"] == 0 and not result["collector_loaded"]
    warnings = [line for line in got["stderr"].splitlines() if "metrics-endpoint: PROMETHEUS_MULTIPROC_DIR" in line]
    assert len(warnings) == 1, got["stderr"]
    if set_late:
        assert result["row"]["state"] == "applied"
    else:
        assert result["row"]["state"] == "skipped", result["row"]
        assert result["row"]["reason"].startswith("PROMETHEUS_MULTIPROC_DIR is set (vLLM does so for more than "
                                                  "one API server)")


def twice() -> dict:

    import drama3_patches
    import drama3_patches.metrics as metrics

    pages = [_scrape(_app()), _scrape(_app())]
    first = metrics.register()
    drama3_patches.unapply(["metrics-endpoint"])
    drama3_patches.apply(["metrics-endpoint"])
    pages.append(_scrape(_app()))
    ours = _our_collectors()
    return {"pages": pages, "registered": len(ours), "same": metrics.register() is first}


def test_registering_twice_is_harmless():
    """Two apps in one process (and the patch re-applied): one collector, each page one set of series."""
    got = call(twice, env=ENABLED, timeout=120)
    assert got["registered"] == 1 and got["same"]
    for page in got["pages"]:
        assert page["status"] == 200
        assert page["text"].count("# TYPE drama3_patches_patch_state gauge") == 1
        assert total(parse(page["text"]), "drama3_patches_reports", status="live") == 1


def loaded_around_the_call() -> dict:
    import sys

    before = "prometheus_client" in sys.modules
    from vllm.entrypoints.serve.instrumentator import metrics as vllm_metrics  # noqa: F401

    applied = _row("metrics-endpoint")["state"]
    imported = "drama3_patches.metrics" in sys.modules
    _app()
    return {"prometheus_before_vllm": before, "applied": applied, "collector_before_call": imported,
            "collector_after_call": "drama3_patches.metrics" in sys.modules}


def test_the_collector_loads_only_when_vllm_builds_its_app():
    got = call(loaded_around_the_call, env=ENABLED, timeout=120)
    assert got == {"prometheus_before_vllm": False, "applied": "applied", "collector_before_call": False,
                   "collector_after_call": True}



def _dashboard_and_rule_exprs() -> tuple[list[str], dict]:
    import yaml

    from support.prometheus import ALERTS_FILE, dashboard_queries

    rules = yaml.safe_load(ALERTS_FILE.read_text())
    return [e for _, e in dashboard_queries()] + [r["expr"] for g in rules["groups"] for r in g["rules"]], rules


def _names_and_labels(prefix: str, expr: str):
    """(series name, label keys its selector matches, label keys a ``by (...)`` groups it by) of
    each series of ``expr`` whose name starts with ``prefix``."""
    import re

    groups = set()
    for by in re.findall(r"by \(([^)]*)\)", expr):
        groups |= {k.strip() for k in by.split(",")}
    for name, selector in re.findall(rf"({re.escape(prefix)}[\w:]+)(?:\{{([^}}]*)\}})?", expr):
        yield name, set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", selector)), groups


@pytest.mark.forked  # the collector builds this process's engine
def test_the_dashboard_and_the_alert_rules_query_only_series_and_labels_the_collector_exports():
    """docs/grafana: every drama3_patches_ series a panel or rule names, and every label it matches
    on, is one the collector's own samples have (a renamed series would leave a panel empty)."""
    from drama3_patches.metrics import PatchCollector

    exported: dict = {}
    for family in PatchCollector().collect():
        for sample in family.samples:
            exported.setdefault(sample.name, set()).update(sample.labels)
    exprs, rules = _dashboard_and_rule_exprs()
    used = 0
    for expr in exprs:
        for name, keys, _ in _names_and_labels("drama3_patches_", expr):
            assert name in exported, (name, expr)
            assert keys <= exported[name], (name, keys, expr)
            used += 1
    assert used >= 10 and "Drama3PatchFailed" in {r["alert"] for g in rules["groups"] for r in g["rules"]}


def test_the_dashboards_audio_series_and_labels_are_those_vllm_omnis_published_code_defines():
    """docs/grafana: every vllm_omni: series a panel or rule names is a sample name of a family
    the installed vLLM-Omni's ``metrics/modality.py`` declares, and every label it matches on or
    groups by (besides Prometheus's ``instance``/``job``) is one of that family's."""
    from support import omni_audio

    published = call(omni_audio.published_families, timeout=120)
    families = {name: set(labels) for name, labels in published["families"].items()}
    exprs, rules = _dashboard_and_rule_exprs()
    named = set()
    for expr in exprs:
        for name, keys, groups in _names_and_labels("vllm_omni:", expr):
            assert name in families, (name, published["version"], published["file"])
            assert keys | groups <= families[name] | {"instance", "job"}, (name, keys | groups, expr)
            named.add(name)
    assert named == {"vllm_omni:audio_ttfp_s_bucket", "vllm_omni:audio_ttfp_s_count", "vllm_omni:audio_rtf_bucket",
                     "vllm_omni:audio_underrun_s_bucket", "vllm_omni:audio_underrun_s_count",
                     "vllm_omni:audio_frames_total", "vllm_omni:speech_stream_completed_total",
                     "vllm_omni:speech_stream_aborted_total"}, named
    # controls: a misspelled name and a label of ours are not in vLLM-Omni's families
    assert "vllm_omni:audio_ttfa_s_bucket" not in families and "host" not in families["vllm_omni:audio_rtf_bucket"]
    assert "Drama3AudioUnderrunShare" in {r["alert"] for g in rules["groups"] for r in g["rules"]}

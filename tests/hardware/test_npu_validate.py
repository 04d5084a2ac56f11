"""``drama3-patches validate`` on the cards (``pytest -m npu``): the evidence a review of the port
asks for, on the 910B TP2+EP profile (``DRAMA3_NPU_DEPLOY`` picks another deploy file).

By default it serves a tiny published-format model with block-FP8 experts, made on the spot
(``drama3-patches tiny-model --fp8``: the 910B expansion path runs, no 37 GB download); with
``DRAMA3_NPU_MODEL`` set, the real checkpoint. The run's ``report.json`` is what is asserted, and
its ``report.md`` is left in the test's folder for the pull request. A real Prometheus (Debian's,
``support.prometheus.Around``) scrapes the passing run's server on the port handed to validate, and
the dashboard's queries over the run are checked as in the CPU rehearsal (tests/e2e/test_validate.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from drama3_patches.tools.deploy_config import profiles
from support import prometheus as prom

pytestmark = pytest.mark.npu

DEPLOY = os.environ.get("DRAMA3_NPU_DEPLOY") or str(profiles.profile_file("910b-tp2-ep"))


def _validate(out, fault: str | None = None, extra: list = ()) -> tuple[subprocess.CompletedProcess, dict]:
    model = os.environ.get("DRAMA3_NPU_MODEL")
    argv = [sys.executable, "-m", "drama3_patches.tools", "validate", "--deploy", DEPLOY, "--out", str(out), *extra]
    argv += ["--model", model] if model else ["--tiny-fp8"]
    env = dict(os.environ, DRAMA3_PATCHES="1", VLLM_LOGGING_LEVEL="INFO")
    env.pop("DRAMA3_PATCHES_FAULT", None)
    if fault:
        env["DRAMA3_PATCHES_FAULT"] = fault
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=3600)
    print(done.stdout, done.stderr[-4000:])
    return done, json.loads((out / "report.json").read_text())


@pytest.fixture(scope="module")
def cards(tmp_path_factory):
    """The passing run, its server scraped by a Prometheus the while (``prom.Around.record``)."""
    base = tmp_path_factory.mktemp("cards")
    port = prom.free_port()
    with prom.Around(base / "prometheus", f"127.0.0.1:{port}") as scraping:
        done, report = _validate(base / "validate", extra=["--port", str(port)])
    return base, done, report, scraping.record


def test_validate_passes_every_check_on_the_cards(cards):
    tmp_path, done, report, _ = cards
    failed = [c for c in report["checks"] if not c["passed"]]
    assert done.returncode == 0 and report["passed"] and not failed, (failed, report["diagnosis"])
    counts = report["counts"]
    assert counts["preemptions"] > 0 and counts["resumes_verified"] == counts["resumes"] > 0, counts
    if report["stage0"]["tensor_parallel_size"] > 1:
        assert counts["tp_steps_checked"] > 0, counts
    assert counts["requests_completed"] > 0, counts
    assert report["server_stop"]["left"] == [], report["server_stop"]
    # vLLM's /metrics on the cards: every stage-0 rank's preemption-host-copy applied, no patch failed
    from drama3_patches.tools.validate.metrics import parse, total

    s = parse((tmp_path / "validate" / "metrics.txt").read_text())
    for rank in range(report["stage0"]["tensor_parallel_size"]):
        assert total(s, "drama3_patches_patch_state", patch="preemption-host-copy", state="applied", role="worker",
                     stage="0", rank=str(rank)) == 1, rank
    assert total(s, "drama3_patches_patch_state", state="failed") == 0
    assert total(s, "drama3_patches_reports", status="live") == len(report["processes"])


def test_every_dashboard_query_and_audio_panel_has_series_on_the_cards(cards):
    tmp_path, done, report, record = cards
    if record.get("error") == prom.MISSING:
        pytest.skip(prom.MISSING)
    assert "error" not in record, record["error"]
    for where, r in record["panels"].items():
        print(f"{r['series']:3d} series, {r['finite']:5d} values, max {r['max']}: {where}")
    empty = {where for where, r in record["panels"].items() if r["series"] == 0}
    assert empty <= set(prom.EMPTY_BY_DESIGN), sorted(empty - set(prom.EMPTY_BY_DESIGN))
    assert {name: r["health"] for name, r in record["rules"].items()} == dict.fromkeys(record["rules"], "ok")
    # vLLM-Omni's audio series on the cards: one underrun observation per streamed request at least
    assert record["totals"]["vllm_omni:audio_underrun_s_count"] >= report["counts"]["requests_completed"] > 0
    print("audio totals at the last scrape:", record["totals"])


def test_on_the_cards_a_park_of_the_wrong_slot_fails_the_preemption_row_for_that_reason(tmp_path):
    """The negative control on the cards: the test-only fault parks the next slot's history; the
    preemption row must fail, and the diagnosis must name the resume check's mismatch."""
    done, report = _validate(tmp_path / "wrong-slot", fault="wrong-slot", extra=["--clones", "1",
                                                                               "--bench-requests", "1"])
    checks = {c["name"][0]: c for c in report["checks"]}
    assert done.returncode == 1 and checks["a"]["passed"] and not checks["c"]["passed"], checks
    assert report["first_failed"] == "c. preemption and resume", report["first_failed"]
    assert any(line.startswith("Likely cause (resumed history mismatch") for line in report["diagnosis"]), \
        report["diagnosis"]
    assert report["server_stop"]["left"] == [], report["server_stop"]

"""docs/grafana on a real Prometheus (Debian's; promtool with it): the rules file checks, and the
dashboard's audio panels and the underrun alert evaluate to series on the page vLLM-Omni's own
published code renders (``support.omni_audio``: its families observed through
``OmniModalityMetrics``, two rounds of requests), scraped from loopback."""

from __future__ import annotations

import json
import time
import urllib.error

import pytest
import yaml

from support import omni_audio
from support import prometheus as prom
from support.subproc import call

needs_promtool = pytest.mark.skipif(prom.PROMTOOL is None, reason=prom.MISSING)
needs_prometheus = pytest.mark.skipif(prom.PROMETHEUS is None, reason=prom.MISSING)
DEADLINE_S = 30


@needs_promtool
def test_promtool_accepts_the_alert_rules_and_rejects_a_broken_copy(tmp_path):
    ok = prom.promtool("check", "rules", str(prom.ALERTS_FILE))
    assert ok.returncode == 0 and "SUCCESS: 3 rules found" in ok.stdout, ok.stdout + ok.stderr
    broken = yaml.safe_load(prom.ALERTS_FILE.read_text())
    broken["groups"][0]["rules"][-1]["expr"] += " by"  # the last rule's query no longer parses
    (tmp_path / "broken.yaml").write_text(yaml.safe_dump(broken))
    bad = prom.promtool("check", "rules", str(tmp_path / "broken.yaml"))
    assert bad.returncode != 0 and "FAILED" in bad.stdout + bad.stderr, bad.stdout + bad.stderr


def _audio_queries() -> list[tuple[str, str]]:
    return [(where, prom.grafana_substituted(expr)) for where, expr in prom.dashboard_queries()
            if "vllm_omni:" in expr]


def _wait_all(p: prom.Prometheus, queries) -> dict:
    """Each query's result once every one has a series (bounded); the empty ones named otherwise."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        results = {}
        for where, expr in queries:
            try:
                results[where] = p.query(expr)
            except urllib.error.HTTPError as exc:
                raise AssertionError(f"{where}: Prometheus rejects {expr!r}: {exc.read(2000).decode()}") from exc
        empty = [where for where, result in results.items() if not result]
        if not empty:
            return results
        if time.monotonic() > deadline:
            raise AssertionError(f"empty on vLLM-Omni's sample page after {DEADLINE_S} s: {empty}\n{p.log_text()}")
        time.sleep(0.5)


def _values(result) -> list[float]:
    return [float(r["value"][1]) for r in result]


@pytest.mark.vllm
@needs_prometheus
def test_each_audio_panel_and_the_underrun_alert_give_series_on_vllm_omnis_own_page(tmp_path):
    pages = call(omni_audio.published_pages, timeout=120)
    queries = _audio_queries()
    assert len(queries) == 10, queries  # 9 panel targets and the model variable
    served = prom.Pages(pages)
    p = prom.Prometheus(tmp_path / "prometheus", {"omni": served.target},
                        prom.rules_with_for({"Drama3AudioUnderrunShare": "0s"}))
    try:
        p.wait_ready()
        results = _wait_all(p, queries)
        # Every series carries vLLM-Omni's own labels (the model variable's query is label_values').
        for where, result in results.items():
            for series in result:
                assert series["metric"].get("model_name") == omni_audio.MODEL, (where, series)
        # The second round's requests alone are in the rate window's increase (the first page is its
        # first sample): the share of underruns above the 0.5 s cushion, the worst one's bucket bound.
        second = [r[4] for r in omni_audio.ROUNDS[1]]
        share = next(v for w, v in results.items() if w.endswith("gap above the cushion, and the worst gap' A"))
        assert _values(share) == [pytest.approx(sum(u > 0.5 for u in second) / len(second))]
        worst = next(v for w, v in results.items() if w.endswith("gap above the cushion, and the worst gap' B"))
        assert _values(worst) == [min(b for b in (0.5, 1.0, 2.5, 5.0) if b >= max(second))]
        audio_rate = next(v for w, v in results.items() if w.startswith("panel 'Audio seconds per second'"))
        assert _values(audio_rate)[0] > 0
        # The underrun alert (its for: made 0 here) fires on the same page; a misspelled series is
        # empty and a query that does not parse is rejected, so the checks above can fail.
        deadline = time.monotonic() + DEADLINE_S
        while not any(a["labels"]["alertname"] == "Drama3AudioUnderrunShare" and a["state"] == "firing"
                      for a in p.alerts()):
            assert time.monotonic() < deadline, p.alerts()
            time.sleep(0.5)
        assert p.query(queries[0][1].replace("audio_ttfp_s_bucket", "audio_ttfa_s_bucket")) == []
        with pytest.raises(urllib.error.HTTPError):
            p.query(queries[0][1] + " by")
    finally:
        p.stop()
        served.stop()


@pytest.mark.vllm
@needs_prometheus
def test_around_a_run_records_each_query_up_to_the_targets_last_scrape_and_each_request_per_scrape(tmp_path):
    """``prom.Around`` (the e2e rehearsal's scraper) over a stand-in run: vLLM-Omni's own pages
    served a few scrapes, then the target gone. What it records is read at the last scrape the
    target answered, each scrape's new underrun observations against ROUNDS."""
    pages = call(omni_audio.published_pages, timeout=120)
    served = prom.Pages(pages)
    stopped = False
    try:
        with prom.Around(tmp_path / "prometheus", served.target) as around:
            deadline = time.monotonic() + DEADLINE_S
            while served.gets < 5:  # both rounds scraped, the second for a rate window's length
                assert time.monotonic() < deadline and "error" not in around.record, around.record
                time.sleep(0.2)
            served.stop()
            stopped = True
            time.sleep(2 * prom.SCRAPE_S)  # a scrape or two that find the target gone
    finally:
        if not stopped:
            served.stop()
    rec = around.record
    assert "error" not in rec, rec["error"]
    assert rec["version"].startswith("prometheus, version 2.") and 0 < rec["up"] < rec["scrapes"], rec
    assert rec["rate_interval"] == f"{4 * prom.SCRAPE_S}s" and rec["step_s"] == prom.SCRAPE_S
    observed = [r for rnd in omni_audio.ROUNDS for r in rnd]
    assert rec["totals"] == {"vllm_omni:audio_ttfp_s_count": len(observed), "vllm_omni:audio_rtf_count": len(observed),
                             "vllm_omni:audio_underrun_s_count": len(observed),
                             "vllm_omni:audio_frames_total": sum(r[5] for r in observed),
                             "vllm_omni:speech_stream_completed_total": len(observed)}
    # one scrape per round: its requests' underruns added up; a request alone in none of them
    first, second = ([r[4] for r in rnd] for rnd in omni_audio.ROUNDS)
    steps = rec["underrun_steps"]
    assert [(e["after"], e["added"]) for e in steps] == [(6, 6), (10, 4)], steps
    assert [e["sum"] for e in steps] == [pytest.approx(sum(first)), pytest.approx(sum(second))]
    assert prom.observation(steps, 7) is None and prom.observation(steps, 11) is None
    assert prom.observation(prom.steps([(1.0, 1), (2.0, 2)], [(1.0, 0.5), (2.0, 1.75)]), 2) == 1.25
    # every audio query had values; the patches' own are empty on a page without them ('Failed
    # patches' alone shows 0 by its 'or vector(0)'): an empty query is seen as empty
    panels = rec["panels"]
    for where, r in panels.items():
        if "vllm_omni:" in r["expr"]:
            assert r["series"] >= 1 and r["finite"] > 0, (where, r)
        elif where != "panel 'Failed patches' A":
            assert r["series"] == 0, (where, r)
    assert panels["panel 'Failed patches' A"]["max"] == 0
    assert json.loads((tmp_path / "prometheus" / "record.json").read_text()) == rec

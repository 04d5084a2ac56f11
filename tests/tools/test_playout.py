"""``bench.playout``: what a listener hears, on scripted chunk timelines with exact figures.

The expected figures of each timeline are worked out here by hand or by ``simulate``, a player
written apart from the module (it tracks the audio in hand in exact fractions, event by event,
where the module tracks when the audio runs out, in floats).
"""

from __future__ import annotations

import importlib.util
import json
import random
from fractions import Fraction as F

import pytest

from drama3_patches.tools.bench import playout

FRAME = F(2048, 44100)  # one Drama 3 frame of audio, seconds
RAMP = (6, 8, 12, 16, 24, 32)  # vllm_omni/deploy/fish_omni.yaml codec_chunk_ramp
CHUNK = 64  # codec_chunk_frames


def simulate(chunks, cushion=F(0)):
    """An exact player: the stalls (start, seconds) of ``chunks`` ((arrival, audio) Fractions).

    Time moves from event to event; ``held`` is the audio in hand. Playback begins at the first
    arrival plus ``cushion``; when ``held`` reaches zero before the next arrival the player
    waits, and plays again from that arrival.
    """
    start = chunks[0][0] + cushion
    held, now, out = F(0), chunks[0][0], []
    playing = False
    for arrival, audio in chunks:
        if not playing and arrival >= start:  # the cushion ran out before this arrival
            now, playing = start, True
        if playing:
            if now + held < arrival:  # emptied before it came
                out.append((now + held, arrival - (now + held)))
                held = F(0)
            else:
                held -= arrival - now
            now = arrival
        held += audio
    return out


def ramp_timeline(rtf, frames_total: int):
    """The published ramp's windows, each arriving when its last frame is made at ``rtf``
    (seconds of compute per second of audio) from the send; decode and transport are free."""
    sizes, done = [], 0
    for size in list(RAMP) + [CHUNK] * frames_total:
        size = min(size, frames_total - done)
        if size <= 0:
            break
        sizes.append(size)
        done += size
    out, made = [], 0
    for size in sizes:
        made += size
        out.append((made * FRAME * rtf, size * FRAME))
    return out


def as_float(chunks):
    return [(float(a), float(s)) for a, s in chunks]


def test_four_quarter_second_chunks_half_a_second_apart():
    """The issue's first worked case: 3 stalls of 0.25 s, D = stall = 0.75 s."""
    chunks = [(0.2 + 0.5 * k, 0.25) for k in range(4)]
    fig = playout.request_figures(chunks, ttfa=0.2)
    assert fig["stalls"] == 3
    assert fig["needed_cushion_s"] == pytest.approx(0.75, abs=1e-12)
    assert fig["stall_s"] == pytest.approx(0.75, abs=1e-12)
    assert fig["longest_stall_s"] == pytest.approx(0.25, abs=1e-12)
    assert fig["stall_free_start_s"] == pytest.approx(0.95, abs=1e-12)
    assert fig["chunks"] == [[0.2, 0.25], [0.7, 0.25], [1.2, 0.25], [1.7, 0.25]]
    assert [(round(a, 9), round(s, 9)) for a, s in playout.stalls(chunks)] == [(0.45, 0.25), (0.95, 0.25),
                                                                               (1.45, 0.25)]
    exact = simulate([(F(2, 10) + F(1, 2) * k, F(1, 4)) for k in range(4)])
    assert exact == [(F(45, 100), F(1, 4)), (F(95, 100), F(1, 4)), (F(145, 100), F(1, 4))]
    # the playhead: flat while it waits, then a slope of one
    assert [(round(t, 9), round(p, 9)) for t, p in playout.playhead(chunks)] == [
        (0.2, 0.0), (0.45, 0.25), (0.7, 0.25), (0.95, 0.5), (1.2, 0.5), (1.45, 0.75), (1.7, 0.75), (1.95, 1.0)]
    # with the cushion it needs, the same stream never stalls
    assert playout.stalls(chunks, 0.75) == []


@pytest.mark.parametrize("rtf, stalls_frames", [
    # RTF 0.73: the 8-frame window is due at 14 x 0.73 = 10.22 frame-times, in time, but the
    # 12-frame one (26 x 0.73 = 18.98) comes 0.60 of a frame after the 14 frames in hand ran out
    # (4.38 + 14), the 24-frame one 1.20 late, the first 64-frame one 14.08 late.
    (F(73, 100), [F(60, 100), F(120, 100), F(1408, 100)]),
    # The deploy file's own margin, 1.45 frames made per frame played (RTF 1/1.45): every ramp
    # boundary stays within first + 1.45 x previous, the jump from 32 to 64 does not.
    (1 / F(145, 100), [F(162 - 6, 1) / F(145, 100) - 98]),
])
def test_the_published_chunk_ramp_at_a_real_time_factor(rtf, stalls_frames):
    """The published ramp (6, 8, 12, 16, 24, 32, then 64 frames) made at a steady RTF below one,
    226 frames (two 64-frame windows): exact stalls from ``simulate``, and the module's figures."""
    exact = ramp_timeline(rtf, 226)
    assert [a / FRAME for a, _ in exact][:7] == [n * rtf for n in (6, 14, 26, 42, 66, 98, 162)]
    sim = simulate(exact)
    assert [s / FRAME for _, s in sim] == stalls_frames
    d_exact = sum(s for _, s in sim)  # the total silence, which is D
    fig = playout.request_figures(as_float(exact), ttfa=float(exact[0][0]))
    assert fig["stalls"] == len(stalls_frames)
    assert fig["needed_cushion_s"] == pytest.approx(float(d_exact), abs=1e-9)
    assert fig["stall_s"] == pytest.approx(float(d_exact), abs=1e-9)
    assert fig["longest_stall_s"] == pytest.approx(float(max(stalls_frames) * FRAME), abs=1e-9)
    assert fig["stall_free_start_s"] == pytest.approx(float(exact[0][0] + d_exact), abs=1e-9)
    # D by its definition, worked out again in fractions: the largest lead of an arrival
    received, leads = F(0), []
    for arrival, audio in exact:
        leads.append(arrival - exact[0][0] - received)
        received += audio
    assert max(leads) == d_exact


def test_the_ramp_figures_in_seconds():
    """The RTF 0.73 case as numbers a reader can check: 6 x 0.73 frames to first audio, D of
    15.88 frames, the longest stall 14.08 frames."""
    fig = playout.request_figures(as_float(ramp_timeline(F(73, 100), 226)), ttfa=float(6 * F(73, 100) * FRAME))
    assert fig["stall_free_start_s"] - fig["needed_cushion_s"] == pytest.approx(0.203407, abs=1e-6)
    assert fig["needed_cushion_s"] == pytest.approx(0.737466, abs=1e-6)  # 15.88 x 2048 / 44100
    assert fig["longest_stall_s"] == pytest.approx(0.653874, abs=1e-6)  # 14.08 x 2048 / 44100
    assert playout.FRAME_S == pytest.approx(0.046439909, abs=1e-9)


def _random_stream(rng, n):
    t, out = rng.uniform(0.05, 2.0), []
    for _ in range(n):
        out.append((t, rng.choice([0.0464, 0.279, 0.557, 1.486, 2.972]) * rng.uniform(0.5, 1.5)))
        t += rng.expovariate(1 / 0.6)
    return out


@pytest.mark.parametrize("seed", range(6))
def test_stall_total_at_a_cushion_is_d_less_the_cushion(seed):
    """The identity stall_s(C) = max(0, D - C), on random streams, against ``simulate``."""
    rng = random.Random(seed)
    chunks = _random_stream(rng, rng.randint(2, 40))
    d = playout.needed_cushion(chunks)
    exact = [(F(a), F(s)) for a, s in chunks]
    for cushion in (0.0, 0.05, 0.1, d / 2, d, d + 0.3, 2.0, 5.0):
        total = sum(s for _, s in playout.stalls(chunks, cushion))
        assert total == pytest.approx(max(0.0, d - cushion), abs=1e-9)
        assert total == pytest.approx(float(sum(s for _, s in simulate(exact, F(cushion)))), abs=1e-9)


def test_a_chunk_due_exactly_when_the_audio_runs_out_is_no_stall():
    chunks = [(0.1, 0.25), (0.35, 0.25), (0.6, 0.5)]
    assert playout.stalls(chunks) == [] and playout.needed_cushion(chunks) == 0.0


def test_a_single_chunk_and_no_chunks():
    assert playout.request_figures([(0.3, 1.0)], 0.3) | {"chunks": None} == {
        "needed_cushion_s": 0.0, "stalls": 0, "stall_s": 0, "longest_stall_s": 0.0, "stall_free_start_s": 0.3,
        "chunks": None}
    assert playout.needed_cushion([]) == 0.0 and playout.stalls([]) == [] and playout.playhead([]) == []


def test_stalls_of_five_ms_or_less_are_not_counted_but_are_in_the_total():
    chunks = [(0.0, 0.1), (0.104, 0.1), (0.3, 0.1)]  # 4 ms late, then 96 ms late
    fig = playout.request_figures(chunks, 0.0)
    assert fig["stalls"] == 1
    assert fig["stall_s"] == pytest.approx(0.1, abs=1e-9) == fig["needed_cushion_s"]


def _levels_streams():
    """Four streams: D 0, 0.08, 0.15, 0.75; longest stalls 0, 0.08, 0.15, 0.25."""
    return [
        [(0.10, 0.25), (0.20, 0.25), (0.30, 0.25)],
        [(0.20, 0.20), (0.48, 0.20), (0.68, 0.20)],
        [(0.30, 0.20), (0.65, 0.20)],
        [(0.40 + 0.5 * k, 0.25) for k in range(4)],
        [(0.5, 1.0)],  # one chunk: not a stream that can stall, left out of the level
    ]


def test_level_figures_on_scripted_streams():
    reqs = []
    for chunks in _levels_streams():
        reqs.append(playout.request_figures(chunks, chunks[0][0]) | {"audio_s": sum(s for _, s in chunks)})
    assert [r["needed_cushion_s"] for r in reqs] == pytest.approx([0.0, 0.08, 0.15, 0.75, 0.0], abs=1e-12)
    assert [r["longest_stall_s"] for r in reqs] == pytest.approx([0.0, 0.08, 0.15, 0.25, 0.0], abs=1e-12)
    lv = playout.level_figures(reqs)
    assert lv["streams"] == 4
    # numpy's linear percentiles of [0, 0.08, 0.15, 0.75]
    assert lv["needed_cushion_s"] == pytest.approx({"p50": 0.115, "p90": 0.57, "p99": 0.732}, abs=1e-12)
    assert lv["stall_free_start_s"] == pytest.approx({"p50": 0.365, "p90": 0.94, "p99": 1.129}, abs=1e-12)
    assert lv["longest_stall_s"]["p50"] == pytest.approx(0.115, abs=1e-12)
    assert (lv["c50"], lv["c100"], lv["c200"]) == (0.25, 0.5, 0.75)
    assert lv["stall_free_share"] == {"0": 0.25, "0.5": 0.75, "1": 1.0, "2": 1.0}
    stall, audio = 0.0 + 0.08 + 0.15 + 0.75, 0.75 + 0.6 + 0.4 + 1.0
    assert lv["rebuffer_ratio"] == pytest.approx(stall / (stall + audio), abs=1e-12)


def test_level_figures_with_no_stream():
    lv = playout.level_figures([])
    assert lv["streams"] == 0 and lv["c100"] is None and lv["rebuffer_ratio"] is None
    assert lv["needed_cushion_s"] == {"p50": None, "p90": None, "p99": None}
    assert lv["stall_free_share"] == {"0": None, "0.5": None, "1": None, "2": None}


def _continuity():
    if importlib.util.find_spec("vllm_omni") is None:
        pytest.skip("vllm-omni is not installed")
    from vllm_omni.benchmarks import audio_continuity  # the published module, imported as shipped

    return audio_continuity


RATE = 44100


def _pcm_stream(rng, n):
    """Chunks as whole 16-bit samples: (arrival, bytes)."""
    t, out = rng.uniform(0.05, 1.0), []
    for _ in range(n):
        out.append((t, 2 * rng.randint(1, 4) * 2048 * rng.choice([1, 6, 8, 12, 16, 24, 32, 64]) // 8))
        t += rng.expovariate(1 / 0.4)
    return out


@pytest.mark.parametrize("seed", range(8))
def test_d_is_vllm_omnis_max_underrun(seed):
    """D equals ``max_underrun_s`` of vLLM-Omni 0.32.0rc1's ``compute_continuity_stats`` on the same
    arrivals; their ``is_continuous`` is D <= 0.1 s."""
    mod = _continuity()
    rng = random.Random(seed)
    stream = _pcm_stream(rng, rng.randint(1, 30))
    arrivals, sizes = [a for a, _ in stream], [b for _, b in stream]
    theirs = mod.compute_continuity_stats(arrivals, sizes, RATE)
    ours = playout.needed_cushion([(a, b / (2 * RATE)) for a, b in stream])
    assert ours == pytest.approx(theirs.max_underrun_s, abs=1e-9)
    assert theirs.is_continuous == (ours <= 0.1)


def test_their_underrun_count_is_not_stalls():
    """vLLM-Omni counts every chunk late against a player that never pauses; a real player
    pauses once here and is in time from then on."""
    mod = _continuity()
    q = RATE // 4 * 2  # 0.25 s of 16-bit mono
    arrivals = [0.0, 0.5, 0.75, 1.0]
    theirs = mod.compute_continuity_stats(arrivals, [q] * 4, RATE)
    fig = playout.request_figures([(a, 0.25) for a in arrivals], 0.0)
    assert theirs.underrun_event_count == 3 and fig["stalls"] == 1
    assert theirs.max_underrun_s == pytest.approx(fig["needed_cushion_s"]) == pytest.approx(0.25)
    # where no stall delays the next, the two counts agree
    arrivals = [0.0, 0.5, 1.0, 1.5]
    theirs = mod.compute_continuity_stats(arrivals, [q] * 4, RATE)
    assert theirs.underrun_event_count == playout.request_figures([(a, 0.25) for a in arrivals], 0.0)["stalls"] == 3


# -- validate's row g ---------------------------------------------------------------------------


def _bench_level(c, streams, failed=()):
    """A ``bench`` level result (the keys row g reads) of scripted streams."""
    reqs = [{"utt": utt, "success": True, "audio_seconds": sum(s for _, s in ch),
             **playout.request_figures(ch, ch[0][0])} for utt, ch in streams.items()]
    return {"max_concurrency": c, "completed": len(reqs), "median_ttft_ms": 100.0, "audio_throughput": 1.0,
            "mean_rtf": 0.5, "failures": [{"utt": u, "error": "boom"} for u in failed], "requests": reqs,
            "playout": playout.level_figures([r | {"audio_s": r["audio_seconds"]} for r in reqs])}


def _run():
    from drama3_patches.tools.validate import deploy, verdict

    return verdict.Run(profile="p", model="m", tp=1, ep=False, compiled=False,
                       scale=deploy.Scale(kv_blocks=20, max_model_len=512, frames=10))


STREAMS = {"line0": [(0.3, 0.25), (0.55, 0.25)],  # on time: D 0
           "line1": [(0.4, 0.25), (0.9, 0.25), (1.4, 0.25)]}  # D 0.5


def test_row_g_reports_the_playout_figures():
    run = _run()
    run.bench([_bench_level(1, STREAMS), _bench_level(2, {"line0": [(0.2, 0.1)]})], 3.0)
    g = run.checks["g"]
    assert g.passed
    assert "c1: TTFA p50 100 ms, 1 audio s/s, RTF 0.5, cushion needed D p50 0.25 s, p99 0.495 s, C100 50% " \
           "(2 stream(s))" in g.detail
    assert "c2: TTFA p50 100 ms, 1 audio s/s, RTF 0.5, no stream of two chunks or more to judge playout" in g.detail
    doc = json.loads(run.json())
    assert doc["bench"][0]["playout"]["needed_cushion_s"]["p99"] == pytest.approx(0.495)
    assert doc["bench"][0]["requests"][1]["needed_cushion_s"] == pytest.approx(0.5)


@pytest.mark.parametrize("cushion, passes", [(None, True), (0.6, True), (0.5, True), (0.4, False), (0.0, False)])
def test_require_stall_free_fails_row_g_unless_every_c1_stream_plays_from_that_cushion(cushion, passes):
    run = _run()
    run.bench([_bench_level(1, STREAMS), _bench_level(2, {"x": [(0.1, 0.1), (5.0, 0.1)]})], 3.0,
              require_stall_free=cushion)
    assert run.checks["g"].passed is passes
    if not passes:
        assert (f"line1 at concurrency 1 needs a 0.500 s cushion, more than --require-stall-free {cushion:g}"
                in run.checks["g"].detail)
        assert "line0 at concurrency 1" not in run.checks["g"].detail  # D 0: stall-free at any cushion
        assert " x at concurrency" not in run.checks["g"].detail  # concurrency 2 is not judged


def test_require_stall_free_without_a_completed_c1_stream_is_no_pass():
    run = _run()
    run.bench([_bench_level(2, STREAMS)], 3.0, require_stall_free=1.0)
    assert not run.checks["g"].passed
    assert "--require-stall-free 1: no completed concurrency-1 stream to judge" in run.checks["g"].detail


def test_require_stall_free_c_is_wall_time_after_the_first_audio_as_its_help_says():
    """C is the player's start delay after the first audio, not seconds of audio buffered: a stream
    of 2 s of audio at once and 1 s more at 3 s needs D = 1 s (a player started at 0 with its 2 s
    buffered would stall), so it passes at C = 1 and fails just below."""
    from drama3_patches.tools import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    opt = next(a for a in sub.choices["validate"]._actions if "--require-stall-free" in a.option_strings)
    assert "C seconds of wall time after its first audio" in opt.help and "buffered" not in opt.help
    stream = {"line1": [(0.5, 2.0), (3.5, 1.0)]}
    for cushion, passes in ((1.0, True), (0.99, False)):
        run = _run()
        run.bench([_bench_level(1, stream)], 1.0, require_stall_free=cushion)
        assert run.checks["g"].passed is passes, (cushion, run.checks["g"].detail)

"""What a listener hears from a streamed request: playout figures from its chunk arrivals.

Pure arithmetic, no I/O. A stream is its chunks as ``(arrival_s, audio_s)`` pairs in arrival
order: when each piece of audio arrived (seconds since the request was sent) and how many
seconds of audio it carries. The player starts at the first audio plus a cushion ``C`` and
plays at real time; when the audio it holds runs out before the next chunk arrives, it stalls
until that chunk arrives and then plays on (it re-anchors: the silence is not made up).

- ``needed_cushion_s`` (D): ``max(0, max_k(arrival_k - arrival_0 - audio received before k))``,
  the smallest cushion that never stalls. It is vLLM-Omni's ``max_underrun_s``
  (``vllm_omni/benchmarks/audio_continuity.py``, ``compute_continuity_stats``).
- With the re-anchoring player the stalls at cushion C add up to ``max(0, D - C)`` exactly:
  each stall pushes every later deadline back by its length, so the total is the largest lead
  left over the cushion.
- ``stalls``: how many times the player at C = 0 falls silent for more than ``STALL_MIN_S``.
  vLLM-Omni's ``underrun_event_count`` is another count: the chunks that arrive after a player
  that never pauses would have run out. A chunk that is late only because an earlier stall
  already delayed the player counts there and not here (4 chunks of 0.25 s at 0, 0.5, 0.75 and
  1 s: their count 3, ``stalls`` 1).
- ``stall_s``: the total silence at C = 0, every stall counted (so that it equals D); the count
  leaves out the ones of 5 ms or less, the total does not.
- ``longest_stall_s``: the longest single silence at C = 0, the figure sglang-omni's
  C50/C100/C200 rank streams by.
"""

from __future__ import annotations

from drama3_patches.tools.bench.stats import percentile

CODEC_RATE = 44100  # Drama 3's DAC
FRAME_SAMPLES = 2048  # one stage-0 step makes one frame of this many samples
FRAME_S = FRAME_SAMPLES / CODEC_RATE  # 46.4 ms of audio per frame
STALL_MIN_S = 0.005  # a shorter silence is not counted as a stall (it still adds to stall_s)
CUSHIONS = (0.0, 0.5, 1.0, 2.0)  # stall_free_share's cushions, seconds
CONTINUITY = {"c50": 0.05, "c100": 0.1, "c200": 0.2}  # sglang-omni's longest-stall bounds
QUANTILES = (50, 90, 99)
_EPS = 1e-9  # float noise: a chunk due exactly when the audio runs out is on time


def needed_cushion(chunks) -> float:
    """D: the smallest cushion with which a player starting at the first audio never stalls."""
    if not chunks:
        return 0.0
    t0 = chunks[0][0]
    received, lead = 0.0, 0.0
    for arrival, audio in chunks:
        lead = max(lead, arrival - t0 - received)
        received += audio
    return lead if lead > _EPS else 0.0


def stalls(chunks, cushion: float = 0.0) -> list[tuple[float, float]]:
    """Every silence of the re-anchoring player that starts at the first audio plus ``cushion``:
    ``(when it began, seconds)``, in order; each one however short."""
    if not chunks:
        return []
    runs_out = chunks[0][0] + cushion  # the playhead starts here, with the first chunk in hand
    out = []
    for arrival, audio in chunks:
        if arrival > runs_out + _EPS:
            out.append((runs_out, arrival - runs_out))
            runs_out = arrival
        runs_out += audio
    return out


def playhead(chunks, cushion: float = 0.0) -> list[tuple[float, float]]:
    """The player's position as ``(wall seconds, audio seconds played)`` corner points: flat
    while it waits (cushion, stalls), a slope of one while it plays."""
    if not chunks:
        return []
    t, played = chunks[0][0], 0.0
    points = [(t, 0.0)]
    runs_out = t + cushion
    for arrival, audio in chunks:
        start = max(arrival, runs_out)
        if start > t:
            points.append((start, played))
        t, played = start + audio, played + audio
        points.append((t, played))
        runs_out = t
    return points


def request_figures(chunks, ttfa: float | None) -> dict:
    """One request's JSON fields. ``chunks``: ``(arrival_s, audio_s)``; ``ttfa``: its first audio."""
    gaps = stalls(chunks)
    d = needed_cushion(chunks)
    return {
        "needed_cushion_s": d,
        "stalls": sum(1 for _, s in gaps if s > STALL_MIN_S),
        "stall_s": sum(s for _, s in gaps),
        "longest_stall_s": max((s for _, s in gaps), default=0.0),
        "stall_free_start_s": None if ttfa is None else ttfa + d,
        "chunks": [[round(a, 6), round(s, 6)] for a, s in chunks],
    }


def _quantiles(values: list[float]) -> dict:
    return {f"p{q}": percentile(values, q) for q in QUANTILES}


def level_figures(requests: list[dict]) -> dict:
    """A level's ``playout`` object from its completed requests' :func:`request_figures` (with
    ``audio_s``). Only streams of more than one chunk count: a single chunk cannot stall."""
    streams = [r for r in requests if len(r["chunks"]) > 1]
    n = len(streams)

    def share(ok) -> float | None:
        return sum(1 for r in streams if ok(r)) / n if n else None

    stall = sum(r["stall_s"] for r in streams)
    audio = sum(r["audio_s"] for r in streams)
    out = {
        "streams": n,
        "needed_cushion_s": _quantiles([r["needed_cushion_s"] for r in streams]),
        "stall_free_start_s": _quantiles([r["stall_free_start_s"] for r in streams
                                          if r["stall_free_start_s"] is not None]),
        "longest_stall_s": _quantiles([r["longest_stall_s"] for r in streams]),
    }
    out |= {key: share(lambda r, b=bound: r["longest_stall_s"] <= b) for key, bound in CONTINUITY.items()}
    out["stall_free_share"] = {f"{c:g}": share(lambda r, c=c: stall_free(r["needed_cushion_s"], c)) for c in CUSHIONS}
    out["rebuffer_ratio"] = stall / (stall + audio) if n and stall + audio > 0 else None
    return out


def stall_free(needed_cushion_s: float, cushion: float) -> bool:
    """Whether a stream whose D is ``needed_cushion_s`` plays without a stall from a ``cushion``."""
    return needed_cushion_s <= cushion + _EPS


def summary(level_playout: dict | None) -> str:
    """A level's playout in a few words (``validate``'s row g)."""
    po = level_playout or {}
    d = po.get("needed_cushion_s") or {}
    if not po.get("streams") or d.get("p50") is None:
        return "no stream of two chunks or more to judge playout"
    return (f"cushion needed D p50 {d['p50']:.3g} s, p99 {d['p99']:.3g} s, C100 {po['c100']:.0%} "
            f"({po['streams']} stream(s))")


def not_stall_free(levels: list[dict], cushion: float | None) -> list[str]:
    """Why the concurrency-1 streams of ``levels`` (``bench`` level results) do not all play
    without a stall from a ``cushion`` (``--require-stall-free``); empty when they do or when no
    cushion is required. No completed concurrency-1 stream is a reason too."""
    if cushion is None:
        return []
    c1 = [r for lv in levels if lv.get("max_concurrency") == 1 for r in lv.get("requests") or []
          if r.get("success")]
    if not c1:
        return [f"--require-stall-free {cushion:g}: no completed concurrency-1 stream to judge"]
    return [f"{r['utt']} at concurrency 1 needs a {r['needed_cushion_s']:.3f} s cushion, more than "
            f"--require-stall-free {cushion:g}" for r in c1 if not stall_free(r["needed_cushion_s"], cushion)]

"""``bench --plot``: audio seconds per second and TTFA p50/p99 against concurrency, as a PNG.

matplotlib is imported here only, and drawn through the Agg canvas (no
display, no pyplot state). ``--reference port`` adds the port's published
table as a grey series; a figure the reference does not publish is left out,
not guessed.

Where the levels carry chunk arrivals (``playout``), two more kinds of panel follow: the CDF
of D (the cushion each stream needs) per level, and per level the audio received against wall
time for its p50, p90 and worst stream by D, each with the playhead of a player that starts at
the first audio (flat where it stalls).
"""

from __future__ import annotations

# The port's published Seed-TTS-Eval English run (2 x 910B1, TP2+EP, 64 lines, seed 42,
# two warm-ups), as docs/recipe.md section 6 prints it; tests check the two agree.
PORT_REFERENCE = {
    "label": "port, published (2x910B1 TP2+EP)",
    "levels": [
        {"max_concurrency": 1, "audio_throughput": 0.569, "median_ttft_ms": 1260.0, "p99_ttft_ms": 1470.0,
         "mean_rtf": 1.79, "wer": 0.0333},
        {"max_concurrency": 16, "audio_throughput": 3.19, "median_ttft_ms": 4140.0, "p99_ttft_ms": 26500.0,
         "mean_rtf": 5.00, "wer": 0.0252},
        {"max_concurrency": 32, "audio_throughput": 4.68, "median_ttft_ms": 5770.0, "p99_ttft_ms": 7830.0,
         "mean_rtf": 5.93, "wer": 0.0205},
        {"max_concurrency": 64, "audio_throughput": 7.20, "median_ttft_ms": 14000.0, "p99_ttft_ms": 14700.0,
         "mean_rtf": 9.20, "wer": 0.0188},
    ],
}
REFERENCES = {"port": PORT_REFERENCE}

RUN_COLOR, REF_COLOR = "tab:blue", "0.55"


def _series(levels: list[dict], key: str, scale: float = 1.0):
    """(concurrency, value) points of the levels that have the figure."""
    pts = [(lv["max_concurrency"], lv.get(key)) for lv in levels]
    pts = [(c, v * scale) for c, v in pts if v is not None]
    return [c for c, _ in pts], [v for _, v in pts]


def build_figure(levels: list[dict], reference: dict | None = None, title: str = ""):
    """The matplotlib Figure: left audio s/s, right TTFA p50 (solid) and p99 (dashed), seconds.

    A figure missing from a series (a level where every request failed, or one
    a reference does not publish) is left out and named in the title.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FixedLocator, FormatStrFormatter, LogLocator, NullLocator, ScalarFormatter

    playing = [lv for lv in levels if _streams(lv)]
    rows = 1 + (len(playing) + 2) // 2 if playing else 1
    fig = Figure(figsize=(11, 4.6 * rows), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    thr, lat = fig.add_subplot(rows, 2, 1), fig.add_subplot(rows, 2, 2)
    groups = [("this run", levels, RUN_COLOR, "o^")]
    if reference:
        groups.append((reference["label"], reference["levels"], REF_COLOR, "sD"))
    missing = []
    for name, lvs, color, markers in groups:
        for ax, key, scale, style, marker, what in ((thr, "audio_throughput", 1.0, "-", markers[0], "audio s/s"),
                                                    (lat, "median_ttft_ms", 1e-3, "-", markers[0], "TTFA p50"),
                                                    (lat, "p99_ttft_ms", 1e-3, "--", markers[1], "TTFA p99")):
            xs, ys = _series(lvs, key, scale)
            if not xs:
                missing.append(f"{name}: no {what}")
                continue
            ax.plot(xs, ys, style, marker=marker, color=color, label=f"{name}: {what}")
    ticks = sorted({lv["max_concurrency"] for _, lvs, _, _ in groups for lv in lvs})
    ttfas = [y for line in lat.get_lines() for y in line.get_ydata() if y > 0]
    # A stand-in server's 0.2 s beside the port's 26 s is a flat line on a linear axis.
    log_ttfa = bool(ttfas) and max(ttfas) / min(ttfas) > 20
    for ax, ylabel, heading in ((thr, "audio seconds per second", "Throughput"),
                                (lat, "time to first audio (s)" + (", log scale" if log_ttfa else ""),
                                 "Time to first audio")):
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_locator(FixedLocator(ticks))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.set_xlabel("concurrency")
        ax.set_ylabel(ylabel)
        ax.set_title(heading)
        if ax is lat and log_ttfa:
            ax.set_yscale("log")
            ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
            ax.yaxis.set_minor_locator(NullLocator())
            ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
        else:
            ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        if ax.get_lines():
            ax.legend(fontsize=8, loc="best")
    if playing:
        _cushion_cdf(fig.add_subplot(rows, 2, 3), playing)
        for i, lv in enumerate(playing):
            _timelines(fig.add_subplot(rows, 2, 4 + i), lv)
    if title or missing:
        fig.suptitle("; ".join(x for x in [title, *missing] if x), fontsize=10)
    return fig


def _streams(level: dict) -> list[dict]:
    """The level's completed requests of more than one chunk, by D."""
    reqs = [r for r in level.get("requests") or [] if r.get("success") and len(r.get("chunks") or []) > 1]
    return sorted(reqs, key=lambda r: r["needed_cushion_s"])


def picked(level: dict) -> list[tuple[str, dict]]:
    """The p50, p90 and worst streams by D (nearest rank), one label per stream drawn."""
    reqs = _streams(level)
    chosen: dict[int, list[str]] = {}
    for name, q in (("p50", 0.5), ("p90", 0.9), ("worst", 1.0)):
        chosen.setdefault(round(q * (len(reqs) - 1)), []).append(name)
    return [("/".join(names), reqs[i]) for i, names in sorted(chosen.items())]


def _cushion_cdf(ax, levels: list[dict]) -> None:
    for lv in levels:
        ds = [r["needed_cushion_s"] for r in _streams(lv)]
        ax.step([0.0, *ds], [0.0, *((i + 1) / len(ds) for i in range(len(ds)))], where="post",
                label=f"concurrency {lv['max_concurrency']} ({len(ds)} streams)")
    ax.set_xlabel("cushion needed, D (s)")
    ax.set_ylabel("share of streams with D at most x")
    ax.set_title("Cushion a player needs to never stall")
    ax.set_ylim(0, 1.02)
    ax.set_xlim(left=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")


def _timelines(ax, level: dict) -> None:
    from drama3_patches.tools.bench import playout

    for (name, req), color in zip(picked(level), ("tab:blue", "tab:orange", "tab:red")):
        chunks = [tuple(c) for c in req["chunks"]]
        xs, ys, got = [0.0], [0.0], 0.0
        for arrival, audio in chunks:
            got += audio
            xs.append(arrival)
            ys.append(got)
        ax.step(xs, ys, where="post", color=color,
                label=f"{name} {req['utt']}: D {req['needed_cushion_s']:.2f} s, {req['stalls']} stall(s)")
        t, played = zip(*playout.playhead(chunks))
        ax.plot(t, played, "--", color=color, linewidth=1)
    ax.set_xlabel("seconds since the request was sent")
    ax.set_ylabel("audio seconds")
    ax.set_title(f"Concurrency {level['max_concurrency']}: received (solid), played from the first audio (dashed)",
                 fontsize=9)
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")


def write_png(path: str, levels: list[dict], reference: dict | None = None, title: str = "") -> None:
    build_figure(levels, reference, title).savefig(path, format="png")

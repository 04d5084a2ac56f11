"""``bench --plot``: audio seconds per second and TTFA p50/p99 against concurrency, as a PNG.

matplotlib is imported here only, and drawn through the Agg canvas (no
display, no pyplot state). ``--reference port`` adds the port's published
table as a grey series; a figure the reference does not publish is left out,
not guessed.
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

    fig = Figure(figsize=(11, 4.6), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    thr, lat = fig.subplots(1, 2)
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
    if title or missing:
        fig.suptitle("; ".join(x for x in [title, *missing] if x), fontsize=10)
    return fig


def write_png(path: str, levels: list[dict], reference: dict | None = None, title: str = "") -> None:
    build_figure(levels, reference, title).savefig(path, format="png")

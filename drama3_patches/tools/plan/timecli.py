"""``plan --time``'s options, its figures and their text (the model: :mod:`.timing`)."""

from __future__ import annotations

import math
from dataclasses import replace

from drama3_patches.tools.bench.plot import PORT_REFERENCE
from drama3_patches.tools.plan import calibrate, timing
from drama3_patches.tools.plan.cards import speed

DEFAULT_LEVELS = (1, 16, 32, 64)


def add_arguments(p) -> None:
    g = p.add_argument_group("time (--time): will it keep up")
    g.add_argument("--time", action="store_true",
                   help="also model stage 0's ms per frame and stage 1's DAC time per level: audio s/s, RTF, "
                        "the bounding term, real-time streams")
    g.add_argument("--concurrency", default="1,16,32,64", help="levels, comma-separated (default 1,16,32,64)")
    g.add_argument("--graph", default=",".join(timing.GRAPHS),
                   help=f"graph paths, comma-separated, of {', '.join(timing.GRAPHS)} (default all)")
    g.add_argument("--card-hbm-gbps", type=float, help="HBM bandwidth in GB/s (default: the card table's)")
    g.add_argument("--launch-us", type=float,
                   help="host cost per launch in us (default: fitted on the port's concurrency-1 figure)")
    g.add_argument("--replay-us", type=float, help="host cost per graph replay in us (default: one launch's)")
    g.add_argument("--link-gbps", type=float, help="card-to-card link in GB/s (default: the card table's)")
    g.add_argument("--context-tokens", type=int, default=512,
                   help="tokens each sequence attends over, on average (default 512)")
    g.add_argument("--norms", choices=("fused", "eager"), default="fused",
                   help="the tower kernels' path: fused (torch-npu's fused norms, the cards' default) or eager")
    g.add_argument("--calibrate", metavar="REPORT_JSON",
                   help="a validate report.json from the cards: its frame_time and bench levels replace the "
                        "port's figures for the fit, and are printed against the model")


def check(args) -> str | None:
    """Why the time options cannot be used, or None."""
    try:
        levels = sorted({int(x) for x in args.concurrency.split(",") if x.strip()})
    except ValueError:
        return f"--concurrency {args.concurrency!r}: give whole numbers, comma-separated"
    if not levels or levels[0] < 1 or levels[-1] > 4096:
        return "--concurrency levels must be between 1 and 4096"
    graphs = [g.strip() for g in args.graph.split(",") if g.strip()]
    bad = [g for g in graphs if g not in timing.GRAPHS]
    if bad or not graphs:
        return f"--graph {args.graph!r}: choose among {', '.join(timing.GRAPHS)}"
    for flag in ("card_hbm_gbps", "link_gbps"):
        v = getattr(args, flag)
        if v is not None and not (math.isfinite(v) and v > 0):
            return f"--{flag.replace('_', '-')} must be a finite number above 0"
    for flag in ("launch_us", "replay_us"):
        v = getattr(args, flag)
        if v is not None and not (math.isfinite(v) and v >= 0):
            return f"--{flag.replace('_', '-')} must be a finite number of us, at least 0"
    if args.context_tokens < 0:
        return "--context-tokens must be at least 0"
    args.time_levels, args.time_graphs = levels, graphs
    return None


def compute(args, ckpt, plan, sums: dict) -> dict:
    """The ``time`` figures: constants (with where each came from), levels, real-time streams, the fit."""
    card = plan.options.card
    spec = speed(card)
    if spec is None and (args.card_hbm_gbps is None or args.link_gbps is None):
        raise timing.PlanError(f"--time: no speed figures for card {card.name}: give --card-hbm-gbps and "
                               "--link-gbps (and --launch-us)")
    base = timing.Constants(
        hbm_gbps=args.card_hbm_gbps or spec.hbm_gbps, bf16_tflops=spec.bf16_tflops if spec else math.inf,
        fp32_tflops=spec.fp32_tflops if spec else math.inf, link_gbps=args.link_gbps or spec.link_gbps,
        link_latency_us=spec.link_latency_us if spec else 0.0, launch_us=0.0, replay_us=0.0)
    wl = timing.Workload(context_tokens=args.context_tokens, dac_chunk_frames=64, dac_left_context=32,
                         norms=args.norms)
    inputs = timing.step_inputs(ckpt, plan, sums)
    report = calibrate.read_report(args.calibrate) if args.calibrate else None
    measured = report["levels"] if report else PORT_REFERENCE["levels"]
    fit = None
    # the path the measurement ran: the port's eager; a validate report's stage 0 compiled or not
    measured_graph = "piecewise" if report and report["stage0"].get("compiled") else "eager"
    if args.launch_us is not None:
        launch_us, source = args.launch_us, "--launch-us"
    else:
        frame_ms = calibrate.measured_frame_ms(report) if report else calibrate.c1_frame_ms(measured)
        launch_us = calibrate.fit_launch_us(inputs, base, wl, frame_ms, measured_graph)
        source = (f"fitted on {args.calibrate}'s concurrency-1 frame time ({frame_ms:.1f} ms)" if report else
                  f"fitted on the port's concurrency-1 figure (0.569 audio s/s: {frame_ms:.1f} ms per frame, "
                  "eager, 2 x 910B1 TP2+EP)")
        fit = {"frame_ms": frame_ms, "launch_us": launch_us, "source": source, "graph": measured_graph}
    k = replace(base, launch_us=launch_us, replay_us=args.replay_us if args.replay_us is not None else launch_us)
    levels = [timing.frame_time(inputs, n, g, k, wl) for g in args.time_graphs for n in args.time_levels]
    by_n = {lv["max_concurrency"]: lv["audio_throughput"] for lv in measured}
    for lv in levels:
        if lv["graph"] == measured_graph and lv["concurrency"] in by_n:
            m = by_n[lv["concurrency"]]
            lv["measured_audio_s_per_s"] = m
            lv["error"] = lv["audio_s_per_s"] / m - 1
    dac_dev, dac_host = timing.dac_ms_per_audio_s(inputs.dac, k, wl)
    constants = {name: (None if isinstance(v, float) and math.isinf(v) else v) for name, v in k.__dict__.items()}
    out = {
        "constants": {**constants, "launch_us_source": source, "card_sources": list(spec.sources) if spec else []},
        "workload": wl.__dict__, "levels": levels,
        "realtime_streams": {g: timing.realtime_streams(inputs, g, k, wl) for g in args.time_graphs},
        "fit": fit, "measured_source": args.calibrate or PORT_REFERENCE["label"],
        "dac": None if inputs.dac is None else {**inputs.dac, "device_ms_per_audio_s": dac_dev,
                                                 "host_ms_per_audio_s": dac_host},
    }
    if report:
        out["calibration"] = {"frame_time": report["frame_time"], "graph": measured_graph,
                              "modelled": calibrate.modelled_profile_components(inputs, k, wl, measured_graph)}
    return out


def _f(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:.3g}" if x < 10 else f"{x:.1f}"


def _pct(x: float) -> str:
    return f"{x:+.0%}" if abs(x) >= 0.005 else "0%"


def print_text(t: dict) -> None:
    from drama3_patches.tools.report import table

    k = t["constants"]
    print()
    print(f"time per frame (a frame is {timing.FRAME_MS:.1f} ms of audio); step = max(host, device), they overlap")
    rate = {name: "not given" if k[name] is None else f"{k[name]:g}" for name in ("bf16_tflops", "fp32_tflops")}
    print(f"  HBM {k['hbm_gbps']:g} GB/s, bf16 {rate['bf16_tflops']} TFLOPS, fp32 {rate['fp32_tflops']} TFLOPS, "
          f"link {k['link_gbps']:g} GB/s; {k['launch_us']:.2f} us per launch ({k['launch_us_source']}), "
          f"{k['replay_us']:.2f} us per replay; context {t['workload']['context_tokens']} tokens, "
          f"{t['workload']['norms']} norms")
    head = ["graph", "conc", "ms/frame", "audio s/s", "RTF", "bound"] + list(timing.COMPONENTS) + ["measured", "error"]
    rows = []
    for lv in t["levels"]:
        c = lv["components_ms"]
        rows.append([lv["graph"], str(lv["concurrency"]), _f(lv["ms_per_frame"]), _f(lv["audio_s_per_s"]),
                     _f(lv["rtf"]), lv["bound"]] + [_f(c[n]) for n in timing.COMPONENTS]
                    + ([_f(lv["measured_audio_s_per_s"]), _pct(lv["error"])] if "error" in lv else ["", ""]))
    print(table(rows, head, indent="  "))
    print("  real-time streams (frame time within 46.4 ms): "
          + ", ".join(f"{g} {n}" for g, n in t["realtime_streams"].items()))
    off = [lv for lv in t["levels"] if "error" in lv and not 0.5 <= 1 + lv["error"] <= 2]
    if off:
        levels = ", ".join(str(lv["concurrency"]) for lv in off)
        print(f"  note: off by more than a factor of two at concurrency {levels}"
              ": the model has no term for what grows with the requests outside a frame's launches and bytes: "
              "prefill and admission (the measured audio s/s includes the time to first audio) and per-request "
              "host work per step (scheduler, runner, model state, the stage-1 connector); no constant closes it")
    if t["dac"]:
        d = t["dac"]
        print(f"  stage 1 (DAC, {d['dtype']}): {d['flops_per_audio_s'] / 1e9:.1f} GFLOP per audio s, "
              f"{d['launches_per_chunk']} launches per chunk; {_f(d['device_ms_per_audio_s'])} ms device and "
              f"{_f(d['host_ms_per_audio_s'])} ms host per audio s")
    cal = t.get("calibration")
    if cal:
        ft = cal["frame_time"] or {}
        comps = ft.get("components_ms") or {}
        rows = [[name, _f(comps[name]) if isinstance(comps.get(name), (int, float)) else "-", _f(value)]
                for name, value in cal["modelled"].items() if name not in ("step", "device")]
        step = (ft.get("step_ms") or {}).get("p50")
        rows.append(["step (p50)", _f(step) if isinstance(step, (int, float)) else "-", _f(cal["modelled"]["step"])])
        print(f"  measured against modelled at concurrency 1 ({cal['graph']}), ms per step, "
              f"from {t['measured_source']}:")
        print(table(rows, ["component", "measured", "modelled"], indent="    "))

"""The one constant no public source gives, the host's cost per launch, fitted on one measurement.

:func:`fit_launch_us` reads only the concurrency-1 level of the measured levels (the port's
published figures by default, ``validate``'s report with ``--calibrate``): the eager step time
that makes the model's concurrency-1 frame time equal the measured one. The other levels are
then predictions, printed beside their measurements. :func:`read_report` takes a validate
``report.json``: its bench levels and its ``frame_time`` (the cards' own step and components).
"""

from __future__ import annotations

from dataclasses import replace

from drama3_patches.tools.files import MIB, InputError
from drama3_patches.tools.plan import inputs as plan_inputs
from drama3_patches.tools.plan import launch_table
from drama3_patches.tools.plan.timing import DEVICE_TERMS, FRAME_MS, frame_time, host_launches

MAX_REPORT_BYTES = 256 * MIB  # a report keeps every request's chunks: megabytes


class FitError(ValueError):
    pass


def c1_frame_ms(levels: list) -> float:
    """The measured frame time at concurrency 1 (46.4 ms / its audio s/s); reads no other level."""
    row = next((lv for lv in levels if lv.get("max_concurrency") == 1), None)
    if row is None or not row.get("audio_throughput"):
        raise FitError("no concurrency-1 level with an audio throughput to fit the launch cost on")
    return FRAME_MS / float(row["audio_throughput"])


def fit_launch_us(inputs, k, wl, frame_ms: float, graph: str = "eager") -> float:
    """The per-launch host cost (us) that makes the model's concurrency-1 step ``frame_ms``.

    The step is max(host, device); host is launches x cost (+ replays x cost, the replay cost
    taken equal to a launch's). When the device alone already takes longer, no host cost fits."""
    probe = frame_time(inputs, 1, graph, replace(k, launch_us=0.0, replay_us=0.0), wl)
    if probe["device_ms"] >= frame_ms:
        raise FitError(f"the modelled device time at concurrency 1 ({probe['device_ms']:.1f} ms) is already over "
                       f"the measured {frame_ms:.1f} ms: no host cost fits; a device term is overestimated")
    launches, replays = host_launches(graph, 1, inputs, wl.norms)
    return 1e3 * frame_ms / (launches + replays)


def read_report(path: str) -> dict:
    """``{"levels": [...], "frame_time": {...} or None}`` from a validate report.json."""
    data = plan_inputs.load_json(path, MAX_REPORT_BYTES, "validate report")
    if not isinstance(data, dict):
        raise InputError(f"{path}: not a validate report (a JSON object with bench and frame_time)")
    levels = data.get("bench") or []
    if not isinstance(levels, list) or not all(isinstance(lv, dict) for lv in levels):
        raise InputError(f"{path}: bench is not a list of levels")
    rows = []
    for lv in levels:
        n = lv.get("max_concurrency")
        a = lv.get("audio_throughput")
        if isinstance(n, int) and not isinstance(n, bool) and isinstance(a, (int, float)) and a > 0:
            rows.append({"max_concurrency": n, "audio_throughput": float(a)})
    ft = data.get("frame_time")
    if not isinstance(ft, dict) or not isinstance(ft.get("step_ms"), dict):
        ft = None
    return {"levels": rows, "frame_time": ft, "stage0": data.get("stage0") or {}}


def measured_frame_ms(report: dict) -> float:
    """The cards' concurrency-1 frame time: frame_time's p50 step when profiled, else bench's c1 level."""
    ft = report.get("frame_time")
    p50 = (ft or {}).get("step_ms", {}).get("p50")
    if isinstance(p50, (int, float)) and p50 > 0:
        return float(p50)
    return c1_frame_ms(report["levels"])


def modelled_profile_components(inputs, k, wl, graph: str = "eager") -> dict:
    """The model's step at concurrency 1 in the profiler's components (validate's frame_time):
    each the larger of its launches' host time and its device time, as they overlap."""
    counts = launch_table.at_batch(wl.norms, 1)
    level = frame_time(inputs, 1, graph, k, wl)
    comp = level["components_ms"]
    us = k.launch_us / 1e3
    backbone_host = sum(counts[c] for c in launch_table.BACKBONE) * us
    if graph != "eager":
        backbone_host = (inputs.num_layers * 2) * us + (inputs.num_layers + 1) * k.replay_us / 1e3
    backbone_dev = sum(comp[t] for t in ("weights", "experts", "kv", "collectives"))
    tower_host = sum(counts[c] for c in launch_table.TOWER[:3]) * us
    return {
        "backbone": max(backbone_host, backbone_dev),
        "tower": max(tower_host, comp["tower"]),
        "sampler": counts["sampler"] * us,
        "other": sum(counts[c] for c in launch_table.GLUE) * us,
        "outside_forward": counts[launch_table.OUTSIDE_NAME] * us,
        "step": level["step_ms"],
        "device": sum(comp[t] for t in DEVICE_TERMS),
    }

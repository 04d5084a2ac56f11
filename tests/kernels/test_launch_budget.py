"""Launch budgets of the tower's and sampler's eager kernels, counted per call (``support.launches``).

Off CUDA each aten op is one host dispatch (on Ascend, roughly 10-40 us of host time), so the
count per call is the kernel's cost floor in eager mode. Counts are deterministic: the budgets
below are the counts, at the published tower shapes and argument kinds (``support.tower_calls``),
in the steady state (after a first call has prepared the float32 ``1 + w`` weights).

Before the launch work the same calls counted (batch 1 and 64 alike): fused QK 45, norm 10,
norm + residual 13, norm table 17, tower mix 29, sigmoid gate 4, draw 27; 1,635 per frame.
"""

from __future__ import annotations

import pytest

from support.tiers import TORCH_ABSENT

torch = pytest.importorskip("torch", reason=TORCH_ABSENT)
from support.launches import LaunchCounter, count  # noqa: E402
from support.tower_calls import CALLS_PER_FRAME, tower_calls  # noqa: E402

# launches per call: (batch 1, batch 64); q and k come back as views of one buffer at batch 1
PER_CALL = {
    "fused_qk_rmsnorm_rope_gate": (13, 15),
    "gemma_rms_norm": (6, 6),
    "gemma_rms_norm+residual": (8, 8),
    "gemma_rms_norm_table": (11, 11),
    "tower_mix_norm": (17, 17),
    "sigmoid_gate": (3, 3),
    "draw_top_k_top_p+shared_top": (19, 19),
    "draw_top_k_top_p": (19, 19),
}
PER_FRAME = {1: 852, 64: 878}


@pytest.fixture(scope="module", params=[1, 64], ids=["batch1", "batch64"])
def counted(request):
    batch = request.param
    out = {}
    for name, (kernel, args, kwargs) in tower_calls(batch).items():
        kernel(*args, **kwargs)  # first call: prepares the weights
        out[name] = count(kernel, *args, **kwargs)
    return batch, out


def test_every_tower_call_is_counted():
    assert set(PER_CALL) == set(CALLS_PER_FRAME) == set(tower_calls(1))


@pytest.mark.parametrize("name", sorted(PER_CALL))
def test_launches_per_call_within_budget(counted, name):
    batch, counts = counted
    budget = PER_CALL[name][0 if batch == 1 else 1]
    assert counts[name].launches <= budget, (batch, name, dict(counts[name].by_op))


def test_launches_per_frame_within_budget(counted):
    batch, counts = counted
    frame = sum(counts[name].launches * calls for name, calls in CALLS_PER_FRAME.items())
    assert frame <= PER_FRAME[batch], frame


def test_no_host_sync_in_any_call(counted):
    _, counts = counted
    assert {name: c.sync_ops for name, c in counts.items() if c.syncs} == {}


def test_counter_sees_syncs_views_and_casts():
    """The counter tells host syncs, views and launches apart, so the budgets above can fail."""
    x = torch.randn(4, 8)
    with torch.inference_mode(), LaunchCounter() as c:
        x[:, :2].unsqueeze(0)                 # views
        x.to(torch.bfloat16)                  # a cast: a launch
        x.to(torch.float32)                   # the same tensor: no launch
        (x > 0).any().item()                  # gt, any: launches; item: a sync
        x.nonzero()                           # a sync
        x[x > 0]                              # boolean indexing: a sync
    assert c.counts.launches == 4 and c.counts.by_op["_to_copy"] == 1, dict(c.counts.by_op)
    assert c.counts.syncs == 3, c.counts.sync_ops
    assert c.counts.views >= 2


def test_prepared_weight_follows_in_place_changes():
    """The float32 ``1 + w`` prepared at the first call is rebuilt when the weight changes in place."""
    from drama3_patches.kernels.norms import gemma_rms_norm

    x, w = torch.randn(3, 16), torch.zeros(16)
    first = gemma_rms_norm(x, w, 1e-6)
    w.add_(1.0)  # 1 + w doubles
    second = gemma_rms_norm(x, w, 1e-6)
    assert torch.equal(second, first * 2)
    other = torch.ones(16)  # a different weight of the same values
    assert torch.equal(gemma_rms_norm(x, other, 1e-6), second)

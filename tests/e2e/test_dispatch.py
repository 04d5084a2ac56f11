"""Ops per decode frame in vLLM-Omni's real engine (``support.dispatch``, ``benchmarks/dispatch.py``):
the codebook tower's and frame sampler's launches within issue 23's budget, every kernel call seen,
no host sync inside the model's forward.

The tier's fused counting run (conftest.counted_runs: the engine on a published-depth tiny
checkpoint, platform forced to npu, whose decode steps at batch 1 are read here), with torch-npu's
two fused norms stood in by one-op CPU implementations (``DRAMA3_E2E_FUSED_STANDIN``: their
arithmetic is not torch-npu's, their count is what an NPU with them dispatches). The CPU's eager
path is held per call by tests/kernels/test_launch_budget.py; its engine figures (988 / 1,027
launches per frame at batch 1 / 64) are ``nox -s dispatch``'s.
"""

from __future__ import annotations

import pytest

from support import dispatch, fused_path
from support.tower_calls import CALLS_PER_FRAME

pytestmark = pytest.mark.e2e

torch = pytest.importorskip("torch")
from support.fused_standin import STAND_IN  # noqa: E402
from support.launches import count  # noqa: E402
from support.tower_calls import tower_calls  # noqa: E402


@pytest.fixture(scope="module")
def fused(counted_runs):
    return counted_runs["fused"][1]


def _by_kernel(per_call: dict) -> dict:
    out: dict = {}
    for name, calls in CALLS_PER_FRAME.items():
        kernel = name.partition("+")[0]
        out[kernel] = out.get(kernel, 0) + per_call[name] * calls
    return out


def _kernel_level_launches(monkeypatch) -> dict:
    """Each kernel's launches per frame on the same path, counted call by call at the published
    width (as the kernel tier counts them), summed over the frame's calls."""
    from drama3_patches.kernels import npu_fused

    monkeypatch.setattr(npu_fused, "fused_norms", lambda device: STAND_IN)
    per_call = {}
    for name, (kernel, args, kwargs) in tower_calls(1).items():
        kernel(*args, **kwargs)  # prepares the weights
        per_call[name] = count(kernel, *args, **kwargs).launches
    return _by_kernel(per_call)


def test_tower_and_sampler_launches_per_frame_within_700_at_batch_1(fused):
    assert fused["identical"], "decode steps dispatched different ops in the forward"
    launches = dispatch.total(fused["components"], dispatch.TOWER_AND_SAMPLER)
    assert launches <= dispatch.BUDGET, (launches, fused["components"])


def test_engine_makes_every_tower_kernel_call_and_each_costs_its_kernel_level_count(fused, monkeypatch):
    """The engine's calls per frame are the tower's (so nothing escaped the counter), and each
    kernel's launches in the engine equal its calls counted one by one at the published width."""
    kernels = dispatch.tower_kernels(fused)
    assert {k: v.get("calls", 0) for k, v in kernels.items()} == _by_kernel(dict.fromkeys(CALLS_PER_FRAME, 1))
    launches = {k: v.get("launches", 0) for k, v in kernels.items()}
    assert launches == _kernel_level_launches(monkeypatch)
    assert sum(launches.values()) <= fused_path.PER_FRAME[1]


def test_no_host_sync_inside_the_forward(fused):
    inside = [s for s in fused["syncs"] if s["component"] not in dispatch.OUTSIDE_FORWARD]
    assert inside == []
    assert all(row.get("syncs", 0) == 0 for row in fused["kernels"].values())

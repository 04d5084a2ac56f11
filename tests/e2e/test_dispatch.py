"""Ops per decode frame in vLLM-Omni's real engine (``support.dispatch``, ``benchmarks/dispatch.py``):
the codebook tower's and frame sampler's launches within their budgets, every kernel call seen,
no host sync inside the model's forward.

Two engines on a published-depth tiny checkpoint, platform forced to npu: the eager path as this
host runs it (batch 1 and 64), and the same engine with torch-npu's two fused norms stood in by
one-op CPU implementations (``DRAMA3_E2E_FUSED_STANDIN``; the ops' arithmetic is not torch-npu's,
their count is what an NPU would dispatch), held to the issue's 700 launches per frame at batch 1.
"""

from __future__ import annotations

import pytest

from support import dispatch, fused_path
from support import e2e_pipeline as ep
from support.subproc import call
from support.tower_calls import CALLS_PER_FRAME

pytestmark = pytest.mark.e2e

torch = pytest.importorskip("torch")
from support.launches import count  # noqa: E402
from support.tower_calls import tower_calls  # noqa: E402


@pytest.fixture(scope="module")
def published_model(tmp_path_factory):
    reason = ep.problem()
    if reason:
        pytest.skip(reason)
    d = tmp_path_factory.mktemp("published_depth")
    return call(dispatch.write_published_model, str(d), env=ep.env(patches=False), pythonpath=[ep.SITE], timeout=900)


@pytest.fixture(scope="module")
def eager(published_model, tmp_path_factory):
    run = dispatch.measure(tmp_path_factory.mktemp("dispatch_eager"), batches=(1, 64), frames=3,
                           model=published_model)
    return {b: dispatch.summarize(run["steps"], b) for b in (1, 64)}


@pytest.fixture(scope="module")
def fused(published_model, tmp_path_factory):
    run = dispatch.measure(tmp_path_factory.mktemp("dispatch_fused"), batches=(1,), frames=3,
                           model=published_model, DRAMA3_E2E_FUSED_STANDIN="1")
    return dispatch.summarize(run["steps"], 1)


def _calls_by_kernel() -> dict:
    out: dict = {}
    for name, calls in CALLS_PER_FRAME.items():
        kernel = name.partition("+")[0]
        out[kernel] = out.get(kernel, 0) + calls
    return out


@pytest.mark.parametrize("batch", [1, 64])
def test_eager_tower_and_sampler_launches_per_frame_within_budget(eager, batch):
    summary = eager[batch]
    assert summary["identical"], "decode steps of one batch size dispatched different ops in the forward"
    launches = dispatch.total(summary["components"], dispatch.TOWER_AND_SAMPLER)
    assert launches <= dispatch.EAGER_BUDGET[batch], (launches, summary["components"])


def _kernel_level_launches(batch: int) -> dict:
    """Each kernel's launches per frame counted call by call at the published shapes (as the
    kernel tier counts them), summed over the frame's calls."""
    out: dict = {}
    for name, (kernel, args, kwargs) in tower_calls(batch).items():
        kernel(*args, **kwargs)  # prepares the weights
        per_call = count(kernel, *args, **kwargs).launches
        out[name.partition("+")[0]] = out.get(name.partition("+")[0], 0) + per_call * CALLS_PER_FRAME[name]
    return out


@pytest.mark.parametrize("batch", [1, 64])
def test_engine_makes_every_tower_kernel_call_and_each_costs_its_kernel_level_count(eager, batch):
    """The engine's calls per frame are the tower's (so nothing escaped the counter), and each
    kernel's launches in the engine equal its calls counted one by one at the published width."""
    kernels = dispatch.tower_kernels(eager[batch])
    assert {k: v.get("calls", 0) for k, v in kernels.items()} == _calls_by_kernel()
    assert {k: v.get("launches", 0) for k, v in kernels.items()} == _kernel_level_launches(batch)


@pytest.mark.parametrize("batch", [1, 64])
def test_no_host_sync_inside_the_forward(eager, batch):
    summary = eager[batch]
    inside = [s for s in summary["syncs"] if s["component"] not in dispatch.OUTSIDE_FORWARD]
    assert inside == []
    assert all(row.get("syncs", 0) == 0 for row in summary["kernels"].values())


def test_fused_norm_standins_bring_tower_and_sampler_within_700_launches_at_batch_1(fused):
    assert fused["identical"]
    launches = dispatch.total(fused["components"], dispatch.TOWER_AND_SAMPLER)
    assert launches <= dispatch.BUDGET, (launches, fused["components"])
    kernels = sum(v.get("launches", 0) for v in dispatch.tower_kernels(fused).values())
    assert kernels == fused_path.PER_FRAME[1], fused["kernels"]

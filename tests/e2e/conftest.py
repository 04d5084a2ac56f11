"""The e2e tier (`nox -s e2e`): one tiny published-format checkpoint per run, shared by its tests,
one offline engine whose phases several tests read, and one pair of counting engine runs on the
published-depth checkpoint that the dispatch budget and the launch table both read (each engine
start costs a minute or two on a 2-core host)."""

from __future__ import annotations

import json

import pytest

from support import e2e_pipeline as ep
from support.subproc import call



@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    return ep.tiny_model(tmp_path_factory)


@pytest.fixture(scope="session")
def npu_engine(model_dir, tmp_path_factory):
    """vLLM-Omni's ``Omni`` at TP1 with the platform forced to npu (so every npu patch that can
    apply on this host does: preemption-host-copy, gdn-backbone-ascend, the tensor-parallel pair),
    one ``generate`` per phase of ``ep.NPU_PHASES``, in order. Returns the outputs by phase name, the
    engine's output and its report folder."""
    tmp = tmp_path_factory.mktemp("npu_engine")
    deploy = ep.write_deploy(tmp / "deploy.yaml", **ep.NPU_DEPLOY)
    reports = tmp / "reports"
    run = call(ep.offline_child, model_dir, str(deploy), list(ep.NPU_PHASES.values()),
               env=ep.env(platform="npu", report_dir=reports), pythonpath=[ep.SITE], timeout=1800,
               with_output=True)
    result = run["result"]
    print(json.dumps(result, indent=1))
    return {"start_s": result["start_s"], "log": run["output"], "reports": reports,
            "phases": dict(zip(ep.NPU_PHASES, result["phases"]))}


@pytest.fixture(scope="session")
def counted_runs(tmp_path_factory):
    """``support.dispatch`` on the published-depth tiny checkpoint, platform forced to npu, one
    engine per variant, decoding at each batch size of the launch table: ``eager`` (the tower kernels' eager
    path) and ``fused`` (torch-npu's two fused norms stood in, ``DRAMA3_E2E_FUSED_STANDIN``).
    Returns ``{variant: {batch: support.dispatch.summarize(...)}}``; skipped where the tier cannot run."""
    from drama3_patches.tools.plan.launch_table import BATCHES  # the table's batch sizes: 1 and 64
    from support import dispatch

    reason = ep.problem()
    if reason:
        pytest.skip(reason)
    work = tmp_path_factory.mktemp("counted")
    model = call(dispatch.write_published_model, str(work / "model"), env=ep.env(patches=False),
                 pythonpath=[ep.SITE], timeout=900)
    out = {}
    for variant, extra in (("eager", {}), ("fused", {"DRAMA3_E2E_FUSED_STANDIN": "1"})):
        run = dispatch.measure(work / variant, batches=BATCHES, frames=3, model=model, **extra)
        out[variant] = {b: dispatch.summarize(run["steps"], b) for b in BATCHES}
    return out

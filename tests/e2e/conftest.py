"""The e2e tier (`nox -s e2e`): one tiny published-format checkpoint per run, shared by its tests,
and one offline engine whose phases several tests read (each engine start costs a minute or two
on a 2-core host)."""

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

"""Compiled mode: the same pipeline with stage 0 left to vLLM's compilation (no ``enforce_eager``).

On CPU vLLM compiles the whole model as one Dynamo graph (``DYNAMO_TRACE_ONCE``, platforms/cpu.py)
with ``fullgraph=True`` (compilation/wrapper.py): a graph break anywhere in the patched forward
(backbone, codebook tower, frame sampler, the eager kernels the patches install) fails the run.
``VLLM_CPU_CI_ENV=1`` runs the captured graph with Dynamo's eager backend instead of Inductor's
C++ code generation, which takes minutes on a 2-core host: graph capture is what this checks.

The platform is forced to npu, so the patches an Ascend stage 0 runs are the ones traced: the
eager tower and sampler kernels (tower-sampler-eager) and vLLM's GDN layer (gdn-backbone-ascend)
inside the forward. Outside the traced forward, so not checked here: preemption-host-copy and the
tensor-parallel patches' hooks (model state, constructor), and at TP1 the split tower's all-reduce
(fish-omni-tower-tp-split applies at TP > 1 only).
"""

from __future__ import annotations

import json

import pytest

from support import e2e_pipeline as ep
from support.subproc import call

pytestmark = pytest.mark.e2e

PHASES = [{"max_tokens": 8, "seed": 7, "requests": [{"text": "Compiled, not eager."}]}]


def test_compiled_stage0_with_the_npu_patches_runs_without_graph_breaks(model_dir, tmp_path):
    deploy = ep.write_deploy(tmp_path / "deploy.yaml", eager=False)
    reports = tmp_path / "reports"
    run = call(ep.offline_child, model_dir, str(deploy), PHASES,
               # a fresh trace (no AOT artifact from an earlier run); Dynamo's own log of it
               env=ep.env(platform="npu", report_dir=reports, VLLM_CPU_CI_ENV="1", VLLM_DISABLE_COMPILE_CACHE="1",
                          TORCH_LOGS="graph_breaks,dynamo"),
               pythonpath=[ep.SITE], timeout=1200,
               with_output=True)
    result, log = run["result"], run["output"]
    print(json.dumps(result, indent=1))
    (out,) = result["phases"][0]["outputs"]
    assert 0 < out["frames"] <= 8 and out["samples"] == out["frames"] * ep.CODEC_HOP
    assert "Graph break" not in log
    # it did compile: Dynamo traced the model
    assert "torchdynamo done tracing" in log, "stage 0 ran without compiling"
    # the patches of the traced forward were in place in the process that compiled it
    applied = ep.applied_patches(reports)
    assert {"tower-sampler-eager", "gdn-backbone-ascend"} <= set(applied), applied

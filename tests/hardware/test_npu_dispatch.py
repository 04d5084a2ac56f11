"""Ops per decode frame on the cards (``pytest -m npu``): the engine-level check of issue 23's budget.

The e2e tier counts the real engine on a CPU host, where torch-npu's fused norms are one-op
stand-ins and vLLM's layers run their CPU paths (tests/e2e/test_dispatch.py). Here the same probe
(tests/e2e/site/e2e_dispatch.py, on ``PYTHONPATH``; its CPU-tier hooks stay off) counts vLLM-Omni's
engine on the 910B TP2+EP profile (``DRAMA3_NPU_DEPLOY`` picks another deploy file) in eager mode,
with the real torch-npu: the codebook tower and frame sampler must stay within 700 launches per
decode frame at batch 1, this project's kernels within the fused path's budget
(``support.fused_path``), and nothing inside the model's forward may sync with the host.

Model: ``DRAMA3_NPU_MODEL``, or a published-depth tiny checkpoint made on the spot (the counts do
not depend on width). Rank 0's steps are the ones read.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from drama3_patches.tools.deploy_config import profiles
from support import dispatch, fused_path

pytestmark = pytest.mark.npu

DEPLOY = os.environ.get("DRAMA3_NPU_DEPLOY") or str(profiles.profile_file("910b-tp2-ep"))
BATCHES = (1, 64)


def _eager_deploy(path) -> str:
    """The deploy file, stage 0 eager (the mode whose dispatch is counted) and sized for the batches."""
    deploy = yaml.safe_load(open(DEPLOY, encoding="utf-8"))
    ar = deploy["stages"][0]
    ar.update(enforce_eager=True, max_model_len=512, max_num_seqs=max(BATCHES),
              max_num_batched_tokens=512 * max(BATCHES))
    path.write_text(yaml.safe_dump(deploy, sort_keys=False))
    return str(path)


@pytest.fixture(scope="module")
def counted(tmp_path_factory):
    work = tmp_path_factory.mktemp("npu_dispatch")
    model = os.environ.get("DRAMA3_NPU_MODEL")
    if not model:
        model = str(work / "model")
        subprocess.run([sys.executable, "-m", "drama3_patches.tools", "tiny-model", model, "--depth", "published"],
                       check=True, timeout=900)
    run = dispatch.measure(work, batches=BATCHES, frames=3, model=model, deploy=_eager_deploy(work / "deploy.yaml"),
                           timeout=3600)
    return {b: dispatch.summarize(run["steps"], b) for b in BATCHES}


def test_tower_and_sampler_launches_per_frame_on_the_card_within_700_at_batch_1(counted):
    summary = counted[1]
    assert summary["identical"], "decode steps dispatched different ops in the forward"
    launches = dispatch.total(summary["components"], dispatch.TOWER_AND_SAMPLER)
    assert launches <= dispatch.BUDGET, (launches, summary["components"], summary["by_op"])


@pytest.mark.parametrize("batch", BATCHES)
def test_the_kernels_take_the_fused_path_within_its_budget_on_the_card(counted, batch):
    kernels = dispatch.tower_kernels(counted[batch])
    assert sum(v.get("calls", 0) for v in kernels.values()) == sum(fused_path.CALLS_PER_FRAME.values())
    assert sum(v.get("launches", 0) for v in kernels.values()) <= fused_path.PER_FRAME[batch], kernels


@pytest.mark.parametrize("batch", BATCHES)
def test_no_host_sync_inside_the_forward_on_the_card(counted, batch):
    inside = [s for s in counted[batch]["syncs"] if s["component"] not in dispatch.OUTSIDE_FORWARD]
    assert inside == []

"""Preemption under vLLM's real scheduler, with the platform forced to npu so that
``preemption-host-copy`` and ``gdn-backbone-ascend`` apply: a KV cache of 16 blocks (512 tokens,
two full-length requests) makes three growing requests preempt one another; the preempted one
resumes from its frame history and every request ends with all its frames, each decoded to its
2048 samples, none lost or repeated across the resume.

Frame equality with an unpreempted run is not asserted here: on this CPU stack a request's frames
already depend on the batch it runs in (the same seeded request alone and in a batch of four
differ with nothing preempted), so a preempted request, recomputed in other batches, cannot be
compared token for token. The closing note of the tier records the measured comparison.
"""

from __future__ import annotations

import json

import pytest

from support import e2e_pipeline as ep
from support.subproc import call

pytestmark = pytest.mark.e2e

FRAMES = 48  # ~100 prompt rows + 48 frames: each request grows past its first 128-token block
PHASES = [{"max_tokens": FRAMES, "seed": 99, "requests": [
    {"text": "A request that is preempted and resumed."}, {"text": "Another voice in the same batch."},
    {"text": "A third one."}]}]


def test_preempted_requests_resume_with_every_frame(model_dir, tmp_path):
    deploy = ep.write_deploy(tmp_path / "deploy.yaml", max_model_len=256, kv_blocks=16)
    reports = tmp_path / "reports"
    run = call(ep.offline_child, model_dir, str(deploy), PHASES, env=ep.env(platform="npu", report_dir=reports),
               pythonpath=[ep.SITE], timeout=1200, with_output=True)
    result, log = run["result"], run["output"]
    print(json.dumps(result, indent=1))
    count = ep.preemptions(log)
    print(f"preemptions: {count}")
    assert count > 0, "nothing was preempted: the KV cache is not small enough"
    for out in result["phases"][0]["outputs"]:
        assert (out["frames"], out["ar_finish"]) == (FRAMES, "length"), out
        assert out["samples"] == FRAMES * ep.CODEC_HOP and out["finite"], out
    applied = ep.applied_patches(reports)
    assert {"preemption-host-copy", "gdn-backbone-ascend", "tower-sampler-eager"} <= set(applied), applied

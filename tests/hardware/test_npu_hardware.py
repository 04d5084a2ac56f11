"""What an Ascend host must run to verify the patches and the upstream paths they rely on, on
the real stack (``pytest -m npu``). Skipped elsewhere, with the reason.

Needs, besides the NPU: vllm, vllm-ascend and vllm-omni installed with drama3-patches (its
start-up hook active), and for the checkpoint tests the Drama 3 checkpoint in
``DRAMA3_NPU_MODEL`` (a local directory). ``DRAMA3_NPU_DEPLOY`` picks the deploy file of the
end-to-end test (default: the 910B TP2+EP profile, which needs a fish_omni build that accepts
tensor parallelism: the published one refuses it).
"""

from __future__ import annotations

import json
import os

import pytest

from support.subproc import ROOT, result_of, run_python

pytestmark = pytest.mark.npu

SHIPPED_DEPLOY = ROOT / "drama3_patches/tools/deploy_config/configs/drama3_910b_tp2_ep.yaml"
DEPLOY = os.environ.get("DRAMA3_NPU_DEPLOY") or str(SHIPPED_DEPLOY)
needs_model = pytest.mark.skipif(not os.environ.get("DRAMA3_NPU_MODEL"),
                                 reason="set DRAMA3_NPU_MODEL to the Drama 3 checkpoint")
ENV = {"DRAMA3_PATCHES": "1", "DRAMA3_PATCHES_STRICT": "1"}


def _result(proc) -> dict:
    return result_of(proc, "RESULT ")


def test_deploy_config_loads_with_v2_for_stage_0_and_v1_for_stage_1():
    # Real vllm-omni: platform detected as npu, the shipped deploy config through both paths.
    out = _result(run_python(
        """
        import json, sys
        from vllm_omni.config import stage_config as sc
        from vllm_omni.platforms import current_omni_platform
        deploy = sc._apply_platform_overrides(sc.load_deploy_config(sys.argv[1]))
        stages = {ds.stage_id: sc.resolve_stage_model_runner(deploy, ds) for ds in deploy.stages}
        print("RESULT " + json.dumps({"platform": current_omni_platform.device_name, "stages": stages}))
        """,
        env=ENV, args=[str(SHIPPED_DEPLOY)],
    ))
    assert out["platform"].lower() == "npu"
    # The published loader keeps each stage's own runner (stage-level model_runner).
    assert out["stages"] == {"0": "v2", "1": "v1"}


def test_vllm_uva_buffer_pool_uploads_reach_the_npu():
    # fish_omni's model state uploads every step through vLLM's UvaBufferPool; which buffer class
    # vLLM-Ascend provides (vLLM's UVA one raises off CUDA, main's wrapper has `uva` as a property
    # while vLLM 0.32 calls it) decides whether a Drama 3 step can run.
    out = _result(run_python(
        """
        import json
        import numpy as np, torch, torch_npu  # noqa: F401
        from vllm_ascend.utils import adapt_patch
        adapt_patch(is_global_patch=True); adapt_patch(is_global_patch=False)
        from vllm.v1.worker.gpu import buffer_utils
        pool = buffer_utils.UvaBufferPool((4, 3), torch.int64, 2)
        sent = []
        for step in range(3):  # more steps than the pool's depth: buffers are reused
            rows = np.arange(12, dtype=np.int64).reshape(4, 3) * (step + 1)
            sent.append(pool.copy_to_uva(rows).to("npu", non_blocking=True))
        torch.npu.synchronize()
        ok = all(torch.equal(t.cpu(), torch.arange(12).reshape(4, 3) * (i + 1)) for i, t in enumerate(sent))
        print("RESULT " + json.dumps({"ok": ok}))
        """,
        env=ENV,
    ))
    assert out["ok"] is True


def test_seeded_noise_on_the_npu_repeats_for_the_same_seed():
    # A seeded Drama 3 request draws its frame noise with torch.Generator(device=noise.device).
    out = _result(run_python(
        """
        import json, torch, torch_npu  # noqa: F401
        noise = torch.empty(4, 64, device="npu")
        gen = torch.Generator(device=noise.device)
        draws = []
        for seed in (7, 7, 8):
            gen.manual_seed(seed)
            draws.append(noise[1].uniform_(generator=gen).cpu().clone())
        print("RESULT " + json.dumps({"same": torch.equal(draws[0], draws[1]),
                                      "differs": not torch.equal(draws[0], draws[2]),
                                      "in_range": bool(((draws[0] >= 0) & (draws[0] < 1)).all())}))
        """,
        env=ENV,
    ))
    assert out == {"same": True, "differs": True, "in_range": True}


@needs_model
def test_drama3_text_config_carries_the_mrope_sections_vllm_ascend_reads():
    # vLLM-Ascend's Qwen3-Next forward takes its qwen3_5 branch for Drama 3's text config and
    # reads rotary_emb.mrope_section, which vLLM builds only from mRoPE rope parameters.
    out = _result(run_python(
        """
        import json, sys
        import vllm_omni.model_executor.models.fish_omni.configuration_fish_omni  # noqa: F401
        from transformers import AutoConfig
        text = AutoConfig.from_pretrained(sys.argv[1]).get_text_config()
        rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
        print("RESULT " + json.dumps({"model_type": text.model_type, "rope": sorted(rope)}))
        """,
        env=ENV, args=[os.environ["DRAMA3_NPU_MODEL"]],
    ))
    assert "qwen3_5" in out["model_type"]
    assert "mrope_section" in out["rope"], out


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


@needs_model
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
        args=[os.environ["DRAMA3_NPU_MODEL"], DEPLOY],
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
    # The fish_omni patches of the published model: eager tower and draws, Ascend's GDN, the
    # host park on preemption, the FP8 experts through the Ascend method.
    for patch_id in ("tower-sampler-eager", "gdn-backbone-ascend", "preemption-host-copy", "fp8-expert-method"):
        assert "applied" in states[patch_id], (patch_id, states.get(patch_id))
    assert not any("failed" in s for s in states.values())

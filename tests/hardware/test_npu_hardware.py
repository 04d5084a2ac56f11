"""What an Ascend host must run to verify the patches and the upstream paths they rely on, on
the real stack (``pytest -m npu``). Skipped where torch_npu is absent, with the reason; failed
where it is installed but cannot be used (tests/conftest.py).

Needs, besides the NPU: vllm, vllm-ascend and vllm-omni installed with drama3-patches (its
start-up hook active), and for the checkpoint tests the Drama 3 checkpoint in
``DRAMA3_NPU_MODEL`` (a local directory). ``DRAMA3_NPU_DEPLOY`` picks the deploy file of the
end-to-end test (default: the 910B TP2+EP profile, which the published fish_omni serves through
the patches fish-omni-tensor-parallel and fish-omni-tower-tp-split; the test runs it with
``DRAMA3_PATCHES_TP_CHECK=1``, so the two ranks' frames are compared at every step).

Every check runs in a fresh interpreter (``subproc.call``) started with the engine enabled and
strict: the start-up hook patches modules as they import, as in a deployment, and the device
runtime never starts in the test process, which forks for other tests.
"""

from __future__ import annotations

import json
import os

import pytest

from drama3_patches.tools.deploy_config import profiles
from support.replicas import ASCEND_HOST_ENV, apply_checked, has_fish_omni
from support.subproc import call

pytestmark = pytest.mark.npu

SHIPPED_DEPLOY = profiles.profile_file("910b-tp2-ep")
DEPLOY = os.environ.get("DRAMA3_NPU_DEPLOY") or str(SHIPPED_DEPLOY)
needs_model = pytest.mark.skipif(not os.environ.get("DRAMA3_NPU_MODEL"),
                                 reason="set DRAMA3_NPU_MODEL to the Drama 3 checkpoint")


def _patch_row(patch_id: str) -> dict:
    import drama3_patches

    return {p["id"]: p for p in drama3_patches.status()["patches"]}[patch_id]


# -- runner-selection ---------------------------------------------------------------------------


def test_runner_selection_loads_the_deploy_config_with_v2_for_stage_0_and_v1_for_stage_1():
    out = call(deploy_stages, str(SHIPPED_DEPLOY), env=ASCEND_HOST_ENV)
    assert out["platform"].lower() == "npu"
    assert out["state"] == "applied" and out["loader_state"] == "applied", out
    # Both load paths keep each stage's own runner on npu, where the published loader refuses v2.
    assert out["direct"] == {"0": "v2", "1": "v1"}
    assert out["legacy"] == {"0": True, "1": False}


def deploy_stages(path: str) -> dict:
    """Real vllm-omni on the real npu platform: the shipped deploy config through both paths."""
    import vllm_omni.platforms.npu.worker.npu_ar_worker  # noqa: F401  (every target imported first)
    import vllm_omni.platforms.npu.worker.npu_generation_worker  # noqa: F401
    from vllm_omni.config import load_deploy_config
    from vllm_omni.config import stage_config as sc
    from vllm_omni.platforms import current_omni_platform

    apply_checked("runner-selection")
    row = _patch_row("runner-selection")
    deploy = sc._apply_platform_overrides(load_deploy_config(path))
    out = {"platform": current_omni_platform.device_name, "state": row["state"],
           "loader_state": row["target_states"]["vllm_omni.config.stage_config:_apply_platform_overrides"]["state"],
           "direct": {ds.stage_id: sc.resolve_stage_model_runner(deploy, ds) for ds in deploy.stages}}
    from vllm_omni.config import merge_pipeline_deploy
    from vllm_omni.model_executor.models.fish_omni.pipeline import FISH_OMNI_PIPELINE

    out["legacy"] = {s.stage_id: s.yaml_engine_args["use_v2_model_runner"]
                     for s in merge_pipeline_deploy(FISH_OMNI_PIPELINE, load_deploy_config(path))}
    return out


# -- mamba-prefill-end --------------------------------------------------------------------------


def test_mamba_prefill_end_lets_the_ascend_manager_take_a_scheduler_allocation():
    out = call(mamba_allocation, env=ASCEND_HOST_ENV)
    assert out["managers"][-1] == "AscendMambaManager"
    assert out["allocated"] is True
    assert out["state"] in ("applied", "not-needed"), out


def mamba_allocation() -> dict:
    """The real AscendMambaManager, installed by vLLM-Ascend's own global patches."""
    import torch
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec
    from vllm.v1.request import Request
    from vllm_ascend.utils import adapt_patch

    adapt_patch(is_global_patch=True)
    register_all_kvcache_specs(None)
    groups = [
        KVCacheGroupSpec(["a"], FullAttentionSpec(block_size=128, num_kv_heads=1, head_size=8, dtype=torch.bfloat16)),
        KVCacheGroupSpec(["m"], MambaSpec(block_size=128, shapes=((4, 4),), dtypes=(torch.bfloat16,))),
    ]
    m = KVCacheManager(KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups),
                       max_model_len=4096, scheduler_block_size=128, hash_block_size=128, enable_caching=False)
    blocks = m.allocate_slots(Request("r", list(range(300)), SamplingParams(max_tokens=4), None), 300)
    return {"managers": [type(x).__name__ for x in m.coordinator.single_type_managers],
            "allocated": blocks is not None, "state": _patch_row("mamba-prefill-end")["state"]}


# -- vLLM paths a Drama 3 step takes on the card -------------------------------------------------


def test_vllm_uva_buffer_pool_uploads_reach_the_npu():
    # fish_omni's model state uploads every step through vLLM's UvaBufferPool; which buffer class
    # vLLM-Ascend provides (vLLM's UVA one raises off CUDA, main's wrapper has `uva` as a property
    # while vLLM 0.32 calls it) decides whether a Drama 3 step can run.
    assert call(uva_uploads, env=ASCEND_HOST_ENV) == {"ok": True}


def uva_uploads() -> dict:
    import numpy as np
    import torch
    import torch_npu  # noqa: F401
    from vllm_ascend.utils import adapt_patch

    adapt_patch(is_global_patch=True)
    adapt_patch(is_global_patch=False)
    from vllm.v1.worker.gpu import buffer_utils

    pool = buffer_utils.UvaBufferPool((4, 3), torch.int64, 2)
    sent = []
    for step in range(3):  # more steps than the pool's depth: buffers are reused
        rows = np.arange(12, dtype=np.int64).reshape(4, 3) * (step + 1)
        sent.append(pool.copy_to_uva(rows).to("npu", non_blocking=True))
    torch.npu.synchronize()
    return {"ok": all(torch.equal(t.cpu(), torch.arange(12).reshape(4, 3) * (i + 1)) for i, t in enumerate(sent))}


# -- tower-sampler-eager ------------------------------------------------------------------------


@pytest.mark.skipif(not has_fish_omni(), reason="this vllm-omni has no fish_omni (Drama 3)")
def test_tower_sampler_eager_draws_repeat_for_a_seed_on_the_npu_and_match_the_cpu():
    # A seeded Drama 3 request draws its frame noise with torch.Generator(device=noise.device);
    # the published draw_top_k_top_p, patched, then runs its eager kernel on the NPU tensors.
    out = call(seeded_draws, env=ASCEND_HOST_ENV)
    assert out["state"] == "applied"
    assert out["noise"] == {"same": True, "differs": True, "in_range": True}
    assert out["tokens_repeat"] is True and out["tokens_on"] == "npu"
    assert out["same_as_cpu"] is True


def seeded_draws() -> dict:
    import torch
    import torch_npu  # noqa: F401
    from vllm_omni.model_executor.models.fish_omni import kernels

    from drama3_patches.kernels import sampling

    apply_checked("tower-sampler-eager")
    row = _patch_row("tower-sampler-eager")
    noise = torch.empty(4, 64, device="npu")
    gen = torch.Generator(device=noise.device)
    draws = []
    for seed in (7, 7, 8):
        gen.manual_seed(seed)
        draws.append(noise[1].uniform_(generator=gen).cpu().clone())
    out = {"state": row["state"],
           "noise": {"same": torch.equal(draws[0], draws[1]), "differs": not torch.equal(draws[0], draws[2]),
                     "in_range": bool(((draws[0] >= 0) & (draws[0] < 1)).all())}}
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(16, 4096, generator=g) * 3).npu()
    per_row = [t.npu() for t in (torch.full((16,), 0.8), torch.full((16,), 30), torch.full((16,), 0.9))]
    tokens = []
    for _ in range(2):
        gen.manual_seed(11)
        uniform = torch.empty(16, 64, device="npu").uniform_(generator=gen)
        tokens.append(kernels.draw_top_k_top_p(logits, *per_row, uniform, 64))
    torch.npu.synchronize()
    out["tokens_repeat"] = torch.equal(tokens[0].cpu(), tokens[1].cpu())
    out["tokens_on"] = tokens[0].device.type
    cpu = sampling.draw_top_k_top_p(logits.cpu(), *(t.cpu() for t in per_row), uniform.cpu(), 64)
    out["same_as_cpu"] = torch.equal(cpu, tokens[1].cpu())
    return out


# -- with the Drama 3 checkpoint ------------------------------------------------------------------


@needs_model
def test_drama3_text_config_carries_the_mrope_sections_vllm_ascend_reads():
    # vLLM-Ascend's Qwen3-Next forward takes its qwen3_5 branch for Drama 3's text config and
    # reads rotary_emb.mrope_section, which vLLM builds only from mRoPE rope parameters.
    out = call(text_config, os.environ["DRAMA3_NPU_MODEL"], env=ASCEND_HOST_ENV)
    assert "qwen3_5" in out["model_type"]
    assert "mrope_section" in out["rope"], out


def text_config(model: str) -> dict:
    import vllm_omni.model_executor.models.fish_omni.configuration_fish_omni  # noqa: F401
    from transformers import AutoConfig

    text = AutoConfig.from_pretrained(model).get_text_config()
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    return {"model_type": text.model_type, "rope": sorted(rope)}


@needs_model
def test_drama3_serves_one_request_with_stage_0_on_v2_and_stage_1_on_v1(tmp_path):
    # End to end: every process reports its patches; stage 0's worker logs the V2 runner, the
    # engine cores of the hybrid AR stage schedule (prefill_end) without TypeError, and the
    # V2 runner's prepare_inputs gets the argument count its parent takes.
    reports = tmp_path / "reports"
    env = {**ASCEND_HOST_ENV, "DRAMA3_PATCHES_REPORT_DIR": str(reports), "VLLM_LOGGING_LEVEL": "INFO",
           "DRAMA3_PATCHES_TP_CHECK": "1"}
    log = call(serve_one_request, os.environ["DRAMA3_NPU_MODEL"], DEPLOY, env=env, timeout=1800, with_output=True)
    assert log["result"] == 1
    assert "Using MR v2 " in log["output"]  # ours (NPUOmniARModelRunner) or one vLLM-Omni ships
    assert "for stage 0" in log["output"]
    assert "prefill_end" not in log["output"]  # no TypeError from the Mamba manager
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
    if deploy_stages_tp(DEPLOY) > 1:
        # Stage 0 over two ranks: the model accepted TP, the tower split, the ranks never drifted
        # (the frames check raises TensorParallelDrift on the first differing step).
        for patch_id in ("fish-omni-tensor-parallel", "fish-omni-tp-frames-check", "fish-omni-tower-tp-split"):
            assert "applied" in states[patch_id], (patch_id, states.get(patch_id))
        assert "TensorParallelDrift" not in log["output"] and "differ from rank 0" not in log["output"]
        assert "fish-omni-tensor-parallel: built" in log["output"]
    assert not any("failed" in s for s in states.values())


def deploy_stages_tp(path: str) -> int:
    """Stage 0's tensor_parallel_size in a deploy file."""
    import yaml

    with open(path) as fh:
        stages = yaml.safe_load(fh).get("stages") or []
    return int(next((s.get("tensor_parallel_size") or 1 for s in stages if s.get("stage_id") == 0), 1))


def serve_one_request(model: str, deploy: str) -> int:
    from vllm_omni.entrypoints.omni import Omni

    omni = Omni(model=model, deploy_config=deploy)
    return len(omni.generate(["Hello from an Ascend card."]))

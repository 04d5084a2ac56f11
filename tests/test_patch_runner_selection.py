"""runner-selection on real vLLM with the vllm-omni 0.30.0 replica over each vllm-ascend replica.

One child per profile pair builds the deploy config through the (patched) loader, then NPU
workers for a V2 AR stage (0) and a V1 DAC stage (1) with vLLM's real VllmConfig, with the
process-wide default (VLLM_USE_V2_MODEL_RUNNER, read by vLLM-Ascend's property) set against
each stage; then the same with the patch removed, to show what it changes.
"""

from __future__ import annotations

import json
import shutil

import pytest

from tests.support.replicas import ASCEND_032, ASCEND_MAIN, OMNI_030, npu_env, profile, profile_paths
from tests.support.subproc import ROOT, run_python

pytestmark = pytest.mark.vllm

TARGETS = [
    "vllm_omni.config.stage_config:_apply_platform_overrides",
    "vllm_omni.config.stage_config:_build_engine_args",
    "vllm_omni.platforms.npu.worker.npu_ar_worker:NPUARWorker.__init__",
    "vllm_omni.platforms.npu.worker.npu_ar_worker:NPUARWorker.init_device",
    "vllm_omni.platforms.npu.worker.npu_generation_worker:NPUGenerationWorker.__init__",
]

CHILD = r"""
import json, logging, os, sys
from types import SimpleNamespace

import drama3_patches
from drama3_patches._bootstrap import installed_finder
if installed_finder() is None:
    drama3_patches.apply()

from vllm.config import DeviceConfig, VllmConfig

import vllm_omni.config.stage_config as sc
import vllm_omni.config.omni_config as oc
from vllm_omni.platforms.npu.worker.npu_ar_worker import NPUARWorker
from vllm_omni.platforms.npu.worker.npu_generation_worker import NPUGenerationWorker
from vllm_omni.worker_v2.omni_ar_model_runner import OmniARModelRunner
from vllm_ascend.worker.v2.model_runner import NPUModelRunner as AscendV2
import vllm_ascend.worker.v2.utils as cuda_wrapper_module
import vllm_ascend.utils
vllm_ascend.utils.adapt_patch()  # as NPUWorker.__init__ does: vLLM-Ascend's use_v2_model_runner

messages = []
class Grab(logging.Handler):
    def emit(self, record):
        messages.append(record.getMessage())
logging.getLogger("vllm.drama3_patches").addHandler(Grab())
logging.getLogger("vllm.drama3_patches").setLevel(logging.INFO)

out = {}
st = {p["id"]: p for p in drama3_patches.status()["patches"]}["runner-selection"]
out.update(state=st["state"], reason=st["reason"], targets=st["targets"])


def err(fn):
    try:
        return fn()
    except Exception as exc:
        return type(exc).__name__ + ": " + str(exc)


def deploy_checks():
    r = {}
    r["npu_v2"] = err(lambda: sc._apply_platform_overrides(sc.DeployConfig(model_runner="v2"), "npu").model_runner)
    # platform=None: vLLM-Omni's current platform; the replica has none, so the patch's own (npu).
    r["default_platform_v2"] = err(lambda: sc._apply_platform_overrides(sc.DeployConfig(model_runner="v2")).model_runner)
    d = sc.DeployConfig(
        model_runner="v1",
        stages=[sc.StageDeployConfig(stage_id=0), sc.StageDeployConfig(stage_id=1)],
        platforms={"npu": {"model_runner": "v2", "stages": [{"stage_id": 0, "devices": "0,1", "max_num_seqs": 64}]}},
    )
    before = json.dumps(d.platforms, sort_keys=True)
    res = err(lambda: sc._apply_platform_overrides(d, "npu"))
    r["section_v2"] = res if isinstance(res, str) else [res.model_runner, res.stages[0].devices, res.stages[0].max_num_seqs]
    r["platforms_unchanged"] = json.dumps(d.platforms, sort_keys=True) == before
    r["section_v1_wins"] = err(lambda: sc._apply_platform_overrides(
        sc.DeployConfig(model_runner="v2", platforms={"npu": {"model_runner": "v1"}}), "npu").model_runner)
    r["section_bad"] = err(lambda: sc._apply_platform_overrides(
        sc.DeployConfig(platforms={"npu": {"model_runner": "v3"}}), "npu"))
    r["xpu_v2"] = err(lambda: sc._apply_platform_overrides(sc.DeployConfig(model_runner="v2"), "xpu"))
    r["alias_v2"] = err(lambda: oc.resolve_deploy(sc.DeployConfig(model_runner="v2"), "npu").model_runner)
    r["engine_args"] = sc._build_engine_args(None, None, None, sc.DeployConfig(model_runner="v2"), None)
    # The shipped NPU deploy config, through both of vLLM-Omni's config paths.
    def shipped():
        d = sc._apply_platform_overrides(sc.load_deploy_config(sys.argv[1]), "npu")
        stages = {}
        for ds in d.stages:
            legacy = sc._build_engine_args(None, ds, None, d, None)
            typed = oc._build_model_config(None, d, None, ds, oc._stage_engine_overrides(ds))
            stages[ds.stage_id] = [legacy["use_v2_model_runner"], typed["use_v2_model_runner"],
                                   "model_runner" in legacy, ds.engine_extras.get("block_size")]
        again = sc._apply_platform_overrides(d, "npu")  # vLLM-Omni may merge twice
        return {"deploy": d.model_runner, "stages": stages, "again": again.model_runner,
                "again_stage1": again.stages[1].engine_extras.get("use_v2_model_runner")}
    r["shipped"] = err(shipped)
    bad = sc.DeployConfig(stages=[sc.StageDeployConfig(stage_id=1, engine_extras={"model_runner": "v3"})],
                          platforms={"npu": {"model_runner": "v2"}})
    r["stage_bad"] = err(lambda: sc._apply_platform_overrides(bad, "npu"))
    return r


def config(stage_id, v2):
    cfg = VllmConfig(device_config=DeviceConfig(device="cpu"))
    mc = SimpleNamespace(stage_id=stage_id, model_stage=("ar" if stage_id == 0 else "dac"))
    if v2 is not None:
        mc.use_v2_model_runner = v2
    cfg.model_config = mc
    return cfg


def worker(cls, stage_id, v2, process_default):
    # vLLM validates the config with its own property (V2 without Triton is an error): build it
    # with the variable unset, then set the process-wide default the worker will read.
    os.environ.pop("VLLM_USE_V2_MODEL_RUNNER", None)
    cfg = config(stage_id, v2)
    if process_default is not None:
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = process_default
    r = {"process_default": cfg.use_v2_model_runner}
    messages.clear()
    try:
        w = cls(vllm_config=cfg, local_rank=0, rank=0, distributed_init_method="tcp://127.0.0.1:1")
        r["flag"] = w.use_v2_model_runner
        entries = cuda_wrapper_module.entries
        w.init_device()
    except Exception as exc:
        r["error"] = type(exc).__name__ + ": " + str(exc)
        return r
    runner = w.model_runner
    r["runner"] = type(runner).__name__
    r["runner_module"] = type(runner).__module__
    r["omni_on_ascend_v2"] = isinstance(runner, OmniARModelRunner) and isinstance(runner, AscendV2)
    r["event_at_init"] = getattr(getattr(runner, "event_cls_at_init", None), "__name__", None)
    r["wrapper_entries"] = cuda_wrapper_module.entries - entries
    r["instance_runner_cls_left"] = "model_runner_cls" in vars(w)
    # lora-count-forwarding lands on our runner when runner-selection first imports it.
    r["lora_forwarding"] = hasattr(getattr(type(runner), "prepare_inputs", None), "forwards_num_active_loras")
    r["log"] = [m for m in messages if m.startswith("Using MR")]
    return r


def workers():
    return {
        "ar_stage_v2_default_v1": worker(NPUARWorker, 0, True, None),
        "ar_stage_v1_default_v2": worker(NPUARWorker, 0, False, "1"),
        "ar_stage_unset_default_v2": worker(NPUARWorker, 0, None, "1"),
        "gen_stage_v1_default_v2": worker(NPUGenerationWorker, 1, False, "1"),
        "gen_stage_v2": worker(NPUGenerationWorker, 1, True, None),
    }


out["patched"] = {"deploy": deploy_checks(), "workers": workers()}
drama3_patches.unapply(["runner-selection"])
out["unpatched"] = {"deploy": deploy_checks(), "workers": workers()}
print("RESULT " + json.dumps(out))
"""


SHIPPED_DEPLOY = ROOT / "drama3_patches" / "deploy" / "drama3_910b_tp2_ep.yaml"


def _run(paths) -> dict:
    proc = run_python(CHILD, env=npu_env(), pythonpath=paths, args=[str(SHIPPED_DEPLOY)])
    return json.loads(proc.stdout.split("RESULT ")[-1])


@pytest.fixture(scope="module", params=[ASCEND_MAIN, ASCEND_032])
def result(request):
    return request.param, _run(profile_paths(request.param, OMNI_030))


def test_applied_with_all_five_targets(result):
    _, out = result
    assert out["state"] == "applied", out["reason"]
    assert out["targets"] == TARGETS


def test_deploy_loader_accepts_v2_on_npu_only(result):
    _, out = result
    deploy = out["patched"]["deploy"]
    assert deploy["npu_v2"] == "v2"
    assert deploy["default_platform_v2"] == "v2"
    assert deploy["section_v2"] == ["v2", "0,1", 64]  # stage overrides still merged
    assert deploy["platforms_unchanged"] is True
    assert deploy["section_v1_wins"] == "v1"
    assert deploy["section_bad"].startswith("ValueError: platform model_runner must be one of")
    assert deploy["xpu_v2"].startswith("NotImplementedError: Model Runner V2 is not supported on XPU")
    assert deploy["alias_v2"] == "v2"  # omni_config's `from ... import` name reaches the patch
    assert deploy["engine_args"] == {"use_v2_model_runner": True}
    assert deploy["stage_bad"] == "ValueError: stage 1: model_runner must be one of ('v1', 'v2'), got 'v3'"


def test_shipped_deploy_config_puts_stage_0_on_v2_and_stage_1_on_v1(result):
    _, out = result
    shipped = out["patched"]["deploy"]["shipped"]
    assert shipped["deploy"] == "v2"  # platforms.npu.model_runner
    # [legacy engine args, structured model config, stray model_runner key, platform block_size]
    assert shipped["stages"] == {"0": [True, True, False, 128], "1": [False, False, False, None]}
    assert shipped["again"] == "v2" and shipped["again_stage1"] is False


def test_shipped_deploy_config_is_refused_without_the_patch(result):
    _, out = result
    assert out["unpatched"]["deploy"]["shipped"].startswith(
        "NotImplementedError: Model Runner V2 is not supported on NPU")


def test_deploy_loader_refused_v2_on_npu_before(result):
    _, out = result
    deploy = out["unpatched"]["deploy"]
    assert deploy["npu_v2"].startswith("NotImplementedError: Model Runner V2 is not supported on NPU")
    assert deploy["section_v2"].startswith("NotImplementedError")
    assert deploy["alias_v2"].startswith("NotImplementedError")


def test_ar_stage_on_v2_builds_the_npu_omni_v2_runner_under_the_cuda_wrapper(result):
    _, out = result
    w = out["patched"]["workers"]["ar_stage_v2_default_v1"]
    assert w["process_default"] is False and w["flag"] is True
    assert w["runner"] == "NPUOmniARModelRunner"
    assert w["runner_module"] == "drama3_patches.patches._npu_omni_ar_runner"
    assert w["omni_on_ascend_v2"] is True
    assert w["event_at_init"] == "NPUEventStandIn"  # torch.cuda.Event was torch.npu's while building
    assert w["wrapper_entries"] >= 1
    assert w["instance_runner_cls_left"] is False
    assert w["lora_forwarding"] is True
    assert len(w["log"]) == 1 and w["log"][0].startswith("Using MR v2 NPUOmniARModelRunner")
    assert "stage 0 (ar)" in w["log"][0]


def test_stage_choice_overrides_the_process_default(result):
    _, out = result
    workers = out["patched"]["workers"]
    for key in ("ar_stage_v1_default_v2", "ar_stage_unset_default_v2"):
        w = workers[key]
        assert w["process_default"] is True and w["flag"] is False, key
        assert w["runner"] == "NPUARModelRunner", key
        assert w["log"] == ["Using MR v1 NPUARModelRunner on NPU for stage 0 (ar)"], key
    gen = workers["gen_stage_v1_default_v2"]
    assert gen["process_default"] is True and gen["flag"] is False
    assert gen["runner"] == "NPUGenerationModelRunner"


def test_dac_stage_refuses_v2_naming_the_stage(result):
    _, out = result
    error = out["patched"]["workers"]["gen_stage_v2"]["error"]
    assert error.startswith("ValueError: stage 1 (dac) runs on NPUGenerationWorker")
    assert "set `model_runner: v1` for this stage" in error


def test_without_the_patch_workers_ignore_the_stage(result):
    _, out = result
    workers = out["unpatched"]["workers"]
    assert workers["ar_stage_v2_default_v1"]["flag"] is False
    assert workers["ar_stage_v2_default_v1"]["runner"] == "NPUARModelRunner"
    # Process default V2: the AR worker still builds V1, and the DAC worker accepts V2 silently.
    assert workers["ar_stage_v1_default_v2"]["flag"] is True
    assert workers["ar_stage_v1_default_v2"]["runner"] == "NPUARModelRunner"
    assert "error" not in workers["gen_stage_v2"]


SHIPPED = '''\
# SYNTHETIC: a vLLM-Omni NPU V2 AR runner as a future release might ship it (none does yet).
from vllm_ascend.worker.v2.model_runner import NPUModelRunner
from vllm_omni.worker_v2.omni_ar_model_runner import OmniARModelRunner


class ShippedNPUOmniARModelRunner(OmniARModelRunner, NPUModelRunner):
    pass
'''


def test_a_runner_that_vllm_omni_ships_is_used_instead(tmp_path):
    omni = tmp_path / "omni_with_npu_v2_runner"
    shutil.copytree(profile(OMNI_030), omni)
    (omni / "vllm_omni/platforms/npu/worker/npu_v2_ar_model_runner.py").write_text(SHIPPED)
    out = _run([profile(ASCEND_MAIN), omni])
    w = out["patched"]["workers"]["ar_stage_v2_default_v1"]
    assert w["runner"] == "ShippedNPUOmniARModelRunner"
    assert w["runner_module"] == "vllm_omni.platforms.npu.worker.npu_v2_ar_model_runner"
    assert w["event_at_init"] == "NPUEventStandIn"
    assert w["log"][0].startswith("Using MR v2 ShippedNPUOmniARModelRunner")


FIXED_LOADER = '''
    if deploy.model_runner == "v2" and platform in {"npu", "xpu"}:'''


def test_loader_not_needed_when_vllm_omni_accepts_v2_on_npu(tmp_path):
    omni = tmp_path / "omni_loader_accepts_npu_v2"
    shutil.copytree(profile(OMNI_030), omni)
    stage_config = omni / "vllm_omni/config/stage_config.py"
    text = stage_config.read_text()
    assert FIXED_LOADER in text
    stage_config.write_text(
        "# SYNTHETIC variant: the loader refuses V2 on xpu only.\n"
        + text.replace(FIXED_LOADER, FIXED_LOADER.replace('{"npu", "xpu"}', '{"xpu"}'))
    )
    proc = run_python(
        """
        import json, drama3_patches
        drama3_patches.apply()
        import vllm_omni.config.stage_config
        st = {p["id"]: p for p in drama3_patches.status()["patches"]}["runner-selection"]
        print("RESULT " + json.dumps(st["target_states"]))
        """,
        env=npu_env(), pythonpath=[profile(ASCEND_MAIN), omni],
    )
    states = json.loads(proc.stdout.split("RESULT ")[-1])
    loader = states[TARGETS[0]]
    assert loader["state"] == "not-needed"
    assert "already accepts model_runner v2 on npu" in loader["reason"]

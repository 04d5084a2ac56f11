"""runner-selection on the installed vLLM + vllm-omni pair (0.31.0 + 0.31.0rc1 or 0.32.0 + 0.32.0rc1).

Everything vllm-omni is the published code: the deploy loader (``vllm_omni.config``: YAML ->
``load_deploy_config`` -> ``merge_pipeline_deploy`` and ``VllmOmniConfig.from_pipeline_config``)
and the NPU workers. Stand-ins only for what cannot import here: vllm-ascend (each profile under
tests/replicas/) and vllm-omni's NPU model runner modules (tests/support/replicas.py). One fresh
interpreter per vllm-ascend profile loads the shipped deploy YAMLs on npu, then builds NPU workers for a V2 AR
stage (0) and a V1 DAC stage (1) with vLLM's real VllmConfig, with the process-wide default
(VLLM_USE_V2_MODEL_RUNNER, read by vLLM-Ascend's property) set against each stage; then the same
with the patch removed, to show what it changes.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from drama3_patches.tools.deploy_config import profiles
from support.logs import captured
from support.replicas import (
    ASCEND_030RC2, ASCEND_032, ASCEND_MAIN, enter_npu_workers, installed, npu_env, profile_paths,
)
from support.subproc import call

pytestmark = pytest.mark.vllm

TARGETS = [
    "vllm_omni.config.stage_config:_apply_platform_overrides",
    "vllm_omni.platforms.npu.worker.npu_ar_worker:NPUARWorker.__init__",
    "vllm_omni.platforms.npu.worker.npu_ar_worker:NPUARWorker.init_device",
    "vllm_omni.platforms.npu.worker.npu_generation_worker:NPUGenerationWorker.__init__",
]
PROFILES = [Path(str(profiles.profile_file(name))) for name in profiles.profile_names()]

# The children below run in fresh interpreters started with the engine enabled: the start-up hook
# applies runner-selection as vllm-omni's modules import, the path a deployment takes.


def _err(fn):
    try:
        return fn()
    except Exception as exc:
        return type(exc).__name__ + ": " + str(exc)


def _mine(key="target_states"):
    import drama3_patches

    st = {p["id"]: p for p in drama3_patches.status()["patches"]}["runner-selection"]
    return st if key is None else st[key]


def _setup(yamls: list) -> SimpleNamespace:
    """What every child does first: vllm-omni's NPU workers importable (runner stand-ins), the
    platform vllm-omni resolves made npu (its NPU platform class needs vLLM-Ascend's), Drama 3's
    two-stage topology at hand."""
    enter_npu_workers()
    import vllm_omni
    import vllm_omni.config.omni_config as oc
    import vllm_omni.config.stage_config as sc
    import vllm_omni.platforms

    vllm_omni.platforms.current_omni_platform = SimpleNamespace(device_name="npu")
    try:
        from vllm_omni.model_executor.models.fish_omni.pipeline import FISH_OMNI_PIPELINE as pipeline
    except ImportError:  # 0.31.0rc1 has no fish_omni: the same topology, built here
        pipeline = sc.PipelineConfig(model_type="fish_omni", model_arch="FishOmniForConditionalGeneration", stages=(
            sc.StagePipelineConfig(stage_id=0, model_stage="fish_omni", execution_type=sc.StageExecutionType.LLM_AR,
                                   owns_tokenizer=True, engine_output_type="latent"),
            sc.StagePipelineConfig(stage_id=1, model_stage="dac_decoder", model_arch="FishSpeechDACDecoder",
                                   execution_type=sc.StageExecutionType.LLM_GENERATION, input_sources=(0,),
                                   final_output=True, final_output_type="audio", engine_output_type="audio"),
        ))
    shipped = Path(vllm_omni.__file__).parent / "deploy" / "fish_omni.yaml"
    return SimpleNamespace(oc=oc, sc=sc, pipeline=pipeline,
                           yamls=([str(shipped)] if shipped.exists() else []) + list(yamls))


def _stage_runners(ns, path):
    from vllm_omni.config import load_deploy_config, merge_pipeline_deploy

    sc, r = ns.sc, {}
    d = sc._apply_platform_overrides(load_deploy_config(path), "npu")
    r["direct"] = [d.model_runner, {s.stage_id: sc.resolve_stage_model_runner(d, s) for s in d.stages}]
    # The load path vLLM-Omni serves with: platform=None -> the current (npu) platform.
    legacy = merge_pipeline_deploy(ns.pipeline, load_deploy_config(path))
    r["legacy"] = {s.stage_id: [s.yaml_engine_args["use_v2_model_runner"], s.yaml_runtime.get("devices"),
                                s.yaml_engine_args.get("block_size")] for s in legacy}
    typed = ns.oc.VllmOmniConfig.from_pipeline_config(ns.pipeline, deploy_config_path=path)
    r["typed"] = {s.stage_id: s.model_config.use_v2_model_runner for s in typed.stage_configs}
    r["xpu"] = _err(lambda: sc._apply_platform_overrides(load_deploy_config(path), "xpu"))
    r["cuda"] = _err(lambda: sc._apply_platform_overrides(load_deploy_config(path), "cuda").model_runner)
    return r


def _deploy_checks(ns):
    sc = ns.sc
    r = {"yamls": {Path(p).name: _err(lambda: _stage_runners(ns, p)) for p in ns.yamls}}
    r["npu_v2"] = _err(lambda: sc._apply_platform_overrides(sc.DeployConfig(model_runner="v2"), "npu").model_runner)
    r["default_platform_v2"] = _err(lambda: sc._apply_platform_overrides(sc.DeployConfig(model_runner="v2")).model_runner)
    d = sc.DeployConfig(
        model_runner="v1",
        stages=[sc.StageDeployConfig(stage_id=0), sc.StageDeployConfig(stage_id=1)],
        platforms={"npu": {"model_runner": "v2", "stages": [{"stage_id": 0, "devices": "0,1", "max_num_seqs": 64}]}},
    )
    before = json.dumps(d.platforms, sort_keys=True)
    res = _err(lambda: sc._apply_platform_overrides(d, "npu"))
    r["section_v2"] = res if isinstance(res, str) else [res.model_runner, res.stages[0].devices, res.stages[0].max_num_seqs]
    r["platforms_unchanged"] = json.dumps(d.platforms, sort_keys=True) == before
    # platforms.npu.model_runner: v1 falls back for every stage, stage-level v2 included.
    fb = sc.DeployConfig(stages=[sc.StageDeployConfig(stage_id=0, model_runner="v2")],
                         platforms={"npu": {"model_runner": "v1"}})
    res = _err(lambda: sc._apply_platform_overrides(fb, "npu"))
    r["section_v1_fallback"] = res if isinstance(res, str) else [res.model_runner, res.stages[0].model_runner]
    r["section_bad"] = _err(lambda: sc._apply_platform_overrides(
        sc.DeployConfig(platforms={"npu": {"model_runner": "v3"}}), "npu"))
    r["stage_bad"] = _err(lambda: sc._apply_platform_overrides(sc.DeployConfig(
        stages=[sc.StageDeployConfig(stage_id=1)],
        platforms={"npu": {"stages": [{"stage_id": 1, "model_runner": "v3"}]}}), "npu"))
    r["xpu_stage_v2"] = _err(lambda: sc._apply_platform_overrides(sc.DeployConfig(
        stages=[sc.StageDeployConfig(stage_id=0, model_runner="v2")]), "xpu"))
    r["alias_same"] = ns.oc._apply_platform_overrides is sc._apply_platform_overrides
    return r


def _config(stage_id, v2):
    from vllm.config import DeviceConfig, VllmConfig

    cfg = VllmConfig(device_config=DeviceConfig(device="cpu"))
    mc = SimpleNamespace(stage_id=stage_id, model_stage=("fish_omni" if stage_id == 0 else "dac_decoder"))
    if v2 is not None:
        mc.use_v2_model_runner = v2
    cfg.model_config = mc
    return cfg


def _worker(cls, stage_id, v2, process_default):
    import vllm_ascend.worker.v2.utils as cuda_wrapper_module
    from vllm_ascend.worker.v2.model_runner import NPUModelRunner as AscendV2
    from vllm_omni.worker_v2.omni_ar_model_runner import OmniARModelRunner

    # vLLM validates the config with its own property (V2 without Triton is an error): build it
    # with the variable unset, then set the process-wide default the worker will read.
    os.environ.pop("VLLM_USE_V2_MODEL_RUNNER", None)
    cfg = _config(stage_id, v2)
    if process_default is not None:
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = process_default
    r = {}
    with captured() as messages:
        try:
            w = cls(vllm_config=cfg, local_rank=0, rank=0, distributed_init_method="tcp://127.0.0.1:1")
            r["process_default"] = cfg.use_v2_model_runner
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


def _workers():
    from vllm_omni.platforms.npu.worker.npu_ar_worker import NPUARWorker
    from vllm_omni.platforms.npu.worker.npu_generation_worker import NPUGenerationWorker

    return {
        "ar_stage_v2_default_v1": _worker(NPUARWorker, 0, True, None),
        "ar_stage_v1_default_v2": _worker(NPUARWorker, 0, False, "1"),
        "ar_stage_unset_default_v2": _worker(NPUARWorker, 0, None, "1"),
        "gen_stage_v1_default_v2": _worker(NPUGenerationWorker, 1, False, "1"),
        "gen_stage_v2": _worker(NPUGenerationWorker, 1, True, None),
    }


def selection_child(yamls: list) -> dict:
    """One profile's child: the deploy files and workers patched, then with the patch removed."""
    import drama3_patches
    from drama3_patches._bootstrap import installed_finder

    ns = _setup(yamls)
    if installed_finder() is None:  # no start-up hook in this environment: patch what is imported
        drama3_patches.apply()
    import vllm_omni.platforms.npu.worker.npu_ar_worker  # noqa: F401

    out = {"yamls": [Path(p).name for p in ns.yamls]}
    st = _mine(None)
    out.update(state=st["state"], reason=st["reason"], targets=st["targets"],
               worker_files={k: sys.modules[k].__file__ for k in (
                   "vllm_omni.platforms.npu.worker.npu_ar_worker", "vllm_omni.platforms.npu.worker.base",
                   "vllm_omni.platforms.npu.worker.npu_ar_model_runner", "vllm_omni.config.stage_config")})
    out["patched"] = {"deploy": _deploy_checks(ns), "workers": _workers()}
    drama3_patches.unapply(["runner-selection"])
    out["unpatched"] = {"deploy": _deploy_checks(ns), "workers": _workers()}
    return out


def _run(child, paths, args=(), **env) -> dict:
    return call(child, *[[str(a) for a in arg] if isinstance(arg, list) else str(arg) for arg in args],
                env=npu_env(**env), pythonpath=paths)


@pytest.fixture(scope="module", params=[ASCEND_MAIN, ASCEND_030RC2, ASCEND_032])
def result(request):
    return request.param, _run(selection_child, profile_paths(request.param), [list(PROFILES)])


def test_applied_with_its_targets_on_the_published_workers_and_loader(result):
    _, out = result
    assert out["state"] == "applied", out["reason"]
    assert out["targets"] == TARGETS
    files = out["worker_files"]
    # The published vllm-omni (site-packages), except the runner module that needs vllm-ascend.
    for module in ("vllm_omni.platforms.npu.worker.npu_ar_worker", "vllm_omni.platforms.npu.worker.base",
                   "vllm_omni.config.stage_config"):
        assert "site-packages" in files[module] and "replicas" not in files[module], files[module]
    assert "replicas" in files["vllm_omni.platforms.npu.worker.npu_ar_model_runner"]


def test_deploy_files_load_on_npu_with_stage_0_on_v2_and_stage_1_on_v1(result):
    _, out = result
    yamls = out["patched"]["deploy"]["yamls"]
    expected = {path.name for path in PROFILES}  # every shipped profile
    assert {"drama3_910b_tp2_ep.yaml", "drama3_910b_tp2_ep_graph.yaml", "drama3_mxfp8_1card.yaml"} <= expected
    if installed("vllm-omni") == "0.32.0rc1":
        expected.add("fish_omni.yaml")  # the published Drama 3 deploy
    assert set(yamls) == expected
    for name, r in yamls.items():
        assert not isinstance(r, str), (name, r)
        assert r["direct"][1] == {"0": "v2", "1": "v1"}, name
        assert {k: v[0] for k, v in r["legacy"].items()} == {"0": True, "1": False}, name
        assert r["typed"] == {"0": True, "1": False}, name
        assert r["xpu"].startswith("NotImplementedError: Model Runner V2 is not supported on XPU"), name
        assert r["cuda"] == "v1", name
    tp2 = yamls["drama3_910b_tp2_ep.yaml"]["legacy"]
    assert tp2["0"][1:] == ["0,1", 128] and tp2["1"][1] == "1"  # platforms.npu overrides merged


def test_deploy_loader_rules_on_npu_stay_upstreams(result):
    _, out = result
    deploy = out["patched"]["deploy"]
    assert deploy["npu_v2"] == "v2"
    assert deploy["default_platform_v2"] == "v2"
    assert deploy["section_v2"] == ["v2", "0,1", 64]  # stage overrides still merged
    assert deploy["platforms_unchanged"] is True
    assert deploy["section_v1_fallback"] == ["v1", None]
    assert deploy["section_bad"].startswith("ValueError: platform model_runner must be one of")
    assert deploy["stage_bad"].startswith("ValueError: stage 1: model_runner must be 'v1' or 'v2'")
    assert deploy["xpu_stage_v2"].startswith("NotImplementedError: Model Runner V2 is not supported on XPU")
    assert deploy["alias_same"] is True  # omni_config's `from ... import` name is rebound too


def test_without_the_patch_the_loader_refuses_every_v2_on_npu(result):
    _, out = result
    deploy = out["unpatched"]["deploy"]
    for name, r in deploy["yamls"].items():
        assert r.startswith("NotImplementedError: Model Runner V2 is not supported on NPU"), name
    assert deploy["npu_v2"].startswith("NotImplementedError: Model Runner V2 is not supported on NPU")
    assert deploy["section_v2"].startswith("NotImplementedError")
    assert deploy["section_v1_fallback"] == ["v1", None]  # a V1 fallback was accepted before, too


def test_ar_stage_on_v2_builds_the_npu_omni_v2_runner_under_the_cuda_wrapper(result):
    _, out = result
    w = out["patched"]["workers"]["ar_stage_v2_default_v1"]
    assert w["process_default"] is False and w["flag"] is True
    assert w["runner"] == "NPUOmniARModelRunner"
    assert w["runner_module"] == "drama3_patches.patches._npu_omni_ar_runner"
    assert w["omni_on_ascend_v2"] is True
    assert w["event_at_init"] == "NPUEventStandIn"  # torch.cuda.Event was torch.npu's while building
    assert w["wrapper_entries"] == 2  # ours around the whole Omni runner, vLLM-Ascend's inside it
    assert w["instance_runner_cls_left"] is False
    assert w["lora_forwarding"] is True
    assert len(w["log"]) == 1 and w["log"][0].startswith("Using MR v2 NPUOmniARModelRunner")
    assert "stage 0 (fish_omni)" in w["log"][0]


def test_stage_choice_overrides_the_process_default(result):
    _, out = result
    workers = out["patched"]["workers"]
    for key in ("ar_stage_v1_default_v2", "ar_stage_unset_default_v2"):
        w = workers[key]
        assert w["process_default"] is True and w["flag"] is False, key
        assert w["runner"] == "NPUARModelRunner", key
        assert w["log"] == ["Using MR v1 NPUARModelRunner on NPU for stage 0 (fish_omni)"], key
    gen = workers["gen_stage_v1_default_v2"]
    assert gen["process_default"] is True and gen["flag"] is False
    assert gen["runner"] == "NPUGenerationModelRunner"


def test_dac_stage_refuses_v2_naming_the_stage(result):
    _, out = result
    error = out["patched"]["workers"]["gen_stage_v2"]["error"]
    assert error.startswith("ValueError: stage 1 (dac_decoder) runs on NPUGenerationWorker")
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


SHIPPED_RUNNER = '''\
# SYNTHETIC: a vLLM-Omni NPU V2 AR runner as a future release might ship it (none does yet).
from vllm_ascend.worker.v2.model_runner import NPUModelRunner
from vllm_omni.worker_v2.omni_ar_model_runner import OmniARModelRunner


class ShippedNPUOmniARModelRunner(OmniARModelRunner, NPUModelRunner):
    pass
'''

def variants_child(runner_dir: str, target: str) -> dict:
    """Started with DRAMA3_PATCHES=0: each variant is in place before the plan runs."""
    import drama3_patches
    from vllm.config import DeviceConfig, VllmConfig

    ns = _setup([])
    sc = ns.sc
    import vllm_omni.platforms.npu.worker as npu_worker_package

    npu_worker_package.__path__.insert(0, runner_dir)  # a runner vllm-omni would ship beside its own
    real_loader = sc._apply_platform_overrides

    def accepting_loader(deploy, platform=None):
        # SYNTHETIC: a loader that refuses Model Runner V2 on xpu only.
        if platform == "npu":
            return real_loader(deploy, "npu-accepting")
        return real_loader(deploy, platform)

    accepting_loader.__module__ = sc.__name__
    sc._apply_platform_overrides = accepting_loader
    drama3_patches.apply()
    from vllm_omni.platforms.npu.worker.npu_ar_worker import NPUARWorker

    out = {"loader": _mine()[target]}
    cfg = VllmConfig(device_config=DeviceConfig(device="cpu"))
    cfg.model_config = SimpleNamespace(stage_id=0, model_stage="fish_omni", use_v2_model_runner=True)
    w = NPUARWorker(vllm_config=cfg, local_rank=0, rank=0, distributed_init_method="tcp://127.0.0.1:1")
    w.init_device()
    out["runner"] = [type(w.model_runner).__name__, type(w.model_runner).__module__]
    return out


def test_upstream_fixes_are_detected_by_behaviour(tmp_path):
    (tmp_path / "npu_v2_ar_model_runner.py").write_text(SHIPPED_RUNNER)
    out = _run(variants_child, profile_paths(ASCEND_MAIN), [tmp_path, TARGETS[0]], DRAMA3_PATCHES="0")
    # A loader that accepts v2 on npu: that target is not needed (the workers still are).
    assert out["loader"]["state"] == "not-needed"
    assert "already accepts model_runner v2 on npu" in out["loader"]["reason"]
    # A V2 AR runner that vLLM-Omni ships (OmniARModelRunner on vLLM-Ascend's V2) is built instead.
    assert out["runner"] == ["ShippedNPUOmniARModelRunner", "vllm_omni.platforms.npu.worker.npu_v2_ar_model_runner"]


def _plan_on_stubs():
    """plan() on stand-in originals of the three worker targets (what the plan does with them does
    not depend on vLLM-Omni's NPU workers, which need vLLM-Ascend)."""
    from drama3_patches.patches import runner_selection as rs
    from drama3_patches.patchlib import PatchContext

    def ar_init(self, vllm_config):
        self.vllm_config, self.use_v2_model_runner = vllm_config, False  # the parent's process-wide choice

    def generation_init(self, vllm_config):
        self.vllm_config = vllm_config

    def ar_init_device(self):
        pass

    originals = {rs.AR_INIT: ar_init, rs.GENERATION_INIT: generation_init, rs.AR_INIT_DEVICE: ar_init_device}
    ctx = PatchContext("runner-selection", tuple(originals), "npu", {}, rs.logger, _resolve=originals.__getitem__)
    return rs, ctx, rs.plan(ctx)


@pytest.mark.forked
def test_without_model_runner_v1_every_stage_runs_on_v2():
    """vLLM 0.34 removed Model Runner V1 (stand-in: support.vllm_removed; its VllmConfig and model
    config have no use_v2_model_runner): the DAC stage must run on V2, so the generation worker's
    refusal is left out, and the AR worker takes V2 whatever its stage's config says."""
    from support.vllm_removed import as_vllm_0_34

    as_vllm_0_34()
    rs, ctx, out = _plan_on_stubs()
    assert rs.model_runner_v1_removed()
    assert set(out) == {rs.AR_INIT, rs.AR_INIT_DEVICE}
    assert ctx.left[rs.GENERATION_INIT] == ("vLLM has no Model Runner V1 (vllm.v1.worker.gpu_model_runner; removed "
                                            "in vLLM 0.34): every stage runs on V2; nothing to refuse")
    assert ctx.notes[rs.AR_INIT] == rs.NO_V1
    worker = SimpleNamespace()
    out[rs.AR_INIT](worker, SimpleNamespace(model_config=SimpleNamespace(stage_id=0)))
    assert worker.use_v2_model_runner is True


def test_with_model_runner_v1_each_stage_keeps_its_choice():
    """The installed vLLM (0.31/0.32) has V1: the stage's flag decides and V2 is refused on the
    generation worker, as before."""
    rs, ctx, out = _plan_on_stubs()
    assert not rs.model_runner_v1_removed()
    assert set(out) == {rs.AR_INIT, rs.AR_INIT_DEVICE, rs.GENERATION_INIT} and not ctx.notes
    worker = SimpleNamespace()
    out[rs.AR_INIT](worker, SimpleNamespace(model_config=SimpleNamespace(stage_id=0)))
    assert worker.use_v2_model_runner is False
    with pytest.raises(ValueError, match="set `model_runner: v1` for this stage"):
        out[rs.GENERATION_INIT](SimpleNamespace(), SimpleNamespace(
            model_config=SimpleNamespace(stage_id=1, use_v2_model_runner=True)))

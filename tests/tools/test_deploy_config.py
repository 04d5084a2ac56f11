"""The shipped NPU deploy configs: derived from the published fish_omni.yaml, our schema check,
the command, and vLLM-Omni's own loader (the installed 0.31.0rc1 or 0.32.0rc1) on npu."""

from __future__ import annotations

import copy
import fnmatch
import os
from importlib import metadata
from pathlib import Path

import pytest
import yaml

from drama3_patches.tools.deploy_config import profiles as deployconf
from support.replicas import ASCEND_MAIN, installed, profile
from support.subproc import ROOT, call, run_cli

DEPLOY_DIR = ROOT / "drama3_patches" / "tools" / "deploy_config" / "configs"


def test_every_shipped_yaml_is_a_profile_and_every_profile_is_shipped():
    shipped = sorted(p.name for p in DEPLOY_DIR.glob("*.yaml"))
    assert shipped == sorted(deployconf.PROFILES.values())


@pytest.mark.parametrize("name", sorted(deployconf.PROFILES))
def test_shipped_profiles_pass_the_schema_check(name):
    assert deployconf.validate(deployconf.load_profile(name)) == []


def test_910b_profile_is_tp2_ep_eager_v2_with_dac_on_v1_sharing_card_1():
    doc = deployconf.load_profile("910b-tp2-ep")
    s0, s1 = deployconf.effective_stages(doc, "npu")
    assert (s0["stage_id"], s1["stage_id"]) == (0, 1)
    assert s0["devices"] == "0,1" and s0["tensor_parallel_size"] == 2
    assert s0["enable_expert_parallel"] is True and s0["enforce_eager"] is True
    assert s0["block_size"] == 128  # from platforms.npu
    # The runner is chosen per stage, as in the published deploy; nothing at the deploy level.
    assert "model_runner" not in doc and "model_runner" not in doc["platforms"]["npu"]
    assert deployconf.effective_runner(doc, "npu", s0) == "v2"
    assert deployconf.effective_runner(doc, "npu", s1) == "v1"
    assert s1["devices"] == "1"
    assert s0["gpu_memory_utilization"] + s1["gpu_memory_utilization"] <= 1.0
    assert s0["output_connectors"]["to_stage_1"] == s1["input_connectors"]["from_stage_0"]


def test_mxfp8_profile_is_one_card():
    doc = deployconf.load_profile("mxfp8-1card")
    stages = deployconf.effective_stages(doc, "npu")
    assert {s["devices"] for s in stages} == {"0"}
    assert all(s.get("tensor_parallel_size", 1) == 1 for s in stages)
    assert deployconf.effective_runner(doc, "npu", stages[0]) == "v2"
    assert deployconf.effective_runner(doc, "npu", stages[1]) == "v1"


def test_effective_runner_follows_the_loaders_rules():
    doc = {"model_runner": "v1", "platforms": {"npu": {"model_runner": "v2"}, "xpu": {"model_runner": "v1"}}}
    assert deployconf.effective_runner(doc, "npu", {"stage_id": 0}) == "v2"   # the section's
    assert deployconf.effective_runner(doc, "npu", {"stage_id": 1, "model_runner": "v1"}) == "v1"
    assert deployconf.effective_runner(doc, None, {"stage_id": 0}) == "v1"
    # A platform's v1 fallback clears a stage's own v2.
    assert deployconf.effective_runner(doc, "xpu", {"stage_id": 0, "model_runner": "v2"}) == "v1"


def _flat(doc: dict) -> dict:
    """Leaves by dotted path; stages by stage_id; a platform section is one leaf."""
    out = {}

    def walk(prefix, value):
        if prefix.startswith("platforms.") and prefix.count(".") == 1:
            out[prefix] = value
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif prefix == "stages":
            for stage in value:
                walk(f"stages.{stage['stage_id']}", {k: v for k, v in stage.items() if k != "stage_id"})
        else:
            out[prefix] = value

    walk("", doc)
    return out


def test_profiles_differ_from_the_published_deploy_only_where_listed():
    if installed("vllm-omni") != "0.32.0rc1":
        pytest.skip(f"vllm-omni {installed('vllm-omni')} installed: fish_omni.yaml is published in 0.32.0rc1")
    # Read from the installed wheel without importing vllm_omni (its import patches vLLM).
    published_doc = yaml.safe_load(Path(metadata.distribution("vllm-omni").locate_file(
        "vllm_omni/deploy/fish_omni.yaml")).read_text())
    published = _flat(published_doc)
    used = set()
    for name in deployconf.PROFILES:
        ours = _flat(deployconf.load_profile(name))
        for path in sorted(set(published) | set(ours)):
            if published.get(path, "absent") == ours.get(path, "absent"):
                continue
            why = [p for p in deployconf.DIFFERENCES_FROM_PUBLISHED
                   if fnmatch.fnmatchcase(path, p) or fnmatch.fnmatchcase(path, p + ".*")]
            assert why, f"{name}: {path} differs from the published deploy ({published.get(path)!r} -> " \
                        f"{ours.get(path)!r}) and DIFFERENCES_FROM_PUBLISHED does not say why"
            used.update(why)
        # No CUDA-only knob is left on.
        assert deployconf.validate(deployconf.load_profile(name)) == []
    assert used == set(deployconf.DIFFERENCES_FROM_PUBLISHED), "stale entries: " \
        f"{sorted(set(deployconf.DIFFERENCES_FROM_PUBLISHED) - used)}"
    # The published file itself carries CUDA-only knobs the check names.
    problems = deployconf.validate(published_doc)
    assert any("fish_speech_dac_cuda_graphs is CUDA-only" in p for p in problems), problems


def _mutations():
    def typo(d):
        d["stages"][0]["max_num_seq"] = 4

    def forbidden(d):
        d["stages"][1]["use_v2_model_runner"] = False

    def tp_devices(d):
        d["stages"][0]["devices"] = "0"

    def connector(d):
        d["stages"][1]["input_connectors"]["from_stage_0"] = "nope"

    def memory(d):
        d["stages"][1]["gpu_memory_utilization"] = 0.3

    def overlay_memory(d):
        d["platforms"]["npu"]["stages"].append({"stage_id": 1, "gpu_memory_utilization": 0.5})

    def runner(d):
        d["platforms"]["npu"]["model_runner"] = "v3"

    def ghost(d):
        d["platforms"]["npu"]["stages"].append({"stage_id": 7, "block_size": 128})

    def dup(d):
        d["stages"][1]["stage_id"] = 0

    def top(d):
        d["stage_args"] = []

    def dac_graphs(d):
        d["connectors"]["connector_of_shared_memory"]["extra"]["fish_speech_dac_cuda_graphs"] = True

    def mps(d):
        d["platforms"]["npu"]["cuda_mps"] = True

    def stage_runner(d):
        d["stages"][0]["model_runner"] = "v3"

    return {
        "typo": (typo, "unknown stage key 'max_num_seq'"),
        "forbidden": (forbidden, "'use_v2_model_runner' is set by vLLM-Omni"),
        "tp_devices": (tp_devices, "tensor_parallel_size 2 needs 2 devices"),
        "connector": (connector, "unknown connector 'nope'"),
        "memory": (memory, "card 1 is given gpu_memory_utilization 1.10"),
        "overlay_memory": (overlay_memory, "platform npu: card 1 is given gpu_memory_utilization 1.30"),
        "runner": (runner, "platforms.npu.model_runner must be one of"),
        "ghost": (ghost, "no stage 7 to override"),
        "dup": (dup, "duplicate stage ids"),
        "top": (top, "removed `stage_args` schema"),
        "dac_graphs": (dac_graphs, "fish_speech_dac_cuda_graphs is CUDA-only"),
        "mps": (mps, "platforms.npu.cuda_mps: CUDA MPS has no NPU counterpart"),
        "stage_runner": (stage_runner, "stages[0]: model_runner must be one of"),
    }


@pytest.mark.parametrize("case", sorted(_mutations()))
def test_schema_check_names_each_mistake(case):
    mutate, expected = _mutations()[case]
    doc = copy.deepcopy(deployconf.load_profile("910b-tp2-ep"))
    mutate(doc)
    problems = deployconf.validate(doc)
    assert any(expected in p for p in problems), problems


def test_command_writes_the_shipped_file(tmp_path):
    out = tmp_path / "d.yaml"
    r = run_cli("deploy-config", "910b-tp2-ep", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert out.read_text() == (DEPLOY_DIR / "drama3_910b_tp2_ep.yaml").read_text()
    r = run_cli("deploy-config", "mxfp8-1card")
    assert r.returncode == 0
    assert yaml.safe_load(r.stdout) == deployconf.load_profile("mxfp8-1card")


def test_command_default_profile_and_list():
    r = run_cli("deploy-config")
    assert r.returncode == 0
    assert r.stdout == (DEPLOY_DIR / deployconf.PROFILES[deployconf.DEFAULT_PROFILE]).read_text()
    r = run_cli("deploy-config", "--list")
    assert r.returncode == 0
    assert [line.split("\t")[0] for line in r.stdout.splitlines()] == deployconf.profile_names()


def test_command_bad_input_gets_one_clear_line(tmp_path):
    r = run_cli("deploy-config", "h100")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "drama3-patches deploy-config: unknown profile 'h100'; known: 910b-tp2-ep, 910b-tp2-ep-graph, mxfp8-1card"]
    r = run_cli("deploy-config", "--out", str(tmp_path / "missing" / "x.yaml"))
    assert r.returncode == 1
    assert "cannot write" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_out_never_overwrites_without_force(tmp_path):
    out = tmp_path / "deploy.yaml"
    out.write_text("# the operator's own edits\n")
    r = run_cli("deploy-config", "910b-tp2-ep", "--out", str(out))
    assert (r.returncode, r.stderr.strip()) == (2, f"drama3-patches deploy-config: {out} exists; pass --force to "
                                                   "overwrite it")
    assert out.read_text() == "# the operator's own edits\n"
    link = tmp_path / "link.yaml"
    link.symlink_to(tmp_path / "elsewhere.yaml")  # a dangling link exists too: not written through
    r = run_cli("deploy-config", "--out", str(link))
    assert r.returncode == 2 and not (tmp_path / "elsewhere.yaml").exists()
    r = run_cli("deploy-config", "910b-tp2-ep", "--out", str(out), "--force")
    assert r.returncode == 0, r.stderr
    assert out.read_text() == (DEPLOY_DIR / "drama3_910b_tp2_ep.yaml").read_text()
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)  # no reader: a blocking open for writing would hang
    r = run_cli("deploy-config", "--out", str(fifo), "--force", timeout=60)
    assert r.returncode == 1 and "cannot write" in r.stderr and len(r.stderr.strip().splitlines()) == 1


# Run with DRAMA3_PATCHES=1 and the platform npu (a vllm-ascend stand-in makes runner-selection's
# guards pass; the loader needs nothing else), then with the patch removed.
def real_loader(paths: list) -> dict:
    """Runs in a fresh interpreter started with the patches on (platform npu), as an NPU host is:
    vLLM-Omni's own loader on each file, per platform, then again with runner-selection removed."""
    import dataclasses

    import drama3_patches
    from vllm_omni.config import stage_config as sc

    def err(fn):
        try:
            return fn()
        except Exception as exc:
            return type(exc).__name__ + ": " + str(exc)

    def on(path, platform):
        d = sc._apply_platform_overrides(sc.load_deploy_config(path), platform)
        return [d.model_runner, [sc.resolve_stage_model_runner(d, s) for s in d.stages],
                [s.engine_extras.get("block_size") for s in d.stages]]

    out = {"fields": sorted(f.name for f in dataclasses.fields(sc.StageDeployConfig)),
           "top": sorted(f.name for f in dataclasses.fields(sc.DeployConfig))}
    for path in paths:
        d = sc.load_deploy_config(path)
        out[path] = {
            "stages": [[s.stage_id, s.devices, s.tensor_parallel_size, s.enable_expert_parallel,
                        s.gpu_memory_utilization, s.model_runner, s.engine_extras] for s in d.stages],
            "npu": err(lambda: on(path, "npu")), "xpu": err(lambda: on(path, "xpu")),
            "cuda": err(lambda: on(path, "cuda")),
        }
    drama3_patches.unapply(["runner-selection"])
    for path in paths:
        out[path]["npu_unpatched"] = err(lambda: on(path, "npu"))
    return out


def test_real_vllm_omni_loader_reads_our_configs():
    paths = [str(DEPLOY_DIR / f) for f in sorted(deployconf.PROFILES.values())]
    result = call(real_loader, paths, env={"DRAMA3_PATCHES": "1", "DRAMA3_PATCHES_PLATFORM": "npu"},
                  pythonpath=[profile(ASCEND_MAIN)])
    # Our list of stage keys is a subset of the installed vLLM-Omni's.
    assert deployconf.STAGE_FIELDS - {"engine_args", "runtime"} <= set(result["fields"])
    assert deployconf.TOP_LEVEL_KEYS - {"base_config"} <= set(result["top"])
    for name in deployconf.PROFILES.values():
        got = result[str(DEPLOY_DIR / name)]
        # Stage 0 on V2, stage 1 on V1, as the published deploy asks; the platform's block size.
        assert got["npu"] == ["v1", ["v2", "v1"], [128, None]], name
        assert got["xpu"].startswith("NotImplementedError: Model Runner V2 is not supported on XPU"), name
        assert got["cuda"] == ["v1", ["v2", "v1"], [None, None]], name
        # Unpatched, vLLM-Omni refuses Model Runner V2 on NPU: the reason these need the patch.
        assert got["npu_unpatched"].startswith("NotImplementedError: Model Runner V2 is not supported on NPU"), name
        # The per-stage runner is the loader's own field; the rest passes through to the engine.
        for stage in got["stages"]:
            # 910b-tp2-ep's stage 0 also asks vLLM's EP weight filter (an engine argument) for its ranks.
            ep_filter = {"enable_ep_weight_filter": True} if stage[3] else {}
            assert stage[6] == {"trust_remote_code": False, "enable_prefix_caching": False, **ep_filter}, (name, stage)
    tp2 = result[str(DEPLOY_DIR / "drama3_910b_tp2_ep.yaml")]["stages"]
    assert tp2[0][:6] == [0, "0,1", 2, True, 0.8, "v2"]
    assert tp2[1][:6] == [1, "1", 1, None, 0.12, "v1"]

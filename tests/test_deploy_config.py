"""The shipped deploy configs: our schema check, the command, and vLLM-Omni's own loader."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from drama3_patches import deployconf

REPO = Path(__file__).resolve().parents[1]
DEPLOY_DIR = REPO / "drama3_patches" / "deploy"


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.pop("DRAMA3_PATCHES", None)
    return env


def _cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "drama3_patches.cli", *args], capture_output=True, text=True,
                          env=_env(), cwd=cwd, timeout=120)


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
    assert deployconf.effective_runner(doc, "npu", s0) == "v2"
    assert deployconf.effective_runner(doc, "npu", s1) == "v1"
    assert s1["devices"] == "1"
    assert s0["gpu_memory_utilization"] + s1["gpu_memory_utilization"] <= 1.0
    # Off NPU nothing asks for V2 at the deploy level.
    assert doc["model_runner"] == "v1"
    assert s0["output_connectors"]["to_stage_1"] == s1["input_connectors"]["from_stage_0"]


def test_mxfp8_profile_is_one_card():
    doc = deployconf.load_profile("mxfp8-1card")
    stages = deployconf.effective_stages(doc, "npu")
    assert {s["devices"] for s in stages} == {"0"}
    assert all(s.get("tensor_parallel_size", 1) == 1 for s in stages)
    assert deployconf.effective_runner(doc, "npu", stages[0]) == "v2"
    assert deployconf.effective_runner(doc, "npu", stages[1]) == "v1"


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
    r = _cli("deploy-config", "910b-tp2-ep", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert out.read_text() == (DEPLOY_DIR / "drama3_910b_tp2_ep.yaml").read_text()
    r = _cli("deploy-config", "mxfp8-1card")
    assert r.returncode == 0
    assert yaml.safe_load(r.stdout) == deployconf.load_profile("mxfp8-1card")


def test_command_default_profile_and_list():
    r = _cli("deploy-config")
    assert r.returncode == 0
    assert r.stdout == (DEPLOY_DIR / deployconf.PROFILES[deployconf.DEFAULT_PROFILE]).read_text()
    r = _cli("deploy-config", "--list")
    assert r.returncode == 0
    assert [line.split("\t")[0] for line in r.stdout.splitlines()] == deployconf.profile_names()


def test_command_bad_input_gets_one_clear_line(tmp_path):
    r = _cli("deploy-config", "h100")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "drama3-patches deploy-config: unknown profile 'h100'; known: 910b-tp2-ep, mxfp8-1card"]
    r = _cli("deploy-config", "--out", str(tmp_path / "missing" / "x.yaml"))
    assert r.returncode == 1
    assert "cannot write" in r.stderr and len(r.stderr.strip().splitlines()) == 1


_REAL_LOADER = textwrap.dedent("""
    import json, sys, dataclasses
    try:
        from vllm_omni.config import stage_config as sc
    except Exception as exc:  # any failure to import means: not importable here
        print(json.dumps({"skip": f"{type(exc).__name__}: {exc}"}))
        raise SystemExit(0)
    out = {"fields": sorted(f.name for f in dataclasses.fields(sc.StageDeployConfig)),
           "top": sorted(f.name for f in dataclasses.fields(sc.DeployConfig))}
    for path in sys.argv[1:]:
        d = sc.load_deploy_config(path)
        r = {"runner": d.model_runner,
             "stages": [[s.stage_id, s.devices, s.tensor_parallel_size, s.enable_expert_parallel,
                         s.gpu_memory_utilization, s.engine_extras] for s in d.stages]}
        try:
            sc._apply_platform_overrides(d, "npu")
            r["npu"] = ["ok", d.model_runner, [s.engine_extras for s in d.stages]]
        except NotImplementedError as exc:
            r["npu"] = ["refused", str(exc)]
        d = sc.load_deploy_config(path)
        sc._apply_platform_overrides(d, "cuda")
        r["cuda_runner"] = d.model_runner
        out[path] = r
    print(json.dumps(out))
""")


def test_real_vllm_omni_loader_reads_our_configs():
    paths = [str(DEPLOY_DIR / f) for f in sorted(deployconf.PROFILES.values())]
    env = _env()
    env["DRAMA3_PATCHES"] = "0"
    r = subprocess.run([sys.executable, "-c", _REAL_LOADER, *paths], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    if "skip" in result:
        pytest.skip(f"vllm_omni.config.stage_config is not importable here: {result['skip']}")
    # Our list of stage keys is a subset of the installed vLLM-Omni's.
    assert deployconf.STAGE_FIELDS - {"engine_args", "runtime"} <= set(result["fields"])
    assert deployconf.TOP_LEVEL_KEYS - {"base_config"} <= set(result["top"])
    tp2 = result[str(DEPLOY_DIR / "drama3_910b_tp2_ep.yaml")]
    assert tp2["runner"] == "v1" and tp2["cuda_runner"] == "v1"
    assert tp2["stages"][0][:4] == [0, "0,1", 2, True]
    assert tp2["stages"][1][:3] == [1, "1", 1]
    # The per-stage runner key travels as an engine extra for the runner-selection patch.
    assert tp2["stages"][0][5]["model_runner"] == "v2" and tp2["stages"][1][5]["model_runner"] == "v1"
    # Without the patches (DRAMA3_PATCHES=0 above), vLLM-Omni refuses Model Runner V2 on NPU:
    # the reason this profile needs the runner-selection patch.
    assert tp2["npu"][0] == "refused"
    assert "Model Runner V2 is not supported on NPU" in tp2["npu"][1]

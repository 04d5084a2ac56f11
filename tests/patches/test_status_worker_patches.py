"""``drama3-patches status --import-targets`` for runner-selection, lora-count-forwarding and
mamba-prefill-end on the installed vLLM + vllm-omni pair: applied where vllm-ascend stand-ins
make this host look like an Ascend one, skipped or failed with the reason otherwise."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from support.replicas import ASCEND_032, ASCEND_MAIN, installed, npu_env, npu_worker_prelude, profile_paths
from support.subproc import child_env, run_cli

pytestmark = pytest.mark.vllm

MINE = ("runner-selection", "lora-count-forwarding", "mamba-prefill-end")
ARGS = ["status", "--import-targets", "--json"]


def _parse(proc) -> dict:
    assert proc.returncode in (0, 1), proc.stderr
    data = json.loads(proc.stdout[proc.stdout.index("{"):])
    got = {p["id"]: p for p in data["patches"] if p["id"] in MINE}
    return got | {"_versions": data["versions"], "_rc": proc.returncode}


def _status_with_npu_workers(ascend: str) -> dict:
    # The command, run after the prelude that puts the NPU runner stand-ins in the real package.
    code = npu_worker_prelude() + f"import sys\nfrom drama3_patches.tools import main\nsys.exit(main({ARGS!r}))\n"
    proc = subprocess.run([sys.executable, "-c", code], env=child_env(npu_env(), profile_paths(ascend)),
                          capture_output=True, text=True, timeout=600)
    return _parse(proc)


@pytest.mark.parametrize("ascend", [ASCEND_MAIN, ASCEND_032])
def test_applied_with_targets_on_npu_with_a_profile(ascend):
    got = _status_with_npu_workers(ascend)
    assert got["_versions"]["vllm-omni"] == installed("vllm-omni")
    assert got["_versions"]["vllm-ascend"] is not None
    for pid in MINE:
        assert got[pid]["state"] == "applied", (pid, got[pid]["reason"])
        for target, state in got[pid]["target_states"].items():
            assert state["state"] == "applied", (pid, target, state)
    assert "vllm_omni.platforms.npu.worker.npu_ar_worker:NPUARWorker.init_device" in got["runner-selection"]["targets"]


def test_skipped_on_a_plain_cpu_host():
    got = _parse(run_cli(*ARGS, env={"DRAMA3_PATCHES": "1"}))
    for pid in MINE:
        assert got[pid]["state"] == "skipped", pid
        assert got[pid]["reason"] == "platform cpu not in ['npu']", pid


def test_skipped_without_vllm_ascend_even_when_told_npu():
    got = _parse(run_cli(*ARGS, env=npu_env()))
    assert got["_versions"]["vllm-ascend"] is None
    for pid in MINE:
        assert got[pid]["state"] == "skipped", pid
        assert "vllm-ascend" in got[pid]["reason"] and "not installed" in got[pid]["reason"], got[pid]["reason"]


def test_npu_workers_that_cannot_import_fail_loudly():
    # vllm-ascend present (a stand-in), but nothing stands in for the published NPU runner modules,
    # which import vllm-ascend internals: the worker targets are inside every range and absent.
    proc = run_cli(*ARGS, env=npu_env(), pythonpath=profile_paths(ASCEND_MAIN))
    got = _parse(proc)
    assert got["_rc"] == 1
    rs = got["runner-selection"]
    assert rs["state"] == "failed"
    assert "npu_ar_worker" in rs["reason"] and "cannot be imported" in rs["reason"], rs["reason"]
    assert "ModuleNotFoundError" in rs["reason"]
    # The loader target applies all or none with the workers.
    loader = rs["target_states"]["vllm_omni.config.stage_config:_apply_platform_overrides"]
    assert loader["state"] == "failed"
    assert got["mamba-prefill-end"]["state"] == "applied"

"""``drama3-patches status --import-targets`` for runner-selection, lora-count-forwarding and
mamba-prefill-end: applied with their targets where the replicas stand in for an Ascend host,
skipped with the reason on this CPU host without vllm-omni or vllm-ascend."""

from __future__ import annotations

import json

import pytest

from tests.support.replicas import ASCEND_032, ASCEND_MAIN, OMNI_030, npu_env, profile_paths
from tests.support.subproc import run_cli

pytestmark = pytest.mark.vllm

MINE = ("runner-selection", "lora-count-forwarding", "mamba-prefill-end")


def _status(env, pythonpath=None) -> dict:
    proc = run_cli("status", "--import-targets", "--json", env=env, pythonpath=pythonpath)
    assert proc.returncode in (0, 1), proc.stderr
    data = json.loads(proc.stdout)
    return {p["id"]: p for p in data["patches"] if p["id"] in MINE} | {"_versions": data["versions"]}


@pytest.mark.parametrize("ascend", [ASCEND_MAIN, ASCEND_032])
def test_applied_with_targets_on_npu_with_a_profile(ascend):
    got = _status(npu_env(), profile_paths(ascend, OMNI_030))
    assert got["_versions"]["vllm-omni"] == "0.30.0"
    assert got["_versions"]["vllm-ascend"] is not None
    for pid in MINE:
        assert got[pid]["state"] == "applied", (pid, got[pid]["reason"])
        assert got[pid]["targets"], pid
        for target, state in got[pid]["target_states"].items():
            assert state["state"] == "applied", (pid, target, state)
    assert "vllm_omni.platforms.npu.worker.npu_ar_worker:NPUARWorker.init_device" in got["runner-selection"]["targets"]


def test_skipped_on_a_plain_cpu_host():
    got = _status({"DRAMA3_PATCHES": "1"})
    for pid in MINE:
        assert got[pid]["state"] == "skipped", pid
        assert got[pid]["reason"] == "platform cpu not in ['npu']", pid


def test_skipped_without_vllm_omni_even_when_told_npu():
    got = _status(npu_env())
    assert got["_versions"]["vllm-omni"] is None
    for pid in ("runner-selection", "lora-count-forwarding"):
        assert got[pid]["state"] == "skipped"
        assert "vllm-omni" in got[pid]["reason"] and "not installed" in got[pid]["reason"], got[pid]["reason"]
    assert got["mamba-prefill-end"]["state"] == "skipped"
    assert "vllm-ascend" in got["mamba-prefill-end"]["reason"]


def test_omni_032_profile_without_worker_stand_ins_is_skipped_with_the_reason():
    # The omni_032 profile mirrors only the port's Drama 3 model files (no public 0.32 source
    # for the deploy loader or the NPU workers): the version guards pass, the targets are
    # absent, and status says which module is missing instead of claiming anything applied.
    got = _status(npu_env(), profile_paths(ASCEND_032, "omni_032"))
    assert got["_versions"]["vllm-omni"] == "0.32.0"
    for pid in ("runner-selection", "lora-count-forwarding"):
        assert got[pid]["state"] == "skipped", pid
        assert "cannot be imported" in got[pid]["reason"] and "ModuleNotFoundError" in got[pid]["reason"], pid
    assert got["mamba-prefill-end"]["state"] == "applied"

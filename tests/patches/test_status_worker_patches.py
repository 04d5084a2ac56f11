"""``drama3-patches status --import-targets`` for runner-selection, lora-count-forwarding and
mamba-prefill-end on the installed vLLM + vllm-omni pair: applied where vllm-ascend stand-ins
make this host look like an Ascend one, skipped or failed with the reason otherwise."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from support.replicas import (
    ASCEND_030RC2, ASCEND_032, ASCEND_MAIN, enter_npu_workers, installed, npu_env, profile_paths,
)
from support.subproc import call, run_cli

pytestmark = pytest.mark.vllm

MINE = ("runner-selection", "lora-count-forwarding", "mamba-prefill-end")
ARGS = ["status", "--import-targets", "--json"]


def _parse(proc) -> dict:
    assert proc.returncode in (0, 1), proc.stderr
    data = json.loads(proc.stdout[proc.stdout.index("{"):])
    got = {p["id"]: p for p in data["patches"] if p["id"] in MINE}
    return got | {"_versions": data["versions"], "_rc": proc.returncode}


def status_child() -> dict:
    """The command, run after the NPU runner stand-ins are put in the real package."""
    import contextlib
    import io

    from drama3_patches.tools import main

    enter_npu_workers()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(ARGS)
    return {"returncode": rc, "stdout": out.getvalue()}


def _status_with_npu_workers(ascend: str) -> dict:
    # A fresh interpreter started with the engine enabled, as `drama3-patches status` is.
    got = call(status_child, env=npu_env(), pythonpath=profile_paths(ascend), timeout=600)
    return _parse(SimpleNamespace(stderr="", **got))


@pytest.mark.parametrize("ascend", [ASCEND_MAIN, ASCEND_030RC2, ASCEND_032])
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

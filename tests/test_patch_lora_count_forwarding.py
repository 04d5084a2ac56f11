"""lora-count-forwarding on the NPU Omni V2 AR runner, for each vllm-ascend replica profile.

vllm-ascend main's V2 ``prepare_inputs`` takes three arguments, the 0.32 one requires the fourth
(``num_active_loras``). The runner is called three ways: as vLLM's MR V2 calls it (four
positional), by keyword, and as vLLM-Omni 0.30's ``execute_model`` calls it (three). The parent
(the replica's real-signature stand-in) records what it received.
"""

from __future__ import annotations

import json

import pytest

from tests.support.replicas import ASCEND_032, ASCEND_MAIN, OMNI_030, npu_env, profile_paths
from tests.support.subproc import run_python

pytestmark = pytest.mark.vllm

TARGET = "drama3_patches.patches._npu_omni_ar_runner:NPUOmniARModelRunner.prepare_inputs"

CHILD = r"""
import inspect, json
from types import SimpleNamespace

import torch
from vllm.config import CUDAGraphMode
from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor

import drama3_patches
drama3_patches.apply()
from drama3_patches.patches._npu_omni_ar_runner import NPUOmniARModelRunner

out = {}
st = {p["id"]: p for p in drama3_patches.status()["patches"]}["lora-count-forwarding"]
out.update(state=st["state"], reason=st["reason"], targets=st["targets"])
out["params"] = {n: (p.default is inspect.Parameter.empty) for n, p in
                 inspect.signature(NPUOmniARModelRunner.prepare_inputs).parameters.items()}
out["qualname"] = NPUOmniARModelRunner.prepare_inputs.__qualname__


def desc(loras):
    return BatchExecutionDescriptor(cg_mode=CUDAGraphMode.NONE, num_tokens=8, num_reqs=2, num_active_loras=loras)


def calls(runner):
    results = {}
    so, brs = SimpleNamespace(name="sched"), SimpleNamespace(name="brs")

    def attempt(key, fn):
        before = len(runner.prepare_inputs_calls)
        try:
            fn()
        except TypeError as exc:
            results[key] = "TypeError: " + str(exc)
            return
        got = runner.prepare_inputs_calls[before:]
        results[key] = [len(c) for c in got] + ([got[-1][3]] if got and len(got[-1]) == 4 else [])

    attempt("vllm_four_positional", lambda: runner.prepare_inputs(so, brs, desc(7), 3))
    attempt("keyword", lambda: runner.prepare_inputs(so, brs, desc(7), num_active_loras=3))
    attempt("absent", lambda: runner.prepare_inputs(so, brs, desc(7)))
    sched = SimpleNamespace(num_active_loras=2, batch_req_state=brs, total_num_scheduled_tokens=8,
                            num_scheduled_tokens={"a": 4, "b": 4})
    attempt("omni_execute_model", lambda: runner.execute_model(sched))
    return results


runner = NPUOmniARModelRunner(SimpleNamespace(), torch.device("cpu"))
out["patched"] = calls(runner)
drama3_patches.unapply(["lora-count-forwarding"])
out["unpatched"] = calls(runner)
print("RESULT " + json.dumps(out))
"""


def _run(ascend: str) -> dict:
    proc = run_python(CHILD, env=npu_env(), pythonpath=profile_paths(ascend, OMNI_030))
    return json.loads(proc.stdout.split("RESULT ")[-1])


@pytest.fixture(scope="module", params=[ASCEND_MAIN, ASCEND_032])
def result(request):
    return request.param, _run(request.param)


def test_applied_with_its_target(result):
    _, out = result
    assert out["state"] == "applied", out["reason"]
    assert out["targets"] == [TARGET]


def test_signature_accepts_the_count_optionally(result):
    _, out = result
    assert out["qualname"] == "NPUOmniARModelRunner.prepare_inputs"
    # name -> required?
    assert out["params"] == {
        "self": True, "scheduler_output": True, "batch_req_state": True, "batch_desc": True,
        "num_active_loras": False,
    }


def test_forwarded_exactly_when_the_parent_takes_it(result):
    ascend, out = result
    if ascend == ASCEND_MAIN:
        # Parent takes three: every call form reaches it with three.
        assert out["patched"] == {
            "vllm_four_positional": [3], "keyword": [3], "absent": [3], "omni_execute_model": [3],
        }
    else:
        # Parent requires the count: given ones are forwarded; a missing one comes from batch_desc.
        assert out["patched"] == {
            "vllm_four_positional": [4, 3], "keyword": [4, 3], "absent": [4, 7], "omni_execute_model": [4, 2],
        }


def test_without_the_patch_one_caller_breaks(result):
    ascend, out = result
    unpatched = out["unpatched"]
    if ascend == ASCEND_MAIN:
        assert unpatched["vllm_four_positional"].startswith("TypeError")
        assert unpatched["absent"] == [3] and unpatched["omni_execute_model"] == [3]
    else:
        assert unpatched["omni_execute_model"].startswith("TypeError")
        assert "num_active_loras" in unpatched["omni_execute_model"]
        assert unpatched["vllm_four_positional"] == [4, 3]

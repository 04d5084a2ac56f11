"""lora-count-forwarding on the NPU Omni V2 AR runner: the published vllm-omni OmniARModelRunner
(0.31.0rc1 or 0.32.0rc1, whichever is installed) over each vllm-ascend V2 runner stand-in.

vllm-ascend main's V2 ``prepare_inputs`` takes three arguments; the port's 0.32 line requires the
fourth (``num_active_loras``). The runner is called as vLLM's MR V2 calls it (four positional), by
keyword, without the count, and through the REAL ``OmniGPUModelRunner.execute_model`` of the
installed vllm-omni (which passes four), run up to its ``prepare_inputs`` call with the steps
before it (request bookkeeping, batch-descriptor dispatch) answered by the test. The parent (the
vllm-ascend stand-in, real signature) records what it received.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from support.replicas import ASCEND_030RC2, ASCEND_032, ASCEND_MAIN, cpu_imports, npu_env, profile_paths
from support.subproc import call

pytestmark = pytest.mark.vllm

TARGET = "drama3_patches.patches._npu_omni_ar_runner:NPUOmniARModelRunner.prepare_inputs"

class _StopAfterPrepareInputs(Exception):
    pass


def _desc(loras):
    from vllm.config import CUDAGraphMode
    from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor

    return BatchExecutionDescriptor(cg_mode=CUDAGraphMode.NONE, num_tokens=8, num_reqs=2, num_active_loras=loras)


def _runner():
    import torch
    from vllm.config import DeviceConfig, VllmConfig

    from drama3_patches.patches._npu_omni_ar_runner import NPUOmniARModelRunner

    r = NPUOmniARModelRunner(VllmConfig(device_config=DeviceConfig(device="cpu")), torch.device("cpu"))
    # What execute_model does before prepare_inputs, answered here (no model, no KV cache).
    noop = lambda *args, **kwargs: None  # noqa: E731
    for name in ("_handle_kv_transfer_pre", "_prepare_native_data_plane", "finish_requests", "free_states",
                 "add_requests", "update_requests", "_sync_native_data_plane_payloads"):
        setattr(r, name, noop)
    r.block_tables = SimpleNamespace(apply_staged_writes=noop)
    r.model = SimpleNamespace()
    r.aux_output_connector = None
    r.is_encoder_decoder = False
    r.lora_config, r.lora_state = object(), object()   # a LoRA deployment: the count is computed
    r.gather_batch_req_state = lambda so, dummy: (SimpleNamespace(name="brs", num_tokens=8), None)
    r._dispatch_batch_descriptor = lambda **kw: (_desc(kw["num_active_loras"]), None)

    def prepare_attn(input_batch):
        raise _StopAfterPrepareInputs

    r.prepare_attn = prepare_attn
    return r


def _calls(r):
    results = {}
    so, brs = SimpleNamespace(name="sched"), SimpleNamespace(name="brs")

    def attempt(key, fn):
        before = len(r.prepare_inputs_calls)
        try:
            fn()
        except _StopAfterPrepareInputs:
            pass
        except TypeError as exc:
            results[key] = "TypeError: " + str(exc)
            return
        got = r.prepare_inputs_calls[before:]
        results[key] = [len(c) for c in got] + ([got[-1][3]] if got and len(got[-1]) == 4 else [])

    attempt("vllm_four_positional", lambda: r.prepare_inputs(so, brs, _desc(7), 3))
    attempt("keyword", lambda: r.prepare_inputs(so, brs, _desc(7), num_active_loras=3))
    attempt("absent", lambda: r.prepare_inputs(so, brs, _desc(7)))
    sched = SimpleNamespace(total_num_scheduled_tokens=8, num_scheduled_tokens={"a": 4, "b": 4},
                            scheduled_encoder_inputs={})
    attempt("omni_execute_model", lambda: r.execute_model(sched))
    return results


def forwarding_child() -> dict:
    """One profile's child: the runner's calls with the patch, then without it."""
    import inspect
    import sys

    cpu_imports()
    import drama3_patches

    drama3_patches.apply()
    import vllm_omni.worker_v2.omni_model_runner as omni_model_runner

    from drama3_patches.patches._npu_omni_ar_runner import NPUOmniARModelRunner

    out = {"omni_runner_file": sys.modules["vllm_omni.worker_v2.omni_ar_model_runner"].__file__}
    st = {p["id"]: p for p in drama3_patches.status()["patches"]}["lora-count-forwarding"]
    out.update(state=st["state"], reason=st["reason"], targets=st["targets"])
    out["params"] = {n: (p.default is inspect.Parameter.empty) for n, p in
                     inspect.signature(NPUOmniARModelRunner.prepare_inputs).parameters.items()}
    out["qualname"] = NPUOmniARModelRunner.prepare_inputs.__qualname__
    out["mro"] = [c.__name__ for c in NPUOmniARModelRunner.__mro__[:5]]
    omni_model_runner.get_num_active_loras_for_dispatch = lambda lora_config, lora_state, req_ids, dummy: 2
    out["patched"] = _calls(_runner())
    drama3_patches.unapply(["lora-count-forwarding"])
    out["unpatched"] = _calls(_runner())
    return out


def _run(ascend: str) -> dict:
    # A fresh interpreter started with the engine enabled (the start-up hook patches on import, as
    # deployed); one per profile, read by the tests below.
    return call(forwarding_child, env=npu_env(), pythonpath=profile_paths(ascend))


@pytest.fixture(scope="module", params=[ASCEND_MAIN, ASCEND_030RC2, ASCEND_032])
def result(request):
    return request.param, _run(request.param)


def test_applied_with_its_target_on_the_published_omni_runner(result):
    _, out = result
    assert out["state"] == "applied", out["reason"]
    assert out["targets"] == [TARGET]
    assert "site-packages" in out["omni_runner_file"]
    assert out["mro"] == ["NPUOmniARModelRunner", "OmniARModelRunner", "OmniGPUModelRunner", "NPUModelRunner",
                          "GPUModelRunner"]


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
    if ascend in (ASCEND_MAIN, ASCEND_030RC2):
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
    if ascend in (ASCEND_MAIN, ASCEND_030RC2):
        # The published execute_model passes four: vllm-ascend main's (and 0.30.0rc2's) runner takes three.
        for key in ("vllm_four_positional", "omni_execute_model"):
            assert unpatched[key] == (
                "TypeError: NPUModelRunner.prepare_inputs() takes 4 positional arguments but 5 were given"), key
        assert unpatched["absent"] == [3]
    else:
        assert unpatched["absent"].startswith("TypeError") and "num_active_loras" in unpatched["absent"]
        assert unpatched["vllm_four_positional"] == [4, 3] and unpatched["omni_execute_model"] == [4, 2]

"""fp8-expert-method fed by vLLM's own loader: a block-FP8 checkpoint in the published Drama 3
format (``bsgemm-moe``, Qwen3.5-MoE expert names) goes through vLLM's safetensors iterator,
``AutoWeightsLoader``, ``RoutedExperts.load_weights`` / ``weight_loader`` (vLLM-Ascend's routed
experts class, stand-in) into the patched method's host buffers, and vLLM's
``process_weights_after_loading`` expands it.  Checked: every expert bit for bit against the
definition, the layout vLLM-Ascend's bf16 method keeps, and the peak RSS of the whole load."""

from __future__ import annotations

import pytest

from support.replicas import ASCEND_MAIN, FISH_OMNI_ABSENT, has_fish_omni, profile_paths
from support.subproc import call

pytestmark = pytest.mark.vllm

E, H, I = 16, 1024, 320  # I is not a multiple of 128: gate and up scales are per shard

def load_child(ckpt_dir: str, device: str) -> dict:
    """The whole load in one fresh interpreter, so that its peak RSS is the load's own."""
    import json
    import os
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    B = 128
    if not has_fish_omni():  # vllm-omni 0.31.0rc1
        return {"skip": FISH_OMNI_ABSENT}
    # Before the simulated npu: with torch.npu present vllm-omni would pick its NPU platform.
    import vllm_omni.model_executor.models.fish_omni.quantization  # noqa: F401 (registers "bsgemm-moe")

    # The checkpoint: what Drama 3 publishes for its routed experts (Qwen3.5-MoE names under the
    # language model prefix, float8_e4m3fn weights, float32 weight_scale_inv per 128x128 block;
    # NaN codes and every other code present).
    g = torch.Generator().manual_seed(7)
    def fp8(n, k):
        codes = torch.randint(0, 256, (n * k,), dtype=torch.uint8, generator=g)
        codes[:256] = torch.arange(256, dtype=torch.uint8)
        return codes.view(n, k).view(torch.float8_e4m3fn)
    prefix = "model.language_model.layers.0.mlp.experts"
    tensors = {}
    for e in range(E):
        for proj, (n, k) in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
            tensors[f"{prefix}.{e}.{proj}.weight"] = fp8(n, k)
            tensors[f"{prefix}.{e}.{proj}.weight_scale_inv"] = torch.rand(-(-n // B), -(-k // B), generator=g) * 1e-2
    path = os.path.join(ckpt_dir, "model.safetensors")
    save_file(tensors, path)
    del tensors
    with open(os.path.join(ckpt_dir, "config.json"), "w") as fh:
        json.dump({"quantization_config": {"quant_method": "bsgemm-moe", "activation_scheme": "dynamic",
                                            "weight_block_size": [128, 128]}}, fh)

    import drama3_patches
    drama3_patches.apply(["fp8-expert-method"])
    row = {p["id"]: p for p in drama3_patches.status()["patches"]}["fp8-expert-method"]
    assert row["state"] == "applied", row

    from types import SimpleNamespace
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.fused_moe import FusedMoEFactory
    from vllm.model_executor.layers.quantization import get_quantization_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator
    from vllm.model_executor.models.utils import AutoWeightsLoader
    from vllm_ascend.ops.fused_moe.routed_experts import AscendRoutedExperts, AscendUnquantizedFusedMoEMethod

    from drama3_patches.kernels.fp8 import reference_dequant, resolve_kernel

    with open(os.path.join(ckpt_dir, "config.json")) as fh:
        qcfg = json.load(fh)["quantization_config"]
    config = get_quantization_config(qcfg["quant_method"]).from_config(qcfg)  # the published class

    if device == "npu":
        from support import fake_npu
        fake_npu.enable()
        AscendUnquantizedFusedMoEMethod.process_weights_after_loading = lambda self, layer: (_ for _ in ()).throw(
            AssertionError("the bf16 method's own transpose ran"))

    tid2eid = torch.arange(E)  # vLLM-Ascend's hash-routing table: must reach the method
    vllm_config = VllmConfig(device_config=DeviceConfig(device="cpu"))
    with set_current_vllm_config(vllm_config), torch.device(device):
        runner = FusedMoEFactory(
            num_experts=E, top_k=2, hidden_size=H, intermediate_size=I, params_dtype=torch.bfloat16,
            quant_config=config, tp_size=1, dp_size=1, pcp_size=1, prefix="model.layers.0.mlp.experts",
            routed_experts_cls=AscendRoutedExperts, routed_experts_args={"tid2eid": tid2eid})
    experts = runner.routed_experts
    method = experts.quant_method
    assert type(method).__name__ == "ExpandedFp8MoEMethod" and isinstance(method, AscendUnquantizedFusedMoEMethod)
    assert method.tid2eid is tid2eid
    assert {experts.w13_weight.device.type, experts.w2_weight.device.type} == {"meta"}  # no fp8 on the device

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Module()])
    model.layers[0].mlp = torch.nn.Module()
    model.layers[0].mlp.experts = runner
    resolve_kernel()  # build/load the expansion kernel now: its code pages are not the load's data

    def rss(field):
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024

    import ctypes
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    base = rss("VmRSS")
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # peak RSS counter := current RSS

    def weights():  # what FishOmniForConditionalGeneration.load_weights hands the Qwen3.5 backbone
        for name, tensor in safetensors_weights_iterator([path], use_tqdm_on_load=False):
            yield name.removeprefix("model.language_model."), tensor

    with set_current_vllm_config(vllm_config):
        loaded = AutoWeightsLoader(model).load_weights(weights())
        host_bytes = sum(p.numel() * p.element_size() for p in experts._drama3_fp8_host.values())
        model_config = SimpleNamespace(word_embeddings_untied_by_checkpoint=False, quantization="bsgemm-moe",
                                       dtype=torch.bfloat16)
        process_weights_after_loading(model, model_config, torch.device(device))
    peak = rss("VmHWM") - base

    # The result, checked after the measurement.
    w13, w2 = experts.w13_weight, experts.w2_weight
    out = {"peak_extra": peak, "file_bytes": os.path.getsize(path), "host_fp8_bytes": host_bytes,
            "out_bytes": w13.numel() * 2 + w2.numel() * 2, "expert_bf16_bytes": 2 * I * H * 2,
            "loaded": sorted(loaded), "w13": [str(w13.dtype), list(w13.shape), w13.device.type],
            "w2": [str(w2.dtype), list(w2.shape), w2.device.type],
            "scales_left": [n for n in ("w13_weight_scale_inv", "w2_weight_scale_inv") if hasattr(experts, n)],
            "host_left": hasattr(experts, "_drama3_fp8_host")}
    h13, h2 = w13.cpu(), w2.cpu()
    bad = []
    with safe_open(path, framework="pt") as f:
        def ref(e, proj):
            return reference_dequant(f.get_tensor(f"{prefix}.{e}.{proj}.weight"),
                                     f.get_tensor(f"{prefix}.{e}.{proj}.weight_scale_inv"))
        for e in range(E):
            gate_up = torch.cat([ref(e, "gate_proj"), ref(e, "up_proj")]).t().contiguous()
            if not torch.equal(h13[e].view(torch.int16), gate_up.view(torch.int16)):
                bad.append(f"w13[{e}]")
            if not torch.equal(h2[e].view(torch.int16), ref(e, "down_proj").t().contiguous().view(torch.int16)):
                bad.append(f"w2[{e}]")
    out["bits_mismatch"] = bad
    if device == "npu":
        # vLLM-Ascend's bf16 method consumes that layout: its forward against a dense MoE computed in
        # the checkpoint layout (NaN codes zeroed so that the comparison means something).
        w13.data.copy_(torch.nan_to_num(h13.float()).to(torch.bfloat16).to("npu"))
        w2.data.copy_(torch.nan_to_num(h2.float()).to(torch.bfloat16).to("npu"))
        x = torch.randn(4, H, generator=g).to(torch.bfloat16)
        ids = torch.tensor([[0, 2], [1, 0], [E - 1, 1], [3, 4]])
        wts = torch.rand(4, 2, generator=g)
        got = method.apply(experts, x.to("npu"), wts.to("npu"), ids.to("npu")).cpu().float()
        d13, d2 = w13.cpu().float(), w2.cpu().float()
        want = torch.zeros(4, H)
        for t in range(4):
            for j in range(2):
                e = int(ids[t, j])
                gu = d13[e].t() @ x[t].float()  # (2I, H) checkpoint layout
                want[t] += wts[t, j] * (d2[e].t() @ (torch.nn.functional.silu(gu[:I]) * gu[I:]))
        out["forward_max_abs_diff"] = float((got - want.to(torch.bfloat16).float()).abs().max())
        out["forward_scale"] = float(want.abs().max())
    return out


def _load(tmp_path, device: str) -> dict:
    env = {"DRAMA3_PATCHES": "1", "DRAMA3_PATCHES_PLATFORM": "npu", "DRAMA3_PATCHES_STRICT": "1"}
    res = call(load_child, str(tmp_path), device, pythonpath=profile_paths(ASCEND_MAIN), env=env, timeout=600)
    if "skip" in res:
        pytest.skip(res["skip"])
    return res


def _check_result(res: dict, device: str) -> None:
    assert res["bits_mismatch"] == [], res["bits_mismatch"]
    assert res["w13"] == ["torch.bfloat16", [E, H, 2 * I], device]  # (E, H, 2I): the Ascend layout
    assert res["w2"] == ["torch.bfloat16", [E, I, H], device]
    assert res["scales_left"] == [] and res["host_left"] is False
    assert res["loaded"] == ["layers.0.mlp.experts.routed_experts.w13_weight",
                             "layers.0.mlp.experts.routed_experts.w13_weight_scale_inv",
                             "layers.0.mlp.experts.routed_experts.w2_weight",
                             "layers.0.mlp.experts.routed_experts.w2_weight_scale_inv"]


def test_checkpoint_through_vllms_loader_expands_bit_exact_within_the_memory_bound(tmp_path):
    res = _load(tmp_path, "cpu")
    _check_result(res, "cpu")
    mib = 1 << 20
    # What the load may hold at its peak: while reading, the checkpoint's mapped pages and the host
    # fp8 buffers; while expanding, the host fp8 buffers, the bf16 output and at most one expert
    # beyond it (the kernel's scratch); plus a little for allocator and loader bookkeeping.
    reading = res["file_bytes"] + res["host_fp8_bytes"]
    expanding = res["host_fp8_bytes"] + res["out_bytes"] + res["expert_bf16_bytes"]
    bound = max(reading, expanding) + 4 * mib
    print(f"\nloader test: peak RSS of the whole load {res['peak_extra'] / mib:.1f} MiB "
          f"({res['peak_extra'] / res['out_bytes']:.2f} x the bf16 output); checkpoint {res['file_bytes'] / mib:.1f} "
          f"MiB, host fp8 {res['host_fp8_bytes'] / mib:.1f} MiB, bf16 output {res['out_bytes'] / mib:.1f} MiB, one "
          f"expert {res['expert_bf16_bytes'] / mib:.2f} MiB; bound {bound / mib:.1f} MiB")
    assert res["peak_extra"] <= bound, (res["peak_extra"] / mib, bound / mib)
    # The bound is tight enough to catch a float32 copy of w13, or a second bf16 copy of it (the
    # device transpose the port ran out of memory on).
    headroom = bound - res["peak_extra"]
    assert E * 2 * I * H * 4 > headroom and E * 2 * I * H * 2 > headroom


def test_on_the_simulated_npu_nothing_fp8_reaches_the_device_and_no_transpose_runs(tmp_path):
    res = _load(tmp_path, "npu")
    _check_result(res, "npu")
    # bf16 matmuls accumulated in float32 in both: a few bf16 ulps of the output's scale
    assert res["forward_max_abs_diff"] <= 2e-2 * res["forward_scale"] + 1e-2, res

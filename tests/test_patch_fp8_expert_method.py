"""fp8-expert-method on the port's ExpertFp8Config replica and vLLM-Ascend main replicas."""

from __future__ import annotations

import sys
import weakref
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from drama3_patches.kernels.fp8 import reference_dequant
from drama3_patches.patchlib import NotNeeded, PatchContext
from support import fake_npu

pytestmark = pytest.mark.vllm

REPLICAS = Path(__file__).resolve().parent / "replicas"
TARGET = "vllm_omni.model_executor.models.fish_omni.quantization:ExpertFp8Config.get_quant_method"
E, H, I, B = 3, 320, 192, 128  # I is not a multiple of the block: gate and up scales are per shard


def _enable_patch(monkeypatch):
    """Fresh process only: replicas on sys.path, the engine on, as on an NPU host."""
    monkeypatch.setenv("DRAMA3_PATCHES", "1")
    monkeypatch.setenv("DRAMA3_PATCHES_PLATFORM", "npu")
    monkeypatch.setenv("DRAMA3_PATCHES_STRICT", "1")
    sys.path[:0] = [str(REPLICAS / "omni_032"), str(REPLICAS / "ascend_main_2608")]
    import drama3_patches

    drama3_patches.apply(["fp8-expert-method"])
    from vllm_omni.model_executor.models.fish_omni.quantization import ExpertFp8Config

    row = {p["id"]: p for p in drama3_patches.status()["patches"]}["fp8-expert-method"]
    assert row["state"] == "applied", row
    return drama3_patches, ExpertFp8Config


def _vllm_config_context():
    """What vLLM's model construction provides: a current config (CustomOp needs one)."""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config

    return set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu")))


def _experts_layer(prefix="model.layers.0.mlp.experts"):
    from vllm.model_executor.layers.fused_moe import RoutedExperts

    layer = RoutedExperts.__new__(RoutedExperts)  # a real RoutedExperts, without its distributed setup
    torch.nn.Module.__init__(layer)
    layer.moe_config = SimpleNamespace(w13_num_shards=2, has_bias=False)
    layer.prefix = prefix
    return layer


@fake_npu.in_fresh_process
def test_experts_get_the_ascend_method_and_other_layers_the_original(monkeypatch):
    d3p, ExpertFp8Config = _enable_patch(monkeypatch)
    vllm_config = _vllm_config_context()
    vllm_config.__enter__()  # fresh process: left set (the reference keeps it entered)
    from vllm_ascend.device import device_config
    from vllm_ascend.device.hardware import AscendDeviceType
    from vllm_ascend.ops.fused_moe.routed_experts import AscendUnquantizedFusedMoEMethod
    from vllm_ascend.quantization.fp8_config import AscendFp8Config

    config = ExpertFp8Config(weight_block_size=[128, 128])
    layer = _experts_layer()
    method = config.get_quant_method(layer, layer.prefix)  # 910B (A2): CPU expansion
    assert isinstance(method, AscendUnquantizedFusedMoEMethod) and type(method).__name__ == "ExpandedFp8MoEMethod"
    assert method.weight_block_size == (128, 128) and method.moe is layer.moe_config
    assert config.get_quant_method(torch.nn.Linear(4, 4), "model.layers.0.self_attn.o_proj") is None

    # Ascend 950 (A5, MXFP8): vLLM-Ascend's own FP8 MoE method when it has one ...
    device_config.SOC_DEVICE_TYPE = AscendDeviceType.A5
    assert type(config.get_quant_method(layer, layer.prefix)).__name__ == "ExpandedFp8MoEMethod"  # main raises
    sentinel = object()
    monkeypatch.setattr(AscendFp8Config, "get_quant_method", lambda self, lyr, prefix, tid2eid=None: sentinel)
    assert config.get_quant_method(layer, layer.prefix) is sentinel

    original = d3p.get_original(TARGET)
    d3p.unapply(["fp8-expert-method"])
    assert ExpertFp8Config.__dict__["get_quant_method"] is original
    assert not hasattr(ExpertFp8Config.get_quant_method, "__drama3_patch__")


def _checkpoint(seed: int):
    """Per-expert gate/up/down fp8 weights with every code (NaN included) and block scales."""
    g = torch.Generator().manual_seed(seed)

    def fp8(n, k):
        codes = torch.randint(0, 256, (n * k,), dtype=torch.uint8, generator=g)
        codes[:256] = torch.arange(256, dtype=torch.uint8)
        return codes.view(n, k).view(torch.float8_e4m3fn)

    def scale(n, k):
        return torch.rand(-(-n // B), -(-k // B), generator=g) * 1e-2

    return [
        {"w1": fp8(I, H), "w3": fp8(I, H), "w2": fp8(H, I), "s1": scale(I, H), "s3": scale(I, H), "s2": scale(H, I)}
        for _ in range(E)
    ]


def _loader(param, loaded, weight_name, shard_id, expert_id):
    """Stand-in for vLLM's FusedMoE.weight_loader without TP/EP: gate rows, then up rows."""
    data = param.data[expert_id]
    if shard_id == "w2":
        data.copy_(loaded)
        return
    half = data.shape[0] // 2
    (data[:half] if shard_id == "w1" else data[half:]).copy_(loaded)


@fake_npu.in_fresh_process
def test_load_expand_and_serve_on_npu_without_device_fp8_or_transpose(monkeypatch):
    fake_npu.enable()
    _, ExpertFp8Config = _enable_patch(monkeypatch)
    vllm_config = _vllm_config_context()
    vllm_config.__enter__()  # fresh process: left set (the reference keeps it entered)
    from vllm_ascend.ops.fused_moe.routed_experts import AscendUnquantizedFusedMoEMethod

    def no_device_transpose(self, layer):
        raise AssertionError("the bf16 method's own transpose ran")

    monkeypatch.setattr(AscendUnquantizedFusedMoEMethod, "process_weights_after_loading", no_device_transpose)
    layer = _experts_layer()
    method = ExpertFp8Config(weight_block_size=[B, B]).get_quant_method(layer, layer.prefix)
    with torch.device("npu"):
        method.create_weights(layer, E, H, I, torch.bfloat16, weight_loader=_loader)
    for name in ("w13_weight", "w2_weight", "w13_weight_scale_inv", "w2_weight_scale_inv"):
        assert getattr(layer, name).device.type == "meta"  # nothing of the checkpoint on the device
    ckpt = _checkpoint(5)
    for e, w in enumerate(ckpt):
        for shard in ("w1", "w3", "w2"):
            param = layer.w2_weight if shard == "w2" else layer.w13_weight
            scale = layer.w2_weight_scale_inv if shard == "w2" else layer.w13_weight_scale_inv
            param.weight_loader(param, w[shard], "w", shard, e)
            scale.weight_loader(scale, w["s" + shard[1]], "s", shard, e)
    host_w13 = weakref.ref(layer._drama3_fp8_host["w13_weight"])

    with fake_npu.record_transfers() as log:
        method.process_weights_after_loading(layer)
    assert log and all((t.direction, t.non_blocking) == ("h2d", False) for t in log)
    assert host_w13() is None and not hasattr(layer, "_drama3_fp8_host")
    assert not hasattr(layer, "w13_weight_scale_inv") and not hasattr(layer, "w2_weight_scale_inv")
    w13, w2 = layer.w13_weight, layer.w2_weight
    assert w13.device.type == "npu" and w13.dtype == torch.bfloat16 and tuple(w13.shape) == (E, H, 2 * I)
    assert w2.device.type == "npu" and tuple(w2.shape) == (E, I, H)
    host13, host2 = w13.cpu(), w2.cpu()
    for e, w in enumerate(ckpt):
        gate_up = torch.cat([reference_dequant(w["w1"], w["s1"]), reference_dequant(w["w3"], w["s3"])])
        assert torch.equal(host13[e].view(torch.int16), gate_up.t().contiguous().view(torch.int16))
        assert torch.equal(host2[e].view(torch.int16), reference_dequant(w["w2"], w["s2"]).t().contiguous().view(torch.int16))

    # The bf16 method's forward consumes that layout: compare with a dense MoE in checkpoint layout.
    # (NaN codes zeroed so the comparison means something.)
    layer.w13_weight.data.copy_(torch.nan_to_num(host13.float()).to(torch.bfloat16).to("npu"))
    layer.w2_weight.data.copy_(torch.nan_to_num(host2.float()).to(torch.bfloat16).to("npu"))
    assert not torch.isnan(layer.w13_weight.cpu().float()).any()
    x = torch.randn(4, H).to(torch.bfloat16)
    ids = torch.tensor([[0, 2], [1, 0], [2, 1], [0, 1]])
    weights = torch.rand(4, 2)
    got = method.apply(layer, x.to("npu"), weights.to("npu"), ids.to("npu")).cpu()
    want = torch.zeros(4, H)
    for t in range(4):
        for k in range(2):
            e = int(ids[t, k])
            w13c = layer.w13_weight.cpu()[e].float().t()  # (2I, H) checkpoint layout
            w2c = layer.w2_weight.cpu()[e].float().t()  # (H, I)
            gu = w13c @ x[t].float()
            want[t] += weights[t, k] * (w2c @ (torch.nn.functional.silu(gu[:I]) * gu[I:]))
    assert torch.allclose(got.float(), want.to(torch.bfloat16).float(), rtol=2e-2, atol=1e-2)

    # A reload after expansion is refused instead of writing fp8 into bf16.
    with pytest.raises(RuntimeError, match="already expanded"):
        layer.w13_weight.weight_loader(layer.w13_weight, ckpt[0]["w1"], "w", "w1", 0)


@fake_npu.in_fresh_process
def test_mismatched_scale_is_refused_with_names(monkeypatch):
    fake_npu.enable()
    _, ExpertFp8Config = _enable_patch(monkeypatch)
    vllm_config = _vllm_config_context()
    vllm_config.__enter__()  # fresh process: left set (the reference keeps it entered)
    layer = _experts_layer("model.layers.7.mlp.experts")
    method = ExpertFp8Config(weight_block_size=[B, B]).get_quant_method(layer, layer.prefix)
    with torch.device("npu"):
        method.create_weights(layer, E, H, I, torch.bfloat16, weight_loader=_loader)
    host = layer._drama3_fp8_host
    host["w13_weight"].data.zero_()
    host["w13_weight_scale_inv"] = torch.nn.Parameter(torch.ones(E, 3, 3), requires_grad=False)
    with pytest.raises(ValueError, match=r"model\.layers\.7\.mlp\.experts\.w13_weight: weight_scale_inv \(3, 3, 3\)"):
        method.process_weights_after_loading(layer)


def test_plan_is_not_needed_when_the_model_already_picks_ascend():
    ns = {}
    exec(
        "def get_quant_method(self, layer, prefix):\n"
        "    from vllm_ascend.quantization.fp8_config import AscendFp8Config\n"
        "    return AscendFp8Config().get_quant_method(layer, prefix)\n",
        ns,
    )
    from drama3_patches.patches import fp8_expert_method as fem

    ctx = PatchContext("fp8-expert-method", (TARGET,), "npu", {}, fem.logger, _resolve=lambda t: ns["get_quant_method"])
    # exec'd code has no source file: inspect cannot read it, so the patch applies
    assert TARGET in fem.plan(ctx)

    def get_quant_method(self, layer, prefix):
        from vllm_ascend.quantization.fp8_config import AscendFp8Config  # noqa: F401

    ctx = PatchContext("fp8-expert-method", (TARGET,), "npu", {}, fem.logger, _resolve=lambda t: get_quant_method)
    with pytest.raises(NotNeeded, match="already selects"):
        fem.plan(ctx)


@pytest.mark.npu
def test_on_a_real_npu_expansion_lands_bit_exact_in_the_ascend_layout():
    """Ascend host only: host fp8 experts expanded into a real NPU tensor, then read back."""
    import torch_npu  # noqa: F401

    from drama3_patches.patches.fp8_expert_method import expand_layer

    ckpt = _checkpoint(9)
    layer = torch.nn.Module()
    layer._drama3_target_device = torch.device("npu", torch.npu.current_device())
    host = {
        "w13_weight": torch.stack([torch.cat([w["w1"], w["w3"]]) for w in ckpt]),
        "w13_weight_scale_inv": torch.stack([torch.cat([w["s1"], w["s3"]]) for w in ckpt]),
        "w2_weight": torch.stack([w["w2"] for w in ckpt]),
        "w2_weight_scale_inv": torch.stack([w["s2"] for w in ckpt]),
    }
    for name, t in host.items():
        layer.register_parameter(name, torch.nn.Parameter(torch.empty(t.shape, dtype=t.dtype, device="meta"),
                                                          requires_grad=False))
    expand_layer(layer, {k: torch.nn.Parameter(v, requires_grad=False) for k, v in host.items()}, (B, B))
    torch.npu.synchronize()
    got = layer.w13_weight.cpu()
    for e, w in enumerate(ckpt):
        gate_up = torch.cat([reference_dequant(w["w1"], w["s1"]), reference_dequant(w["w3"], w["s3"])])
        assert torch.equal(got[e].view(torch.int16), gate_up.t().contiguous().view(torch.int16))

"""fp8-expert-method on the published ExpertFp8Config (vllm-omni 0.32.0rc1) and vLLM-Ascend
stand-ins: public main of 2026-08-22 (tests/replicas/ascend_main_2608, no block-FP8 MoE scheme: the
CPU route) and 0.30.0rc2 (tests/replicas/ascend_030rc2, AscendFp8BlockFusedMoEMethod: the native
route).  The end-to-end load through vLLM's own loader is in test_fp8_loader.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from support.replicas import (
    ASCEND_030RC2, ASCEND_HOST_ENV, ASCEND_MAIN, FISH_OMNI_ABSENT, apply_checked, apply_on_npu, has_fish_omni,
    needs_fish_omni, prepend_profiles,
)
from support.subproc import call
from support.tiers import TORCH_ABSENT
from support.vllm_state import enter_config

torch = pytest.importorskip("torch", reason=TORCH_ABSENT)
from drama3_patches.kernels.fp8 import reference_dequant  # noqa: E402
from drama3_patches.patchlib import NotNeeded, PatchContext  # noqa: E402
from support import fake_npu  # noqa: E402

pytestmark = pytest.mark.vllm

MODULE = "vllm_omni.model_executor.models.fish_omni.quantization"
TARGET = f"{MODULE}:ExpertFp8Config.get_quant_method"
E, H, I, B = 3, 320, 192, 128  # I is not a multiple of the block: gate and up scales are per shard


def _published_config_class():
    """The real class, or a skip where this vllm-omni has no fish_omni (0.31.0rc1).  Import it
    before the simulated npu is enabled: with torch.npu present vllm-omni picks its NPU platform,
    which imports vllm_ascend.platform (not among the stand-ins)."""
    import importlib

    if not has_fish_omni():
        pytest.skip(FISH_OMNI_ABSENT)
    return importlib.import_module(MODULE).ExpertFp8Config


def _enable_patch(monkeypatch, profile=ASCEND_MAIN, card=None, first=None):
    """Forked tests only: vLLM-Ascend stand-ins on sys.path (``first``, a folder, before them; the
    build's card family ``card``, an AscendDeviceType name, when given), the engine on, as on an NPU
    host."""
    prepend_profiles(profile)
    if first is not None:
        import sys

        sys.path.insert(0, str(first))
    if card is not None:
        from vllm_ascend.device import device_config
        from vllm_ascend.device.hardware import AscendDeviceType

        monkeypatch.setattr(device_config, "BUILD_DEVICE_TYPE", AscendDeviceType[card])
        device_config.get_device_config.cache_clear()
    ExpertFp8Config = _published_config_class()
    return apply_on_npu(monkeypatch, "fp8-expert-method"), ExpertFp8Config


def _row(d3p) -> dict:
    return {p["id"]: p for p in d3p.status()["patches"]}["fp8-expert-method"]


def _experts_layer(prefix="model.layers.0.mlp.experts"):
    from vllm.model_executor.layers.fused_moe import RoutedExperts

    layer = RoutedExperts.__new__(RoutedExperts)  # a real RoutedExperts, without its distributed setup
    torch.nn.Module.__init__(layer)
    layer.moe_config = SimpleNamespace(w13_num_shards=2, has_bias=False)
    layer.prefix = prefix
    return layer


def _linear_layer():
    from vllm.model_executor.layers.linear import ReplicatedLinear

    layer = ReplicatedLinear.__new__(ReplicatedLinear)  # a LinearBase, which is all the config looks at
    torch.nn.Module.__init__(layer)
    return layer


@pytest.mark.forked
def test_published_expert_fp8_config_is_what_the_patch_expects():
    # The facts the manifest entry states, read off the published class (not patched here).
    ExpertFp8Config = _published_config_class()
    import inspect

    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.quantization import get_quantization_config
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config

    assert get_quantization_config("bsgemm-moe") is ExpertFp8Config and issubclass(ExpertFp8Config, Fp8Config)
    assert list(inspect.signature(ExpertFp8Config.__init__).parameters) == ["self", "weight_block_size"]
    assert list(inspect.signature(ExpertFp8Config.get_quant_method).parameters) == ["self", "layer", "prefix"]
    config = ExpertFp8Config.from_config({"activation_scheme": "dynamic", "weight_block_size": [128, 128]})
    assert config.weight_block_size == [128, 128] and config.is_checkpoint_fp8_serialized
    for bad in ({"activation_scheme": "static", "weight_block_size": [128, 128]}, {"weight_block_size": [128]}):
        with pytest.raises(ValueError, match="bsgemm-moe"):
            ExpertFp8Config.from_config(bad)
    assert isinstance(config.get_quant_method(_linear_layer(), "model.layers.0.self_attn.o_proj"),
                      UnquantizedLinearMethod)


@pytest.mark.forked
def test_experts_get_the_ascend_method_and_extra_keywords_are_passed_on(monkeypatch):
    d3p, ExpertFp8Config = _enable_patch(monkeypatch)
    enter_config()
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm_ascend.device import device_config
    from vllm_ascend.ops.fused_moe.routed_experts import AscendUnquantizedFusedMoEMethod

    config = ExpertFp8Config(weight_block_size=[128, 128])
    layer = _experts_layer()
    table = torch.arange(8)
    # vLLM-Ascend's routed experts ask with tid2eid (routed_experts.py, _get_quant_method):
    method = config.get_quant_method(layer, layer.prefix, tid2eid=table)  # 910B (A2): CPU expansion
    assert isinstance(method, AscendUnquantizedFusedMoEMethod) and type(method).__name__ == "ExpandedFp8MoEMethod"
    assert method.weight_block_size == (128, 128) and method.moe is layer.moe_config
    assert method.tid2eid is table  # honoured: it reaches vLLM-Ascend's method
    assert config.get_quant_method(layer, layer.prefix).tid2eid is None  # vLLM's own call shape still works

    # Other layers keep the published answer; a keyword the original does not take is not passed.
    linear = _linear_layer()
    assert isinstance(config.get_quant_method(linear, "model.layers.0.mlp.gate"), UnquantizedLinearMethod)
    assert isinstance(config.get_quant_method(linear, "model.layers.0.mlp.gate", tid2eid=table),
                      UnquantizedLinearMethod)

    # On the 910B (A2) main has no block-FP8 MoE scheme: the CPU route, and status says why.
    assert not device_config.is_950()
    reason = _row(d3p)["reason"]
    assert reason.startswith("patched: route cpu: vllm_ascend.quantization.fp8_config.AscendFp8Config has no "
                             "block-FP8 MoE scheme and the card has no MXFP8"), reason
    assert "not imported: vllm_ascend.quantization.configs.fp8_config: absent" in reason

    original = d3p.get_original(TARGET)
    d3p.unapply(["fp8-expert-method"])
    assert ExpertFp8Config.__dict__["get_quant_method"] is original
    assert not hasattr(ExpertFp8Config.get_quant_method, "__drama3_patch__")


@pytest.mark.forked
def test_on_main_an_ascend_950_asks_ascend_fp8_config_and_expands_where_it_refuses(monkeypatch):
    d3p, ExpertFp8Config = _enable_patch(monkeypatch, card="A5")
    enter_config()
    from vllm_ascend.device import device_config
    from vllm_ascend.quantization.fp8_config import AscendFp8Config

    assert device_config.is_950()
    assert _row(d3p)["reason"].startswith("patched: route native: vllm_ascend.quantization.fp8_config."
                                          "AscendFp8Config asked for each layer")
    config = ExpertFp8Config(weight_block_size=[128, 128])
    layer = _experts_layer()
    table = torch.arange(8)
    # Ascend 950 (A5, MXFP8): main raises NotImplementedError there, so the experts are still expanded ...
    assert type(config.get_quant_method(layer, layer.prefix, tid2eid=table)).__name__ == "ExpandedFp8MoEMethod"
    # ... and vLLM-Ascend's own FP8 MoE method is taken when it answers, with tid2eid.
    seen = {}

    def ascend_method(self, lyr, prefix, tid2eid=None):
        seen.update(prefix=prefix, tid2eid=tid2eid, block=self.weight_block_size)
        return "ascend-fp8-moe-method"

    monkeypatch.setattr(AscendFp8Config, "get_quant_method", ascend_method)
    assert config.get_quant_method(layer, layer.prefix, tid2eid=table) == "ascend-fp8-moe-method"
    assert seen == {"prefix": layer.prefix, "tid2eid": table, "block": [128, 128]}


def _load_whole(layer, host: dict) -> None:
    """What vLLM's FusedMoE loader leaves in the layer's parameters, whole tensors here."""
    for name, tensor in host.items():
        getattr(layer, name).data.copy_(tensor)


def _host_weights(ckpt) -> dict:
    return {
        "w13_weight": torch.stack([torch.cat([w["w1"], w["w3"]]) for w in ckpt]),
        "w13_weight_scale_inv": torch.stack([torch.cat([w["s1"], w["s3"]]) for w in ckpt]),
        "w2_weight": torch.stack([w["w2"] for w in ckpt]),
        "w2_weight_scale_inv": torch.stack([w["s2"] for w in ckpt]),
    }


# vLLM-Ascend 0.30.0rc2 sizes w13's scale as one grid over the 2I rows (ceil(2I / block)), vLLM's
# loader per gate/up shard: they agree when I is a multiple of the block (Drama 3: 768).
I_BLOCKED = 2 * B


def _reference_layout(ckpt):
    """w13 (E, H, 2I) and w2 (E, I, H) in bf16, from the definition, not from either route."""
    w13 = torch.stack([torch.cat([reference_dequant(w["w1"], w["s1"]), reference_dequant(w["w3"], w["s3"])]).t()
                       for w in ckpt])
    w2 = torch.stack([reference_dequant(w["w2"], w["s2"]).t() for w in ckpt])
    return w13, w2


@pytest.mark.forked
def test_on_0_30_0rc2_experts_take_the_native_block_fp8_method_and_status_names_it(monkeypatch):
    d3p, ExpertFp8Config = _enable_patch(monkeypatch, profile=ASCEND_030RC2)
    enter_config()
    from vllm_ascend.quantization.method_adapters import AscendFusedMoEMethod
    from vllm_ascend.quantization.methods.w8a8.fp8_block import AscendFp8BlockFusedMoEMethod

    row = _row(d3p)
    assert row["state"] == "applied"
    assert row["reason"] == ("patched: route native: vllm_ascend.quantization.configs.fp8_config.AscendFp8Config "
                             "-> AscendFp8BlockFusedMoEMethod"), row["reason"]
    config = ExpertFp8Config(weight_block_size=[B, B])
    layer = _experts_layer()
    table = torch.arange(8)
    method = config.get_quant_method(layer, layer.prefix, tid2eid=table)
    assert type(method) is AscendFusedMoEMethod and type(method.quant_method) is AscendFp8BlockFusedMoEMethod
    assert method.tid2eid is table and (method.quant_method.block_n, method.quant_method.block_k) == (B, B)

    # Loaded and post-processed as vLLM-Ascend does it: fp8 on the layer's device, resolved there.
    method.create_weights(layer, E, H, I_BLOCKED, torch.bfloat16, weight_loader=lambda *a, **k: None)
    assert layer.w13_weight.dtype == torch.float8_e4m3fn and layer.w13_weight.device.type == "cpu"
    ckpt = _checkpoint(5, I_BLOCKED)
    _load_whole(layer, _host_weights(ckpt))
    method.process_weights_after_loading(layer)
    w13, w2 = _reference_layout(ckpt)
    assert layer.w13_weight.dtype == torch.bfloat16 and tuple(layer.w13_weight.shape) == (E, H, 2 * I_BLOCKED)
    assert torch.equal(layer.w13_weight.view(torch.int16), w13.contiguous().view(torch.int16))
    assert torch.equal(layer.w2_weight.view(torch.int16), w2.contiguous().view(torch.int16))
    assert not hasattr(layer, "w13_weight_scale_inv") and not hasattr(layer, "_drama3_fp8_host")


@pytest.mark.forked
def test_on_0_30_0rc2_the_route_variable_keeps_the_cpu_expansion(monkeypatch):
    monkeypatch.setenv("DRAMA3_PATCHES_FP8_ROUTE", "cpu")
    d3p, ExpertFp8Config = _enable_patch(monkeypatch, profile=ASCEND_030RC2)
    enter_config()
    assert _row(d3p)["reason"] == "patched: route cpu: DRAMA3_PATCHES_FP8_ROUTE=cpu"
    config = ExpertFp8Config(weight_block_size=[B, B])
    layer = _experts_layer()
    assert type(config.get_quant_method(layer, layer.prefix)).__name__ == "ExpandedFp8MoEMethod"


@pytest.mark.forked
def test_on_main_the_route_variable_native_asks_ascend_fp8_config_on_a_910b(monkeypatch):
    monkeypatch.setenv("DRAMA3_PATCHES_FP8_ROUTE", "native")
    d3p, ExpertFp8Config = _enable_patch(monkeypatch)
    enter_config()
    assert _row(d3p)["reason"].startswith(
        "patched: route native: vllm_ascend.quantization.fp8_config.AscendFp8Config asked for each layer "
        "(DRAMA3_PATCHES_FP8_ROUTE=native)")
    config = ExpertFp8Config(weight_block_size=[B, B])
    layer = _experts_layer()
    # main's AscendFp8Config refuses every layer: the experts are expanded, not left to vLLM's CUDA method.
    assert type(config.get_quant_method(layer, layer.prefix)).__name__ == "ExpandedFp8MoEMethod"


@pytest.mark.forked
def test_a_known_config_path_that_fails_to_import_is_named_in_status(monkeypatch, tmp_path):
    import shutil

    from support.replicas import profile

    root = tmp_path / "ascend"
    shutil.copytree(profile(ASCEND_030RC2), root)
    broken = root / "vllm_ascend/quantization/configs/fp8_config.py"
    text = broken.read_text()
    assert "\nimport inspect\n" in text
    broken.write_text(text.replace("\nimport inspect\n", "\nimport inspect\nimport no_such_dependency\n", 1))
    d3p, ExpertFp8Config = _enable_patch(monkeypatch, profile=ASCEND_030RC2, first=root)
    enter_config()
    reason = _row(d3p)["reason"]
    assert reason.startswith("patched: route cpu: no AscendFp8Config in this vLLM-Ascend; not imported: "
                             "vllm_ascend.quantization.configs.fp8_config: ModuleNotFoundError: No module named "
                             "'no_such_dependency'; vllm_ascend.quantization.fp8_config: absent"), reason
    config = ExpertFp8Config(weight_block_size=[B, B])
    layer = _experts_layer()
    assert type(config.get_quant_method(layer, layer.prefix)).__name__ == "ExpandedFp8MoEMethod"


def test_call_accepting_passes_only_what_the_callee_takes():
    from drama3_patches.patchlib import call_accepting

    def two(layer, prefix):
        return (layer, prefix)

    def keyword(layer, prefix, tid2eid=None):
        return (layer, prefix, tid2eid)

    def anything(*args, **kwargs):
        return (args, kwargs)

    assert call_accepting(two, 1, 2, 3, tid2eid=4) == (1, 2)
    assert call_accepting(keyword, 1, 2, tid2eid=4) == (1, 2, 4)
    assert call_accepting(anything, 1, 2, tid2eid=4) == ((1, 2), {"tid2eid": 4})
    with pytest.raises(TypeError):  # a missing argument is still an error
        call_accepting(two, 1)


@pytest.mark.forked
def test_refusals_name_the_layer_mismatched_scales_and_reloads(monkeypatch):
    _, ExpertFp8Config = _enable_patch(monkeypatch)
    fake_npu.enable()
    enter_config()
    config = ExpertFp8Config(weight_block_size=[B, B])

    # A weight_scale_inv that does not fit its weight: refused, naming the layer and the shapes.
    layer = _experts_layer("model.layers.7.mlp.experts")
    method = config.get_quant_method(layer, layer.prefix)
    with torch.device("npu"):
        method.create_weights(layer, E, H, I, torch.bfloat16, weight_loader=lambda *a, **k: None)
    for name in ("w13_weight", "w2_weight", "w13_weight_scale_inv", "w2_weight_scale_inv"):
        assert getattr(layer, name).device.type == "meta"  # nothing of the checkpoint on the device
    host = layer._drama3_fp8_host
    host["w13_weight"].data.zero_()
    host["w13_weight_scale_inv"] = torch.nn.Parameter(torch.ones(E, 3, 3), requires_grad=False)
    with pytest.raises(ValueError, match=r"model\.layers\.7\.mlp\.experts\.w13_weight: weight_scale_inv \(3, 3, 3\)"):
        method.process_weights_after_loading(layer)

    # Loading after the expansion: refused instead of writing fp8 into bf16.
    layer = _experts_layer()
    method = config.get_quant_method(layer, layer.prefix)
    calls = []
    method.create_weights(layer, E, H, I, torch.bfloat16, weight_loader=lambda *a, **k: calls.append(a[0]))
    w = torch.zeros(I, H, dtype=torch.float8_e4m3fn)
    layer.w13_weight.weight_loader(layer.w13_weight, w, "w", "w1", 0)
    assert calls == [layer._drama3_fp8_host["w13_weight"]]  # the loader writes into the host buffer
    method.process_weights_after_loading(layer)
    assert layer.w13_weight.dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match="already expanded"):
        layer.w13_weight.weight_loader(layer.w13_weight, w, "w", "w1", 0)


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


def _checkpoint(seed: int, I=I):  # noqa: E741
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


@pytest.mark.npu
@needs_fish_omni
def test_on_a_real_npu_the_patched_config_expands_experts_bit_exact_in_the_ascend_layout():
    """Ascend host only: the published ExpertFp8Config with the patch applied by the engine hands
    a routed-experts layer vLLM-Ascend's method fed from the fp8 checkpoint; the weights built
    under the NPU device, loaded, post-processed, read back. A fresh interpreter: the device
    runtime must not start in a fork, and the start-up hook applies the patches as deployed."""
    out = call(expand_on_the_npu, env=ASCEND_HOST_ENV, timeout=900)
    if out["mxfp8"]:
        # Ascend 950: vLLM-Ascend's own FP8 MoE method, no CPU expansion.
        assert out["method_module"].startswith("vllm_ascend."), out
        return
    assert out["method"] == "ExpandedFp8MoEMethod" and out["method_base"] == "AscendUnquantizedFusedMoEMethod"
    assert out["placeholders"] == ["meta"] * 4  # nothing of the fp8 checkpoint went to the device
    assert out["loaded_into_host"] is True
    assert out["devices"] == ["npu", "npu"] and out["dtypes"] == ["torch.bfloat16"] * 2
    assert out["scales_dropped"] is True
    assert out["w13_equal"] == [True] * E and out["w2_equal"] == [True] * E


def expand_on_the_npu() -> dict:
    """The child of the test above."""
    import torch_npu  # noqa: F401

    from drama3_patches.patches.fp8_expert_method import has_mxfp8

    ExpertFp8Config = _published_config_class()
    apply_checked("fp8-expert-method")
    enter_config()
    config = ExpertFp8Config(weight_block_size=[B, B])
    layer = _experts_layer()
    method = config.get_quant_method(layer, layer.prefix)
    out = {"mxfp8": has_mxfp8(), "method": type(method).__name__, "method_module": type(method).__module__}
    if out["mxfp8"]:
        return out
    out["method_base"] = type(method).__mro__[1].__name__
    ckpt = _checkpoint(9)
    host = {
        "w13_weight": torch.stack([torch.cat([w["w1"], w["w3"]]) for w in ckpt]),
        "w13_weight_scale_inv": torch.stack([torch.cat([w["s1"], w["s3"]]) for w in ckpt]),
        "w2_weight": torch.stack([w["w2"] for w in ckpt]),
        "w2_weight_scale_inv": torch.stack([w["s2"] for w in ckpt]),
    }
    loaded = []

    def loader(param, weight, *args, **kwargs):  # vLLM's FusedMoE loader, whole tensors here
        loaded.append(param.device.type)
        param.data.copy_(weight)

    with torch.device("npu", torch.npu.current_device()):
        method.create_weights(layer, E, H, I, torch.bfloat16, weight_loader=loader)
    out["placeholders"] = [getattr(layer, name).device.type for name in host]
    for name, tensor in host.items():
        getattr(layer, name).weight_loader(getattr(layer, name), tensor)
    out["loaded_into_host"] = loaded == ["cpu"] * 4
    method.process_weights_after_loading(layer)
    torch.npu.synchronize()
    out["devices"] = [layer.w13_weight.device.type, layer.w2_weight.device.type]
    out["dtypes"] = [str(layer.w13_weight.dtype), str(layer.w2_weight.dtype)]
    out["scales_dropped"] = not hasattr(layer, "w13_weight_scale_inv") and not hasattr(layer, "w2_weight_scale_inv")
    w13, w2 = layer.w13_weight.cpu(), layer.w2_weight.cpu()
    out["w13_equal"], out["w2_equal"] = [], []
    for e, w in enumerate(ckpt):
        gate_up = torch.cat([reference_dequant(w["w1"], w["s1"]), reference_dequant(w["w3"], w["s3"])])
        out["w13_equal"].append(torch.equal(w13[e].view(torch.int16), gate_up.t().contiguous().view(torch.int16)))
        down = reference_dequant(w["w2"], w["s2"])
        out["w2_equal"].append(torch.equal(w2[e].view(torch.int16), down.t().contiguous().view(torch.int16)))
    return out

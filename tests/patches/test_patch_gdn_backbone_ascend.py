"""gdn-backbone-ascend on the published ``fish_omni.gdn`` (vllm-omni 0.32.0rc1) and real vLLM GDN layers.

The forked test stands where an Ascend worker stands when ``FishOmniForConditionalGeneration``
is built: vLLM's platform is an out-of-tree ``npu`` platform (the ``_enum``/``device_type`` of
vLLM-Ascend's), and the backbone's layers are real ``QwenGatedDeltaNetAttention`` instances built
by their own constructor (TP=1 gloo group, a real ``VllmConfig`` from a tiny ``FishOmniConfig``,
whose ``text_config`` is the Qwen3.5 MoE config the backbone reads).  vLLM-Ascend patches that
class in place (``get_attn_backend``, ``_forward_core``, ``forward``, ...); the child does the same
with ``get_attn_backend`` so the test can see whose backend a layer ends up with.  CUDA is "vLLM's
platform answering is_cuda()", as in test_patch_qwen3next_eager_attention.py.

The published model class itself cannot be built here (its module needs torchvision through
vLLM's qwen3_5 -> qwen3_vl imports); the call is made the way its ``__init__`` makes it:
``from ...fish_omni.gdn import install_drama3_gdn`` at construction time, then on the backbone.
"""

from __future__ import annotations

import importlib
import inspect

import pytest

from support.logs import captured
from support.replicas import apply_on_npu, needs_fish_omni
from support.vllm_state import join_tp1_group
from support.tiers import TORCH_ABSENT

torch = pytest.importorskip("torch", reason=TORCH_ABSENT)
from drama3_patches.patches import gdn_backbone_ascend as gba  # noqa: E402
from drama3_patches.patchlib import NotNeeded, PatchContext  # noqa: E402
from support import fake_npu  # noqa: E402

pytestmark = [pytest.mark.vllm, needs_fish_omni]

GDN_MODULE = "vllm_omni.model_executor.models.fish_omni.gdn"
TARGET = f"{GDN_MODULE}:install_drama3_gdn"
ARCH = "Drama3GdnProbeModel"


class ProbeModel(torch.nn.Module):
    """Registered architecture of the tiny ModelConfig (nothing is built from it)."""


class AscendGdnBackendStandIn:
    """What vLLM-Ascend's patched ``get_attn_backend`` returns (its Ascend GDN backend)."""


def _boot(tmp_path):
    """npu platform for vLLM, a real VllmConfig, TP=1: returns (vllm_config, text_config)."""
    fake_npu.vllm_on_npu()  # DeviceConfig resolves to the platform's type, npu
    from vllm import ModelRegistry
    from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
    from vllm_omni.model_executor.models.fish_omni.configuration_fish_omni import FishOmniConfig

    ModelRegistry.register_model(ARCH, ProbeModel)
    hf = FishOmniConfig(text_config=dict(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        vocab_size=512, linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4,
    ))
    hf.architectures = [ARCH]
    hf.save_pretrained(tmp_path)
    vllm_config = VllmConfig(model_config=ModelConfig(model=str(tmp_path), skip_tokenizer_init=True,
                                                      dtype="float32", max_model_len=64))
    with set_current_vllm_config(vllm_config):
        join_tp1_group()
    return vllm_config, vllm_config.model_config.hf_text_config


_TREES = iter(range(100))


def _backbone(vllm_config, text_config) -> torch.nn.Module:
    """Two GDN decoder layers and one full-attention layer, as in the Qwen3.5 backbone."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention

    tree = next(_TREES)  # every layer registers its prefix with the compilation config once
    layers = torch.nn.ModuleList()
    for index, kind in enumerate(("linear", "linear", "full")):
        layer = torch.nn.Module()
        if kind == "linear":
            with set_current_vllm_config(vllm_config):
                layer.linear_attn = QwenGatedDeltaNetAttention(
                    text_config, vllm_config, prefix=f"t{tree}.model.layers.{index}.linear_attn")
        else:
            layer.self_attn = torch.nn.Linear(4, 4)
        layers.append(layer)
    backbone = torch.nn.Module()
    backbone.layers = layers
    return backbone


def _gdn_layers(backbone):
    return [layer.linear_attn for layer in backbone.layers if hasattr(layer, "linear_attn")]


def _install(backbone) -> int:
    # As FishOmniForConditionalGeneration.__init__ does: import at construction time, then call.
    return importlib.import_module(GDN_MODULE).install_drama3_gdn(backbone)


def _check_feature_detection() -> None:
    """plan() on the published function, on a platform-guarded one, on one that fails."""
    gdn = importlib.import_module(GDN_MODULE)
    published = gdn.install_drama3_gdn

    def ctx_for(func):
        return PatchContext("gdn-backbone-ascend", (TARGET,), "npu", {}, gba.logger, _resolve=lambda t: func)

    assert gba.swaps_here(published) is True  # on this npu platform
    new = gba.plan(ctx_for(published))[TARGET]
    assert new.__wrapped__ is published and new.__name__ == "install_drama3_gdn"

    # An upstream fix: the same function, guarded by the platform (defined in gdn's namespace).
    namespace = dict(vars(gdn))
    exec(
        "def install_drama3_gdn(model):\n"
        "    from vllm.platforms import current_platform\n"
        "    if not current_platform.is_cuda():\n"
        "        return 0\n"
        "    count = 0\n"
        "    for module in model.modules():\n"
        "        if type(module) is QwenGatedDeltaNetAttention:\n"
        "            module.__class__ = Drama3GatedDeltaNet\n"
        "            count += 1\n"
        "    return count\n",
        namespace,
    )
    with pytest.raises(NotNeeded, match="already leaves Qwen GDN layers"):
        gba.plan(ctx_for(namespace["install_drama3_gdn"]))

    exec("def install_drama3_gdn(model):\n    raise ValueError(model)\n", namespace)
    with pytest.raises(RuntimeError, match="cannot check whether it swaps"):
        gba.plan(ctx_for(namespace["install_drama3_gdn"]))


@pytest.mark.forked
def test_on_npu_the_backbone_keeps_vllms_gdn_and_cuda_still_swaps(tmp_path, monkeypatch):
    vllm_config, text_config = _boot(tmp_path)
    _check_feature_detection()
    import vllm.platforms as vp
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention

    # vLLM-Ascend's way: methods of vLLM's class replaced in place, the class itself kept.
    QwenGatedDeltaNetAttention.get_attn_backend = lambda self: AscendGdnBackendStandIn

    # Published behaviour on this npu platform: both GDN layers become Drama3GatedDeltaNet and
    # lose the platform's backend (and _forward_core) to the CUDA ones.
    backbone = _backbone(vllm_config, text_config)
    assert _install(backbone) == 2
    gdn = importlib.import_module(GDN_MODULE)
    assert [type(m) for m in _gdn_layers(backbone)] == [gdn.Drama3GatedDeltaNet] * 2
    assert _gdn_layers(backbone)[0].get_attn_backend() is gdn.Drama3GDNAttentionBackend

    drama3_patches = apply_on_npu(monkeypatch, "gdn-backbone-ascend")
    original = drama3_patches.get_original(TARGET)
    assert gdn.install_drama3_gdn.__wrapped__ is original
    assert inspect.signature(gdn.install_drama3_gdn) == inspect.signature(original)

    backbone = _backbone(vllm_config, text_config)
    with captured(gba.logger.name) as lines:
        assert _install(backbone) == 0
    assert [type(m) for m in _gdn_layers(backbone)] == [QwenGatedDeltaNetAttention] * 2
    assert _gdn_layers(backbone)[0].get_attn_backend() is AscendGdnBackendStandIn
    assert any("kept 2 Qwen GDN layer(s)" in m and "'npu'" in m for m in lines), lines

    # CUDA unchanged: with vLLM's platform answering CUDA the published swap runs.
    real = vp.current_platform
    vp._current_platform = fake_npu.SaysCuda(real)
    backbone = _backbone(vllm_config, text_config)
    assert _install(backbone) == 2
    assert [type(m) for m in _gdn_layers(backbone)] == [gdn.Drama3GatedDeltaNet] * 2
    vp._current_platform = real

    drama3_patches.unapply(["gdn-backbone-ascend"])
    assert gdn.install_drama3_gdn is original
    backbone = _backbone(vllm_config, text_config)
    assert _install(backbone) == 2

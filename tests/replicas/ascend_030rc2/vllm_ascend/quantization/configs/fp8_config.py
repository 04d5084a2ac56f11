# Stand-in for vLLM-Ascend 0.30.0rc2 (PyPI sdist, commit 8fde6d4e3), vllm_ascend/quantization/configs/fp8_config.py (the
# module moved here from vllm_ascend/quantization/fp8_config.py, where public main of 2026-08-22
# kept it). Kept: AscendFp8Config(Fp8Config) (:27) with quant_description = {}, the refused
# get_min_capability, _verify_block_quantization (a block size and dynamic activations, else
# NotImplementedError naming the fix), and get_quant_method(layer, prefix, tid2eid=None) (:61) for
# fused-MoE layers: a layer named in ignored_layers gets AscendUnquantizedFusedMoEMethod(moe_config,
# tid2eid); otherwise, once verified, AscendFusedMoEMethod(scheme(weight_block_size, moe_config),
# moe_config, tid2eid=tid2eid) with the scheme registered for ("fp8", "moe"):
# AscendFp8BlockFusedMoEMethod; a layer that is neither linear nor MoE gets None. Left out:
# @register_quantization_config("fp8") (it would replace "fp8" in vLLM's registry at import), the
# linear branch (AscendLinearMethod, AscendUnquantizedLinearMethod: refused here), and
# AscendDeepseekV4FP8Config (it imports vLLM's DeepSeek V4 model). The release's
# "from ..methods import get_scheme_class" fills the scheme table by importing every scheme; here
# the block-FP8 scheme module is imported for that.
import inspect
from typing import Optional

import torch
from vllm.model_executor.layers.linear import LinearBase
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
from vllm.model_executor.layers.quantization.fp8 import Fp8Config
from vllm.model_executor.layers.quantization.utils.quant_utils import is_layer_skipped

import vllm_ascend.quantization.methods.w8a8.fp8_block  # noqa: F401  (registers the scheme)
from vllm_ascend.quantization.methods.registry import get_scheme_class
from vllm_ascend.quantization.utils import is_fused_moe_layer
from vllm_ascend.utils import FP8_METHOD

_IS_LAYER_SKIPPED_SUPPORTS_MATCH_MODE = "match_mode" in inspect.signature(is_layer_skipped).parameters


class AscendFp8Config(Fp8Config):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.quant_description = {}

    @classmethod
    def get_min_capability(cls) -> int:
        raise NotImplementedError('Ascend hardware dose not support "get_min_capability" feature.')

    def _verify_block_quantization(self) -> None:
        if self.weight_block_size is None:
            raise NotImplementedError("native FP8 checkpoints are served only with per-block scales "
                                      "(quantization_config.weight_block_size)")
        if self.activation_scheme != "dynamic":
            raise NotImplementedError(f"native FP8 needs dynamic activations, not {self.activation_scheme!r}")

    def get_quant_method(self, layer: torch.nn.Module, prefix: str, tid2eid=None) -> Optional["QuantizeMethodBase"]:
        from vllm_ascend.ops.fused_moe.routed_experts import AscendUnquantizedFusedMoEMethod
        from vllm_ascend.quantization.method_adapters import AscendFusedMoEMethod

        is_linear = isinstance(layer, LinearBase)
        is_moe = is_fused_moe_layer(layer)
        if not is_linear and not is_moe:
            return None
        if is_linear:
            raise NotImplementedError("stand-in: the linear branch of AscendFp8Config is left out")
        skip_kwargs = {}
        if _IS_LAYER_SKIPPED_SUPPORTS_MATCH_MODE:
            skip_kwargs["match_mode"] = getattr(self, "ignored_layers_match_mode", "exact")
        if is_layer_skipped(prefix, self.ignored_layers, self.packed_modules_mapping, **skip_kwargs):
            return AscendUnquantizedFusedMoEMethod(layer.moe_config, tid2eid)
        self._verify_block_quantization()
        scheme_class = get_scheme_class(FP8_METHOD, "moe")
        assert scheme_class is not None, f"No scheme registered for {FP8_METHOD}/moe"
        return AscendFusedMoEMethod(scheme_class(self.weight_block_size, layer.moe_config), layer.moe_config,
                                    tid2eid=tid2eid)

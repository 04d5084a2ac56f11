# Stand-in for vllm-project/vllm-ascend public main, commit 182b75ea84 (2026-08-22),
# vllm_ascend/quantization/fp8_config.py (as "[Refactor]refactor fp8 config (#13651)", 463eb4bc01,
# left it): AscendFp8Config subclasses vLLM's Fp8Config, sets quant_description = {}, refuses
# get_min_capability, and its get_quant_method(layer, prefix, tid2eid=None) raises
# NotImplementedError for every layer (main has no block-FP8 MoE or linear method behind it;
# AscendDeepseekV4FP8Config is the one that dispatches). Left out:
# @register_quantization_config(FP8_METHOD), which would replace "fp8" in vLLM's global registry
# at import time, _is_fused_moe_layer and AscendDeepseekV4FP8Config (it imports vLLM's DeepSeek
# V4 model and vllm-ascend's scheme registry).
from typing import Optional

import torch
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
from vllm.model_executor.layers.quantization.fp8 import Fp8Config


class AscendFp8Config(Fp8Config):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.quant_description = {}

    @classmethod
    def get_min_capability(cls) -> int:
        raise NotImplementedError('Ascend hardware dose not support "get_min_capability" feature.')

    def get_quant_method(
        self,
        layer: torch.nn.Module,
        prefix: str,
        tid2eid=None,
    ) -> Optional["QuantizeMethodBase"]:
        raise NotImplementedError

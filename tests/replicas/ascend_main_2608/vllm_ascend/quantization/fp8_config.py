# Stand-in for vllm-project/vllm-ascend public main (2026-08-22), vllm_ascend/quantization/fp8_config.py
# (after "[Refactor]refactor fp8 config (#13651)"): AscendFp8Config subclasses vLLM's Fp8Config,
# refuses get_min_capability and raises NotImplementedError from get_quant_method (main has no
# block-FP8 MoE or linear method behind it; AscendDeepseekV4FP8Config is the one that dispatches).
# Left out: @register_quantization_config(FP8_METHOD), which would replace "fp8" in vLLM's global
# registry at import time, and AscendDeepseekV4FP8Config.
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

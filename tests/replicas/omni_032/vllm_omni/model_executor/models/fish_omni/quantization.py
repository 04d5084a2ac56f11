# Stand-in for the Drama 3 (fish_omni) quantization config of the in-tree vllm-omni port, module
# vllm_omni/model_executor/models/fish_omni/quantization.py (ExpertFp8Config), as used in the 0.32.0
# serving containers; not in any public vllm-omni release. Shaped after UPSTREAM.md
# "fp8-expert-method": the routed experts are block-FP8 (float8_e4m3fn weights, float32
# weight_scale_inv per 128x128 block), everything else bf16; get_quant_method hands the experts
# vLLM's CUDA Fp8MoEMethod (no Ascend kernel behind it) and leaves other layers unquantized.
# Kept: the class name, its real vLLM base (Fp8Config) and get_quant_method(layer, prefix).
from __future__ import annotations

import torch
from vllm.model_executor.layers.fused_moe import RoutedExperts
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
from vllm.model_executor.layers.quantization.fp8 import Fp8Config, Fp8MoEMethod


class ExpertFp8Config(Fp8Config):
    """Block-FP8 for the routed experts only."""

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        if isinstance(layer, RoutedExperts):
            return Fp8MoEMethod(self, layer)
        return None

# Stand-in for vLLM-Ascend 0.30.0rc2 (PyPI sdist, commit 8fde6d4e3), vllm_ascend/quantization/methods/w8a8/fp8_block.py.
# Kept, with the release's names and behaviour:
# * resolve_block_scales(weight, scale_inv, block_n, block_k, out_dtype) (:64): checks the scale's
#   shape against ceil-divided blocks (ValueError naming both otherwise), then fills a new
#   out_dtype matrix on the weight's device, a band of rows at a time, with fp8 values times their
#   float32 block scale (the product rounded once to out_dtype).
# * AscendFp8BlockFusedMoEMethod (:263), registered for ("fp8", "moe"): __init__(weight_block_size,
#   moe_config) keeps the block, group_size = block_k, the model dtype, and an MXFP8 method only
#   on Ascend 950 (is_950()); get_weight gives float8_e4m3fn w13 (E, 2I, H) and w2 (E, H, I);
#   get_dynamic_quant_param float32 w13/w2 weight_scale_inv per block; process_weights_after_loading
#   (:316), without MXFP8: for w13 then w2, a resolved model-dtype copy of the whole weight is built
#   on the device expert by expert (_resolve_experts) while the fp8 weight is still registered,
#   replace_parameter swaps it in, the scale is deleted; then the bf16 method
#   (AscendUnquantizedFusedMoEMethod, made lazily) post-processes the layer (its transposed
#   copies). So the device holds a layer's fp8 weight and its resolved copy at once.
# Left out: the base class AscendMoEScheme, the linear scheme, the MXFP8 re-quantisation of 950
# (torch_npu's npu_dynamic_mx_quant; process_weights_after_loading refuses here when it would be
# taken), apply (served by the bf16 method). The model dtype is read from vLLM's current config as
# the release does; a config without a model (tests) gives bfloat16.
import torch
from vllm.config import get_current_vllm_config
from vllm.model_executor.utils import replace_parameter
from vllm.utils.math_utils import cdiv

from vllm_ascend.quantization.methods.registry import register_scheme
from vllm_ascend.utils import FP8_METHOD, is_950

BLOCK_FP8_WEIGHT_DTYPE = torch.float8_e4m3fn
_ROWS_PER_DEQUANT_STEP = 1024


def resolve_block_scales(weight, scale_inv, block_n, block_k, out_dtype):
    if weight.dim() != 2:
        raise ValueError(f"Expected a 2D block-quantized weight, got shape {tuple(weight.shape)}.")
    rows, cols = weight.shape
    want = (cdiv(rows, block_n), cdiv(cols, block_k))
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"weight {tuple(weight.shape)} with block ({block_n}, {block_k}) needs a scale "
                         f"of shape {want}, got {tuple(scale_inv.shape)}")
    out = torch.empty((rows, cols), dtype=out_dtype, device=weight.device)
    step = max(block_n, _ROWS_PER_DEQUANT_STEP // block_n * block_n)
    for start in range(0, rows, step):
        end = min(start + step, rows)
        band = scale_inv[start // block_n: cdiv(end, block_n)].to(device=weight.device, dtype=torch.float32)
        band = band.repeat_interleave(block_n, dim=0)[: end - start].repeat_interleave(block_k, dim=1)[:, :cols]
        out[start:end] = weight[start:end].to(torch.float32) * band
    return out


def _model_dtype():
    model_config = get_current_vllm_config().model_config
    return getattr(model_config, "dtype", None) or torch.bfloat16


@register_scheme(FP8_METHOD, "moe")
class AscendFp8BlockFusedMoEMethod:
    def __init__(self, weight_block_size, moe_config):
        self.block_n, self.block_k = weight_block_size
        self.group_size = self.block_k
        self.model_dtype = _model_dtype()
        self.moe_config = moe_config
        self.mxfp8_method = "mxfp8" if is_950() else None
        self._bf16_method = None

    @property
    def bf16_method(self):
        if self._bf16_method is None:
            from vllm_ascend.ops.fused_moe.routed_experts import AscendUnquantizedFusedMoEMethod

            self._bf16_method = AscendUnquantizedFusedMoEMethod(self.moe_config)
        return self._bf16_method

    def get_weight(self, num_experts, intermediate_size_per_partition, hidden_sizes, params_dtype):
        inter = intermediate_size_per_partition
        return {
            "w13_weight": torch.empty(num_experts, 2 * inter, hidden_sizes, dtype=BLOCK_FP8_WEIGHT_DTYPE),
            "w2_weight": torch.empty(num_experts, hidden_sizes, inter, dtype=BLOCK_FP8_WEIGHT_DTYPE),
        }

    def get_dynamic_quant_param(self, num_experts, intermediate_size_per_partition, hidden_sizes, params_dtype):
        inter = intermediate_size_per_partition
        return {
            "w13_weight_scale_inv": torch.empty(num_experts, cdiv(2 * inter, self.block_n),
                                                cdiv(hidden_sizes, self.block_k), dtype=torch.float32),
            "w2_weight_scale_inv": torch.empty(num_experts, cdiv(hidden_sizes, self.block_n),
                                               cdiv(inter, self.block_k), dtype=torch.float32),
        }

    def process_weights_after_loading(self, layer):
        if self.mxfp8_method is not None:
            raise NotImplementedError("stand-in: the MXFP8 re-quantisation of Ascend 950 needs torch_npu")
        for name in ("w13_weight", "w2_weight"):
            replace_parameter(layer, name, self._resolve_experts(layer, name, f"{name}_scale_inv"))
            delattr(layer, f"{name}_scale_inv")
        self.bf16_method.process_weights_after_loading(layer)

    def _resolve_experts(self, layer, weight_name, scale_name):
        weight = getattr(layer, weight_name).data
        scale_inv = getattr(layer, scale_name).data
        resolved = torch.empty(weight.shape, dtype=self.model_dtype, device=weight.device)
        for expert in range(weight.shape[0]):
            resolved[expert] = resolve_block_scales(weight[expert], scale_inv[expert], self.block_n, self.block_k,
                                                    self.model_dtype)
        return resolved

    def get_eplb_weight_views(self, layer):
        return self.bf16_method.get_eplb_weight_views(layer)

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts=None, shared_experts_input=None):
        return self.bf16_method.apply(layer, x, topk_weights, topk_ids)

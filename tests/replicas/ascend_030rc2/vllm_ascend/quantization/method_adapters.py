# Stand-in for vLLM-Ascend 0.30.0rc2 (PyPI sdist, commit 8fde6d4e3), vllm_ascend/quantization/method_adapters.py:
# AscendFusedMoEMethod(FusedMoEMethodBase) (:263), the MoE method that wraps a scheme:
# __init__(scheme, moe_config, tid2eid=None) keeps the scheme as quant_method and tid2eid;
# is_monolithic False; maybe_make_prepare_finalize None; create_weights registers the scheme's
# get_weight tensors, then its get_dynamic_quant_param tensors with quant_method "channel", tagged
# "group" when the scheme has a group size and the name holds "weight_scale" (so vLLM's loader
# narrows weight_scale_inv per shard); apply, get_eplb_weight_views and
# process_weights_after_loading go to the scheme. Left out: the linear and embedding adapters.
import torch
from vllm.model_executor.layers.fused_moe import FusedMoeWeightScaleSupported
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.utils import set_weight_attrs


class AscendFusedMoEMethod(FusedMoEMethodBase):
    def __init__(self, scheme, moe_config, tid2eid=None) -> None:
        super().__init__(moe_config)
        self.quant_method = scheme
        self.tid2eid = tid2eid

    @property
    def is_monolithic(self) -> bool:
        return False

    def maybe_make_prepare_finalize(self, routing_tables=None):
        return None

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype,
                       **extra_weight_attrs):
        for key, value in self.quant_method.get_weight(num_experts, intermediate_size_per_partition, hidden_size,
                                                       params_dtype).items():
            param = torch.nn.Parameter(value, requires_grad=False)
            layer.register_parameter(key, param)
            set_weight_attrs(param, extra_weight_attrs)
        extra_weight_attrs.update({"quant_method": FusedMoeWeightScaleSupported.CHANNEL.value})
        grouped = ["weight_scale_second", "weight_offset_second", "scale_bias"]
        if getattr(self.quant_method, "group_size", 0) > 0:
            grouped += ["weight_scale", "weight_offset"]
        for key, value in self.quant_method.get_dynamic_quant_param(num_experts, intermediate_size_per_partition,
                                                                    hidden_size, params_dtype).items():
            param = torch.nn.Parameter(value, requires_grad=False)
            layer.register_parameter(key, param)
            set_weight_attrs(param, extra_weight_attrs)
            if any(field in key for field in grouped):
                param.quant_method = FusedMoeWeightScaleSupported.GROUP.value

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts=None, shared_experts_input=None):
        return self.quant_method.apply(layer=layer, x=x, topk_weights=topk_weights, topk_ids=topk_ids,
                                       shared_experts=shared_experts, shared_experts_input=shared_experts_input)

    def get_eplb_weight_views(self, layer):
        return self.quant_method.get_eplb_weight_views(layer)

    def process_weights_after_loading(self, layer) -> None:
        if hasattr(self.quant_method, "process_weights_after_loading"):
            self.quant_method.process_weights_after_loading(layer)

    def get_fused_moe_quant_config(self, layer):
        return None

# Stand-in for vLLM-Ascend 0.30.0rc2 (PyPI sdist, commit 8fde6d4e3), vllm_ascend/ops/fused_moe/routed_experts.py.
# Kept, with the release's names and call shapes:
# * AscendUnquantizedFusedMoEMethod(UnquantizedFusedMoEMethod) (:52), the bf16 MoE method:
#   __init__(moe, tid2eid) keeps tid2eid; is_monolithic False; maybe_make_prepare_finalize gives
#   None; get_eplb_weight_views; process_weights_after_loading runs the base hook, then replaces
#   w13_weight (E, 2I, H) by a contiguous transposed copy (E, H, 2I) and w2_weight (E, H, I) by
#   (E, I, H) through replace_parameter, then, without fused MC2, maybe_trans_nz on both (the
#   release imports it from vllm_ascend.utils, :49; identity here: no NZ format on CPU). apply()
#   does with torch the math the release hands to its MoE communication method.
# * AscendRoutedExperts(RoutedExperts) (:402): tid2eid set before the base __init__; without a
#   quant config the bf16 method; _get_quant_method (:588-591) asks
#   quant_config.get_quant_method(self, prefix, tid2eid=self.tid2eid).
# Left out: the config reads in __init__ (dynamic EPLB off, as under Model Runner V2), the fused
# MC2 / mega-MoE branch, EPLB, LoRA, routing and the communication path.
import torch
import torch.nn.functional as F
from vllm.model_executor.layers.fused_moe import RoutedExperts
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
    UnquantizedFusedMoEMethod,
    UnquantizedMoeBackend,
)
from vllm.model_executor.utils import replace_parameter

from vllm_ascend.utils import maybe_trans_nz


class AscendUnquantizedFusedMoEMethod(UnquantizedFusedMoEMethod):
    def __init__(self, moe=None, tid2eid=None):
        FusedMoEMethodBase.__init__(self, moe)
        self.unquantized_backend = UnquantizedMoeBackend.OOT
        self.experts_cls = None
        self.dynamic_eplb = False
        self.tid2eid = tid2eid
        self.lora_context = None

    def set_lora_context(self, lora_context) -> None:
        self.lora_context = lora_context

    @property
    def is_monolithic(self) -> bool:
        return False

    def maybe_make_prepare_finalize(self, routing_tables=None):
        return None

    @staticmethod
    def get_eplb_weight_views(layer) -> list[torch.Tensor]:
        weights = [layer.w13_weight, layer.w2_weight]
        if getattr(layer, "w13_bias", None) is not None:
            weights.append(layer.w13_bias)
        if getattr(layer, "w2_bias", None) is not None:
            weights.append(layer.w2_bias)
        return weights

    def process_weights_after_loading(self, layer):
        super(UnquantizedFusedMoEMethod, self).process_weights_after_loading(layer)
        w13_data = self._maybe_pad_weight(layer.w13_weight.data).transpose(1, 2).contiguous()
        replace_parameter(layer, "w13_weight", w13_data)
        w2_data = self._maybe_pad_weight(layer.w2_weight.data).transpose(1, 2).contiguous()
        replace_parameter(layer, "w2_weight", w2_data)
        layer.w13_weight.data = maybe_trans_nz(layer.w13_weight.data)
        layer.w2_weight.data = maybe_trans_nz(layer.w2_weight.data)

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts=None, shared_experts_input=None):
        w1, w2 = layer.w13_weight, layer.w2_weight  # (E, H, 2I), (E, I, H)
        inter = w2.shape[1]
        out = torch.zeros(x.shape[0], w2.shape[2], dtype=torch.float32, device=x.device)
        for t in range(x.shape[0]):
            for k in range(topk_ids.shape[1]):
                e = int(topk_ids[t, k])
                gate_up = x[t].float() @ w1[e].float()
                act = F.silu(gate_up[:inter]) * gate_up[inter:]
                out[t] += float(topk_weights[t, k]) * (act @ w2[e].float())
        return out.to(x.dtype)


class AscendRoutedExperts(RoutedExperts):  # type: ignore[no-redef]
    moe_counter = -1

    def __init__(self, *args, tid2eid=None, n_shared_experts: int = 0, **kwargs):
        object.__setattr__(self, "tid2eid", tid2eid)
        super().__init__(*args, **kwargs)
        if self.quant_config is None:
            self._replace_quant_method(AscendUnquantizedFusedMoEMethod(self.moe_config, tid2eid=self.tid2eid))
        self.n_shared_experts = n_shared_experts
        self.dynamic_eplb = False

    def _get_quant_method(self, prefix, quant_config, moe_config):
        if quant_config is None:
            return super()._get_quant_method(prefix, quant_config, moe_config)
        return quant_config.get_quant_method(self, prefix, tid2eid=self.tid2eid)

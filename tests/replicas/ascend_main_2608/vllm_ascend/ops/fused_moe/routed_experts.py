# Stand-in for vllm-project/vllm-ascend public main, commit 182b75ea84 (2026-08-22),
# vllm_ascend/ops/fused_moe/routed_experts.py (last changed there by 92616f3a64). Compared line
# by line with that file; kept, with upstream's names and call shapes:
# * AscendUnquantizedFusedMoEMethod(UnquantizedFusedMoEMethod), the bf16 MoE method:
#   __init__(moe, tid2eid) keeps tid2eid; is_monolithic False; maybe_make_prepare_finalize
#   returns None; get_eplb_weight_views; process_weights_after_loading first runs the base
#   FusedMoEMethodBase hook, then replaces w13_weight (E, 2I, H) by
#   _maybe_pad_weight(w13).transpose(1, 2).contiguous() = (E, H, 2I) and w2_weight (E, H, I)
#   by (E, I, H) (a device copy of each, through replace_parameter), then, without fused MC2,
#   maybe_trans_nz on both (upstream imports it from vllm_ascend.utils; identity here: no NZ
#   format on CPU).  apply() hands those to the MoE communication method, which computes
#   x @ w13[e] and act @ w2[e] (npu_grouped_matmul, need_trans=False); the stand-in does that
#   math with torch.
# * AscendRoutedExperts(RoutedExperts): tid2eid is set before the base __init__ (which asks
#   the quant config for the method); without a quant config it installs
#   AscendUnquantizedFusedMoEMethod(moe_config, tid2eid=...); _get_quant_method calls
#   quant_config.get_quant_method(self, prefix, tid2eid=self.tid2eid) (upstream line 391).
# Left out: the vllm config / ascend config reads in __init__ (dynamic EPLB is False here, as
# with the V2 model runner), vLLM's backend selection in UnquantizedFusedMoEMethod.__init__
# (it needs a platform; on NPU it resolves to the out-of-tree backend), the fused MC2 branch,
# EPLB setup, LoRA sync, routing and the communication path.
import torch
import torch.nn.functional as F
from vllm.model_executor.layers.fused_moe import RoutedExperts
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
    UnquantizedFusedMoEMethod,
    UnquantizedMoeBackend,
)
from vllm.model_executor.utils import replace_parameter


def maybe_trans_nz(weight: torch.Tensor) -> torch.Tensor:
    return weight


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

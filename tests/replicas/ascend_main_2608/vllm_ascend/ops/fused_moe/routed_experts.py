# Stand-in for vllm-project/vllm-ascend public main (2026-08-22), vllm_ascend/ops/fused_moe/routed_experts.py:
# AscendUnquantizedFusedMoEMethod(UnquantizedFusedMoEMethod), the bf16 MoE method. Kept: the class,
# its base (vLLM's real UnquantizedFusedMoEMethod), __init__(moe, tid2eid), and the weight layout of
# process_weights_after_loading: upstream replaces w13_weight (E, 2I, H) by
# w13.transpose(1, 2).contiguous() = (E, H, 2I) and w2_weight (E, H, I) by (E, I, H) (a device copy
# of each), then maybe_trans_nz (identity here); apply() feeds those to npu_grouped_matmul with
# need_trans=False, i.e. x @ w13[e] and act @ w2[e]. The stand-in's apply does that math with torch.
# Left out: vLLM's backend selection in __init__ (it needs a platform; on NPU it resolves to the
# out-of-tree backend), the ascend config / EPLB / fused MC2 branches, and the communication path.
import torch
import torch.nn.functional as F
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
        self.tid2eid = tid2eid
        self.dynamic_eplb = False
        self.lora_context = None

    @property
    def is_monolithic(self) -> bool:
        return False

    def process_weights_after_loading(self, layer):
        w13_data = layer.w13_weight.data.transpose(1, 2).contiguous()
        replace_parameter(layer, "w13_weight", w13_data)
        w2_data = layer.w2_weight.data.transpose(1, 2).contiguous()
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

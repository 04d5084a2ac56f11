# Stand-in for vllm-ascend 0.32 as the Drama 3 port describes it. No public source: no 0.31/0.32
# branch or tag exists in vllm-project/vllm-ascend. Built from public main of 2026-08-22 (commit
# 182b75ea84), vllm_ascend/worker/v2/model_runner.py (NPUModelRunner), compared with that file,
# with the one difference the port reports: prepare_inputs follows vLLM 0.32's MRv2 and requires
# num_active_loras: (scheduler_output, batch_req_state, batch_desc, num_active_loras).
# Kept: the class name, its real base (vLLM's MRv2 GPUModelRunner), construction of the parent
# inside torch_cuda_wrapper(). The stand-in does not run GPUModelRunner.__init__ (it needs a loaded
# model on a device): inside the wrapper it sets the config attributes that constructor sets
# first, then records what prepare_inputs receives.
import torch
from vllm.v1.worker.gpu.model_runner import GPUModelRunner

from vllm_ascend.worker.v2.utils import torch_cuda_wrapper


class NPUModelRunner(GPUModelRunner):
    """Model runner for Ascend NPUs (stand-in)."""

    def __init__(self, vllm_config, device: torch.device):
        with torch_cuda_wrapper():
            self.vllm_config = vllm_config
            self.model_config = vllm_config.model_config
            self.parallel_config = vllm_config.parallel_config
            self.scheduler_config = vllm_config.scheduler_config
            self.lora_config = vllm_config.lora_config
            self.device = device
            # What a constructor running under the wrapper sees as torch.cuda.Event.
            self.event_cls_at_init = torch.cuda.Event
        self.prepare_inputs_calls: list[tuple] = []

    def prepare_inputs(self, scheduler_output, batch_req_state, batch_desc, num_active_loras: int):
        self.prepare_inputs_calls.append((scheduler_output, batch_req_state, batch_desc, num_active_loras))
        return ("npu-input-batch", scheduler_output, batch_req_state, batch_desc, num_active_loras)

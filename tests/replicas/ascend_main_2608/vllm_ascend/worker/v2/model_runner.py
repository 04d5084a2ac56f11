# Stand-in for vllm-project/vllm-ascend, vllm_ascend/worker/v2/model_runner.py (NPUModelRunner,
# the Model Runner V2 for Ascend), public main of 2026-08-22 (commit 182b75ea84).
# Kept: the class name, its real base (vLLM's MRv2 GPUModelRunner), construction of the parent
# inside torch_cuda_wrapper(), and the signature of prepare_inputs on main for vLLM != 0.27.1:
# (scheduler_output, batch_req_state, batch_desc) -- no num_active_loras.
# The stand-in does not run GPUModelRunner.__init__ (it needs a loaded model on a device); it
# records what it was given and what prepare_inputs received.
import torch
from vllm.v1.worker.gpu.model_runner import GPUModelRunner

from vllm_ascend.worker.v2.utils import torch_cuda_wrapper


class NPUModelRunner(GPUModelRunner):
    """Model runner for Ascend NPUs (stand-in)."""

    def __init__(self, vllm_config, device: torch.device):
        with torch_cuda_wrapper():
            self.vllm_config = vllm_config
            self.device = device
        self.prepare_inputs_calls: list[tuple] = []

    def prepare_inputs(self, scheduler_output, batch_req_state, batch_desc):
        self.prepare_inputs_calls.append((scheduler_output, batch_req_state, batch_desc))
        return ("npu-input-batch", scheduler_output, batch_req_state, batch_desc)

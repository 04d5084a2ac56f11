# Stand-in for vllm-project/vllm-ascend 0.32.0 as the Drama 3 port used it (not public; per the
# port's review, it matches public main except where noted), after vllm_ascend/worker/v2/model_runner.py (NPUModelRunner,
# the Model Runner V2 for Ascend), public main of 2026-08-22 (commit 182b75ea84).
# Differs from main: prepare_inputs follows vLLM 0.32's MRv2 and requires num_active_loras:
# (scheduler_output, batch_req_state, batch_desc, num_active_loras).
# Kept: the class name, its real base (vLLM's MRv2 GPUModelRunner), construction of the parent
# inside torch_cuda_wrapper().
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

    def prepare_inputs(self, scheduler_output, batch_req_state, batch_desc, num_active_loras: int):
        self.prepare_inputs_calls.append((scheduler_output, batch_req_state, batch_desc, num_active_loras))
        return ("npu-input-batch", scheduler_output, batch_req_state, batch_desc, num_active_loras)

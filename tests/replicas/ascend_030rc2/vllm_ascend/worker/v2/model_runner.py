# Stand-in for vLLM-Ascend 0.30.0rc2 (PyPI sdist, commit 8fde6d4e3), vllm_ascend/worker/v2/model_runner.py (NPUModelRunner,
# :125, the Model Runner V2 for Ascend). Kept: the class name, its real base (vLLM's MRv2
# GPUModelRunner), construction of the parent inside torch_cuda_wrapper(), and the signature of
# prepare_inputs (:639-644): (scheduler_output, batch_req_state, batch_desc) -- no
# num_active_loras. The stand-in does not run GPUModelRunner.__init__ (it needs a loaded model on
# a device): inside the wrapper it sets the config attributes that constructor sets first, then
# records what prepare_inputs receives.
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

    def prepare_inputs(self, scheduler_output, batch_req_state, batch_desc):
        self.prepare_inputs_calls.append((scheduler_output, batch_req_state, batch_desc))
        return ("npu-input-batch", scheduler_output, batch_req_state, batch_desc)

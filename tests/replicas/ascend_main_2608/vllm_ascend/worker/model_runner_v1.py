# Stand-in for vllm-project/vllm-ascend, vllm_ascend/worker/model_runner_v1.py (NPUModelRunner,
# the V1 runner), public main of 2026-08-22 (commit 182b75ea84), compared with that file. Kept: the class name and its
# real base (vLLM's V1 GPUModelRunner). The stand-in does not run the parent constructor (it
# needs a model on a device); it records its arguments.
import torch
from vllm.v1.worker.gpu_model_runner import GPUModelRunner


class NPUModelRunner(GPUModelRunner):
    def __init__(self, vllm_config, device: torch.device):
        self.vllm_config = vllm_config
        self.device = device

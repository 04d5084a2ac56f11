# Stand-in for vllm-ascend 0.32 as the Drama 3 port describes it. No public source: no 0.31/0.32
# branch or tag exists in vllm-project/vllm-ascend. Built from public main of 2026-08-22 (commit 182b75ea84),
# vllm_ascend/worker/model_runner_v1.py, compared with that file; the port reports no difference in this file.
# NPUModelRunner, the V1 runner. Kept: the class name and its
# real base (vLLM's V1 GPUModelRunner). The stand-in does not run the parent constructor (it
# needs a model on a device); it records its arguments.
import torch
from vllm.v1.worker.gpu_model_runner import GPUModelRunner


class NPUModelRunner(GPUModelRunner):
    def __init__(self, vllm_config, device: torch.device):
        self.vllm_config = vllm_config
        self.device = device

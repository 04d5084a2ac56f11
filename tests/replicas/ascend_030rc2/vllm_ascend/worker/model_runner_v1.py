# Stand-in for vLLM-Ascend 0.30.0rc2 (PyPI sdist, commit 8fde6d4e3), vllm_ascend/worker/model_runner_v1.py (NPUModelRunner,
# the V1 runner, :364). Kept: the class name and its real base (vLLM's V1 GPUModelRunner). The
# stand-in does not run the parent constructor (it needs a model on a device); it records its
# arguments.
import torch
from vllm.v1.worker.gpu_model_runner import GPUModelRunner


class NPUModelRunner(GPUModelRunner):
    def __init__(self, vllm_config, device: torch.device):
        self.vllm_config = vllm_config
        self.device = device

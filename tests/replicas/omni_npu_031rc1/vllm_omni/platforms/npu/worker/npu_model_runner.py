# Stand-in for vllm-project/vllm-omni 0.31.0rc1 (PyPI wheel), vllm_omni/platforms/npu/worker/npu_model_runner.py
# (wheel RECORD sha256=qIWminwTSaApH7uT7LcZwV-nxCK2gOiBOiNBBm0WJ70), class OmniNPUModelRunner (line 39).
# Compared with that file: kept the class name and its bases, the real NPUAuxOutputMixin and V1
# OmniGPUModelRunner of the installed vllm-omni and vllm-ascend's V1 NPUModelRunner (non-310P
# branch). Left out: every method body (they need vllm-ascend's attention, forward context and
# NPU graph code, which cannot import here). The constructor does not run the parents' (they
# need a model on a device): it hands over to vllm-ascend's stand-in, which records its arguments.
from vllm_ascend.worker.model_runner_v1 import NPUModelRunner

from vllm_omni.platforms.npu.worker.aux_output import NPUAuxOutputMixin
from vllm_omni.worker.gpu_model_runner import OmniGPUModelRunner


class OmniNPUModelRunner(NPUAuxOutputMixin, OmniGPUModelRunner, NPUModelRunner):
    def __init__(self, vllm_config, device):
        NPUModelRunner.__init__(self, vllm_config, device)

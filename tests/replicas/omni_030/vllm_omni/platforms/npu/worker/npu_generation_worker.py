# Stand-in for vllm-project/vllm-omni 0.30.0 (PyPI wheel),
# vllm_omni/platforms/npu/worker/npu_generation_worker.py. Kept as upstream: class
# NPUGenerationWorker(OmniWorkerMixin, OmniNPUWorkerBase), model_runner_cls =
# NPUGenerationModelRunner, init_device building it whatever use_v2_model_runner says.
from vllm.v1.worker.workspace import init_workspace_manager

from vllm_omni.platforms.npu.worker.base import OmniNPUWorkerBase
from vllm_omni.platforms.npu.worker.npu_generation_model_runner import NPUGenerationModelRunner
from vllm_omni.worker.mixins import OmniWorkerMixin


class NPUGenerationWorker(OmniWorkerMixin, OmniNPUWorkerBase):
    """NPU generation worker for code2wav stage in Omni model."""

    model_runner_cls = NPUGenerationModelRunner

    def init_device(self):
        self.device = self._init_device()
        num_ubatches = 1
        init_workspace_manager(self.device, num_ubatches)

        self.model_runner = self.model_runner_cls(self.vllm_config, self.device)

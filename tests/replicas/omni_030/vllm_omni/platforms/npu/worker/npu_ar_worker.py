# Stand-in for vllm-project/vllm-omni 0.30.0 (PyPI wheel), vllm_omni/platforms/npu/worker/npu_ar_worker.py.
# Kept as upstream: class NPUARWorker(OmniWorkerMixin, OmniNPUWorkerBase), model_runner_cls =
# NPUARModelRunner, and init_device building `self.model_runner_cls(self.vllm_config, self.device)`
# whatever use_v2_model_runner says.
from vllm.v1.worker.workspace import init_workspace_manager

from vllm_omni.platforms.npu.worker.base import OmniNPUWorkerBase
from vllm_omni.platforms.npu.worker.npu_ar_model_runner import NPUARModelRunner
from vllm_omni.worker.mixins import OmniWorkerMixin


class NPUARWorker(OmniWorkerMixin, OmniNPUWorkerBase):
    """NPU AR worker for thinker/talker stages in Omni model."""

    model_runner_cls = NPUARModelRunner

    def init_device(self):
        self.device = self._init_device()
        num_ubatches = 1
        init_workspace_manager(self.device, num_ubatches)

        self.model_runner = self.model_runner_cls(self.vllm_config, self.device)

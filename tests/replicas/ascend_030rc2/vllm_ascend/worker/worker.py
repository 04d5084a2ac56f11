# Stand-in for vLLM-Ascend 0.30.0rc2 (PyPI sdist, commit 8fde6d4e3), vllm_ascend/worker/worker.py (NPUWorker, :122). Kept: the
# class name, its real base (vLLM's WorkerBase), the constructor's signature, adapt_patch() before
# the parent constructor (:141-143), the process-wide runner choice
# `self.use_v2_model_runner = self.vllm_config.use_v2_model_runner` after it (:192), and
# init_device building the V2 runner (vllm_ascend.worker.v2.model_runner.NPUModelRunner) or the V1
# runner from that flag (:491-506). Left out: CANN / torch-npu set-up, custom ops, profiler, sleep
# mode. _init_device returns the CPU device: this host has no NPU.
import torch
from vllm.config import VllmConfig
from vllm.logger import logger
from vllm.v1.worker.worker_base import WorkerBase
from vllm.v1.worker.workspace import init_workspace_manager

from vllm_ascend.worker.model_runner_v1 import NPUModelRunner


class NPUWorker(WorkerBase):
    def __init__(
        self,
        vllm_config: VllmConfig,
        local_rank: int,
        rank: int,
        distributed_init_method: str,
        is_driver_worker: bool = False,
        # Additional parameters for compatibility with vllm
        **kwargs,
    ):
        from vllm_ascend.utils import adapt_patch

        adapt_patch()
        super().__init__(
            vllm_config=vllm_config,
            local_rank=local_rank,
            rank=rank,
            distributed_init_method=distributed_init_method,
            is_driver_worker=is_driver_worker,
        )
        self.profiler = None
        self.use_v2_model_runner = self.vllm_config.use_v2_model_runner

    def _init_device(self):
        return torch.device("cpu")

    def init_device(self):
        self.device = self._init_device()
        init_workspace_manager(self.device, 1)
        if self.use_v2_model_runner:
            logger.warning("npu model runner v2 is in developing, some features doesn't work for now.")
            from vllm_ascend.worker.v2.model_runner import NPUModelRunner as NPUModelRunnerV2

            self.model_runner = NPUModelRunnerV2(self.vllm_config, self.device)
        else:
            self.model_runner = NPUModelRunner(self.vllm_config, self.device)

# Stand-in for vllm-project/vllm-omni 0.30.0 (PyPI wheel), vllm_omni/platforms/npu/worker/base.py
# (OmniNPUWorkerBase). Kept: the class and its base, vllm-ascend's NPUWorker, and an __init__
# that calls the parent first. Upstream picks vllm_ascend._310p's NPUWorker310 on 310P cards;
# the stand-in always takes vllm_ascend.worker.worker.NPUWorker. Left out: the Omni profiler.
from vllm_ascend.worker.worker import NPUWorker


class OmniNPUWorkerBase(NPUWorker):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)

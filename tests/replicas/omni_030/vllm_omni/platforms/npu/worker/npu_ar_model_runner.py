# Stand-in for vllm-project/vllm-omni 0.30.0 (PyPI wheel),
# vllm_omni/platforms/npu/worker/npu_ar_model_runner.py: NPUARModelRunner, the V1 AR runner,
# on vllm-ascend's V1 NPUModelRunner (the real one overrides execution; nothing of it is kept).
from vllm_ascend.worker.model_runner_v1 import NPUModelRunner


class NPUARModelRunner(NPUModelRunner):
    pass

# Stand-in for vllm-project/vllm-omni 0.30.0 (PyPI wheel),
# vllm_omni/platforms/npu/worker/npu_generation_model_runner.py: NPUGenerationModelRunner, the
# V1 runner of generation (code2wav / DAC) stages, on vllm-ascend's V1 NPUModelRunner.
from vllm_ascend.worker.model_runner_v1 import NPUModelRunner


class NPUGenerationModelRunner(NPUModelRunner):
    pass

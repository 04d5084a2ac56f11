# Stand-in for vllm-project/vllm-omni 0.32.0rc1 (PyPI wheel),
# vllm_omni/platforms/npu/worker/npu_generation_model_runner.py (wheel RECORD sha256=IoES0qi8RlQABhyFvyIJ_Sct5UPfMZRRFFXdni__Pw4),
# class NPUGenerationModelRunner (line 109): the V1 runner of generation (DAC / code2wav)
# stages on NPU. Compared with that file: kept the class name and its bases. Left out: its
# constructor's buffers, host-copy helpers and the execution path (vllm-ascend internals).
from vllm_omni.platforms.npu.worker.npu_model_runner import OmniNPUModelRunner
from vllm_omni.worker.omni_connector_model_runner_mixin import OmniConnectorModelRunnerMixin


class NPUGenerationModelRunner(OmniNPUModelRunner, OmniConnectorModelRunnerMixin):
    pass

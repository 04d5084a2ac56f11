# Stand-in for vllm-project/vllm-omni 0.31.0rc1 (PyPI wheel),
# vllm_omni/platforms/npu/worker/npu_generation_model_runner.py (wheel RECORD sha256=vTaHPZ-6JxRhnyWBPsM_THj_KNn1lqVsvzGRbmmqnSs),
# class NPUGenerationModelRunner (line 48): the V1 runner of generation (DAC / code2wav)
# stages on NPU. Compared with that file: kept the class name and its bases. Left out: its
# constructor's buffers, host-copy helpers and the execution path (vllm-ascend internals).
from vllm_omni.platforms.npu.worker.npu_model_runner import OmniNPUModelRunner
from vllm_omni.worker.omni_connector_model_runner_mixin import OmniConnectorModelRunnerMixin


class NPUGenerationModelRunner(OmniNPUModelRunner, OmniConnectorModelRunnerMixin):
    pass

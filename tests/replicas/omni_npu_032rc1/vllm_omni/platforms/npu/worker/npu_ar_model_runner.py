# Stand-in for vllm-project/vllm-omni 0.32.0rc1 (PyPI wheel), vllm_omni/platforms/npu/worker/npu_ar_model_runner.py
# (wheel RECORD sha256=HifEswHGESRoOqKPmz_NhP2h4EvBcOgoaZeJUDy3xD0), class NPUARModelRunner (line 116): the V1 runner of
# autoregressive stages on NPU. Compared with that file: kept the class name and its bases (the
# real Omni connector and duplex-sampling mixins). Left out: its constructor's buffers and the
# whole execution path (vllm-ascend's ACL graphs, attention metadata, forward context).
from vllm_omni.model_executor.duplex_sampling import DuplexSamplingRunnerMixin
from vllm_omni.platforms.npu.worker.npu_model_runner import OmniNPUModelRunner
from vllm_omni.worker.omni_connector_model_runner_mixin import OmniConnectorModelRunnerMixin


class NPUARModelRunner(OmniNPUModelRunner, OmniConnectorModelRunnerMixin, DuplexSamplingRunnerMixin):
    pass

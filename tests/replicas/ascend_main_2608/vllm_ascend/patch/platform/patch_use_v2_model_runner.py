# Stand-in for vllm-project/vllm-ascend, vllm_ascend/patch/platform/patch_use_v2_model_runner.py,
# public main of 2026-08-22 (commit 182b75ea84), compared with that file: the process-wide runner choice on Ascend is
# VLLM_USE_V2_MODEL_RUNNER when set, else V1. Replaces the property on vLLM's real VllmConfig.
import vllm.envs as envs
from vllm.config.vllm import VllmConfig


def _patched_use_v2_model_runner(self) -> bool:
    use_v2 = envs.VLLM_USE_V2_MODEL_RUNNER
    if use_v2 is not None:
        return use_v2
    return False


VllmConfig.use_v2_model_runner = property(_patched_use_v2_model_runner)

# Stand-in for vllm-ascend 0.32 as the Drama 3 port describes it. No public source: no 0.31/0.32
# branch or tag exists in vllm-project/vllm-ascend. Built from public main of 2026-08-22 (commit 182b75ea84),
# vllm_ascend/patch/platform/patch_use_v2_model_runner.py, compared with that file; the port reports no difference in this file.
# The process-wide runner choice on Ascend is VLLM_USE_V2_MODEL_RUNNER when set, else V1. Replaces the property on vLLM's real VllmConfig.
import vllm.envs as envs
from vllm.config.vllm import VllmConfig


def _patched_use_v2_model_runner(self) -> bool:
    use_v2 = envs.VLLM_USE_V2_MODEL_RUNNER
    if use_v2 is not None:
        return use_v2
    return False


VllmConfig.use_v2_model_runner = property(_patched_use_v2_model_runner)

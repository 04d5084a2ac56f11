# Stand-in for vLLM-Ascend 0.30.0rc2 (PyPI sdist, commit 8fde6d4e3), vllm_ascend/patch/platform/patch_use_v2_model_runner.py:
# the process-wide runner choice on Ascend is VLLM_USE_V2_MODEL_RUNNER when set, else V1; the
# property replaces vLLM's on the real VllmConfig. Left out: the release's wrappers of
# VllmConfig._validate_v2_model_runner and of the V1/V2 unsupported-feature lists (they need
# vLLM-Ascend's hardware profile and pipeline-transport helpers).
import vllm.envs as envs
from vllm.config.vllm import VllmConfig


def _patched_use_v2_model_runner(self) -> bool:
    use_v2 = envs.VLLM_USE_V2_MODEL_RUNNER
    if use_v2 is not None:
        return use_v2
    return False


VllmConfig.use_v2_model_runner = property(_patched_use_v2_model_runner)

# Stand-in for vLLM-Ascend 0.30.0rc2 (PyPI sdist, commit 8fde6d4e3), vllm_ascend/utils.py. Kept: FP8_METHOD = "fp8" (:58); the
# device helpers it re-exports from vllm_ascend.device.device_config (get_ascend_device_type,
# is_950; :42-47); maybe_trans_nz (:394; identity here: NZ is off unless weight_nz_mode asks, and
# this CPU host has no NZ format); adapt_patch (:683; the release imports the patch.platform or
# patch.worker package, whose __init__ imports each patch module; replica package __init__ files
# stay empty, so this imports the runner-choice and Mamba modules directly, and tests import any
# other patch module themselves). This release has no utils.is_310p: vLLM-Omni's NPU worker base
# then reads "not a 310P" (its AttributeError fallback).

import torch

from vllm_ascend.device.device_config import get_ascend_device_type, is_950  # noqa: F401

FP8_METHOD = "fp8"


def maybe_trans_nz(weight: torch.Tensor, customize_dtype=None, input_dtype=None) -> torch.Tensor:
    return weight


def adapt_patch(is_global_patch: bool = False):
    if is_global_patch:
        import vllm_ascend.patch.platform.patch_mamba_manager  # noqa: F401
        import vllm_ascend.patch.platform.patch_use_v2_model_runner  # noqa: F401
    else:
        # patch/worker/patch_v2/patch_use_v2_model_runner.py re-imports the platform patch.
        import vllm_ascend.patch.platform.patch_use_v2_model_runner  # noqa: F401

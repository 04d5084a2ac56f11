# Stand-in for vllm-project/vllm-ascend, vllm_ascend/utils.py (adapt_patch), public main of
# 2026-08-22 (commit 182b75ea84), compared with that file. Upstream imports the `vllm_ascend.patch.platform` package,
# whose __init__ imports patch_mamba_manager and patch_use_v2_model_runner; replica package
# __init__ files stay empty, so this imports the two modules directly. Upstream calls
# adapt_patch(is_global_patch=True) from vllm_ascend._ensure_global_patch (the general-plugin
# entry points vLLM loads in every process, the engine core included) and from
# NPUPlatform.pre_register_and_update; NPUWorker.__init__ calls adapt_patch(), whose
# `vllm_ascend.patch.worker` import brings many worker patches (patch_qwen3_5 among them): the
# stand-in imports only the runner-choice one; tests that need another import it themselves.
# is_310p() (read by vllm-omni's NPU worker base) answers for a 910B.


def adapt_patch(is_global_patch: bool = False):
    if is_global_patch:
        import vllm_ascend.patch.platform.patch_mamba_manager  # noqa: F401
        import vllm_ascend.patch.platform.patch_use_v2_model_runner  # noqa: F401
    else:
        # patch/worker/patch_v2/patch_use_v2_model_runner.py re-imports the platform patch.
        import vllm_ascend.patch.platform.patch_use_v2_model_runner  # noqa: F401


def is_310p() -> bool:
    # Upstream asks the SoC version; the card this stand-in stands for is a 910B.
    return False

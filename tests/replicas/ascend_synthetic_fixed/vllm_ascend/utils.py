# SYNTHETIC profile (see patch/platform/patch_mamba_manager.py): adapt_patch as in
# vllm-project/vllm-ascend vllm_ascend/utils.py (public main of 2026-08-22, commit 182b75ea84), importing only the
# Mamba manager patch this profile carries.


def adapt_patch(is_global_patch: bool = False):
    if is_global_patch:
        import vllm_ascend.patch.platform.patch_mamba_manager  # noqa: F401

"""Device-agnostic eager torch kernels used by the patches.

Nothing is imported here on purpose: importing ``drama3_patches`` must not
import torch.  Import the submodule you need (``drama3_patches.kernels.norms``,
``.rope``, ``.gating``, ``.qk_norm_rope_gate``, ``.sampling``, ``.fp8`` and its
native kernel ``.fp8_native`` (both on the format leaf ``.fp8_format``); ``.npu_fused``,
torch-npu's fused norms where an NPU has them).
"""

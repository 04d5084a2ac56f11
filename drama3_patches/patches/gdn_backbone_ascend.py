"""gdn-backbone-ascend: off CUDA the Drama 3 backbone keeps vLLM's Qwen GDN layers.

vllm-omni 0.32.0rc1's ``FishOmniForConditionalGeneration.__init__`` imports
``install_drama3_gdn`` from ``fish_omni.gdn`` inside the constructor and calls it on the
Qwen3.5 backbone unconditionally.  It re-classes every layer whose type is exactly vLLM's
``QwenGatedDeltaNetAttention`` to ``Drama3GatedDeltaNet``, which overrides ``_forward_core``
(steps with prefills go to FlashInfer / vLLM's CUDA Triton kernels and a Triton
``_zero_fresh_rows_kernel``) and ``get_attn_backend`` (its own subclass of vLLM's GDN metadata
builder).  vLLM-Ascend patches ``QwenGatedDeltaNetAttention`` in place (``forward``,
``_forward_core``, ``get_attn_backend`` -> its Ascend GDN backend, ...), so the class stays the
same and the swap happens on NPU too, replacing those Ascend methods with the CUDA ones.

The replacement decides by vLLM's platform at the moment the model is built: on CUDA the
original runs unchanged; on any other platform no layer is touched, the number of layers left on
vLLM's class is logged, and it returns 0 (no layer switched).  The platform rather than the
model's parameters: vLLM builds some models on ``meta`` (its IPC weight-cache loader) or on a
``load_config.device`` other than the compute device, while the platform is what decides
whether FlashInfer and the CUDA Triton backend exist in this process at all.

Feature detection calls the published function on a throwaway module holding one bare
``QwenGatedDeltaNetAttention`` (host parameters, this process's platform): if the layer keeps
its class, ``install_drama3_gdn`` already leaves the layers alone here and the patch is not
needed.
"""

from __future__ import annotations

import torch

from drama3_patches.logger import init_logger
from drama3_patches.patchlib import NotNeeded, PatchContext, wrap

logger = init_logger(__name__)


def _platform():
    from vllm.platforms import current_platform

    return current_platform


def _gdn_class(original) -> type:
    # The class the published function compares against, from its own module.
    return original.__globals__["QwenGatedDeltaNetAttention"]


def build(original):
    gdn_cls = _gdn_class(original)

    @wrap(original)
    def install_drama3_gdn(model: torch.nn.Module) -> int:
        platform = _platform()
        if platform.is_cuda():
            return original(model)
        kept = sum(1 for module in model.modules() if type(module) is gdn_cls)
        logger.info(
            "gdn-backbone-ascend: platform %r is not CUDA: kept %d Qwen GDN layer(s) on %s "
            "(the platform's own GDN path) instead of Drama3GatedDeltaNet",
            getattr(platform, "device_type", "") or type(platform).__name__, kept, gdn_cls.__name__,
        )
        return 0

    return install_drama3_gdn


def _bare_layer(gdn_cls: type) -> torch.nn.Module:
    """A ``gdn_cls`` instance without its (config-heavy) constructor: enough for a class check."""
    layer = object.__new__(gdn_cls)  # not PluggableLayer.__new__: no out-of-tree substitution
    torch.nn.Module.__init__(layer)
    layer.A_log = torch.nn.Parameter(torch.zeros(1), requires_grad=False)  # on the host
    return layer


def swaps_here(original) -> bool:
    """Does the published function re-class a Qwen GDN layer in this process?"""
    gdn_cls = _gdn_class(original)
    probe = torch.nn.Sequential(_bare_layer(gdn_cls))
    original(probe)
    return type(probe[0]) is not gdn_cls


def plan(ctx: PatchContext) -> dict:
    replacements = {}
    for target in ctx.targets:
        original = ctx.original(target)
        if not callable(original):
            ctx.leave(target, f"{target} is {type(original).__name__}, not a function")
            continue
        try:
            swaps = swaps_here(original)
        except Exception as exc:
            raise RuntimeError(f"{target}: cannot check whether it swaps Qwen GDN layers: "
                               f"{type(exc).__name__}: {exc}") from exc
        if not swaps:
            raise NotNeeded(f"{target} already leaves Qwen GDN layers on their class on this platform")
        replacements[target] = build(original)
    return replacements

"""gdn-backbone-ascend: off CUDA the Drama 3 backbone keeps vLLM's Qwen GDN layers.

Record: ``patches_manifest.yaml``, id ``gdn-backbone-ascend`` (why, how, upstream change,
remove-when; ``drama3-patches list --verbose`` prints it). Below: only what reading this code
needs.

Layout: ``build`` wraps ``install_drama3_gdn`` in a wrapt ``FunctionWrapper`` (same signature,
introspection reads through) that asks ``_platform()`` (vLLM's current platform) on every call,
not once at import; ``swaps_here`` is the feature detection, run on a bare layer from
``_bare_layer``.
"""

from __future__ import annotations

import inspect

import torch

from drama3_patches.logger import init_logger
from drama3_patches.patchlib import PatchContext, function_wrapper, replace_where_needed

logger = init_logger(__name__)


def _platform():
    from vllm.platforms import current_platform

    return current_platform


def _gdn_class(original) -> type:
    # The class the published function compares against, from its own module.
    return original.__globals__["QwenGatedDeltaNetAttention"]


def build(original):
    gdn_cls = _gdn_class(original)
    signature = inspect.signature(original)
    model_param = next(iter(signature.parameters))

    def install_drama3_gdn(wrapped, instance, args, kwargs) -> int:
        platform = _platform()
        if platform.is_cuda():
            return wrapped(*args, **kwargs)
        model = signature.bind(*args, **kwargs).arguments[model_param]
        kept = sum(1 for module in model.modules() if type(module) is gdn_cls)
        logger.info(
            "gdn-backbone-ascend: platform %r is not CUDA: kept %d Qwen GDN layer(s) on %s "
            "(the platform's own GDN path) instead of Drama3GatedDeltaNet",
            getattr(platform, "device_type", "") or type(platform).__name__, kept, gdn_cls.__name__,
        )
        return 0

    # Same signature as the published function: a FunctionWrapper, introspection reads through.
    return function_wrapper(original, install_drama3_gdn)


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
    return replace_where_needed(ctx, swaps_here, build, kind="function",
                                checking="whether it swaps Qwen GDN layers",
                                fixed="already leaves Qwen GDN layers on their class on this platform")

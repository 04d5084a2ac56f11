"""tower-sampler-eager: the Drama 3 model's Triton entry points fall back to
eager kernels when their tensors are not on CUDA.

The Drama 3 model code (``fish_omni``, shipped in the vLLM-Omni builds that
serve it, not in public releases) runs its audio tower norms, the QK norm +
RoPE + gate split and the frame sampling through Triton kernels.  Off CUDA
(Ascend NPU, CPU) a Triton launch fails on the device pointers.  Each target
is wrapped: when the first tensor argument ``is_cuda`` the original runs
unchanged; otherwise the matching kernel of ``drama3_patches.kernels`` runs
with the same arguments.

The manifest names the targets, so an operator can point them at the module
and function names of their vLLM-Omni build.  The kernel for a target is
chosen by signature (the parameter names, in order), never by name: a target
whose signature matches no kernel fails the patch with the names shown
(``DRAMA3_PATCHES_STRICT=1`` makes that an error).
"""

from __future__ import annotations

import importlib
import inspect

from drama3_patches.logger import init_logger
from drama3_patches.patchlib import PatchContext, wrap

logger = init_logger(__name__)

#: The eager kernels a target may dispatch to, as ``module:function``.
KERNELS = (
    "drama3_patches.kernels.norms:gemma_rms_norm",
    "drama3_patches.kernels.norms:tower_embed_norm",
    "drama3_patches.kernels.gating:sigmoid_gate",
    "drama3_patches.kernels.qk_norm_rope_gate:qk_norm_rope_gate",
    "drama3_patches.kernels.sampling:sample_top_k_top_p",
)


def _load(path: str):
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def _param_names(func) -> tuple[str, ...]:
    return tuple(inspect.signature(func).parameters)


def kernel_for(original):
    """The eager kernel whose parameter names equal ``original``'s, or None."""
    names = _param_names(original)
    matches = [k for k in map(_load, KERNELS) if _param_names(k) == names]
    return matches[0] if len(matches) == 1 else None


def _first_tensor_is_cuda(args, kwargs, tensor_type) -> bool:
    for value in (*args, *kwargs.values()):
        if isinstance(value, tensor_type):
            return value.is_cuda
    return False


def _build(original, kernel):
    import torch  # resolved once here, not on every call of the hot path

    tensor_type = torch.Tensor

    @wrap(original)
    def dispatch(*args, **kwargs):
        if _first_tensor_is_cuda(args, kwargs, tensor_type):
            return original(*args, **kwargs)
        return kernel(*args, **kwargs)

    dispatch.__drama3_eager_kernel__ = f"{kernel.__module__}:{kernel.__qualname__}"
    return dispatch


def plan(ctx: PatchContext) -> dict:
    out = {}
    for target in ctx.targets:
        original = ctx.original(target)
        if not callable(original):
            raise TypeError(f"{target} is not a function ({type(original).__name__})")
        kernel = kernel_for(original)
        if kernel is None:
            raise TypeError(
                f"{target}{inspect.signature(original)} matches no eager kernel; known: "
                + "; ".join(f"{p}{inspect.signature(_load(p))}" for p in KERNELS)
            )
        out[target] = _build(original, kernel)
        logger.debug("tower-sampler-eager: %s -> %s off CUDA", target, out[target].__drama3_eager_kernel__)
    return out

"""qwen3next-eager-attention: every Qwen3-Next attention layer takes the eager
QK-RMSNorm / RoPE / gate-split path on NPU.

vLLM (0.31, 0.32) decides once, in ``Qwen3NextAttention.__init__``, whether
``_project_qkv_gate`` calls the fused Triton kernel
``fused_qk_rmsnorm_rope_gate``: ``use_fused_qk_norm_rope_gate`` is true when
the output gate is on, RoPE is NeoX style, the rotary cache dtype is
bf16/fp16, the model is text-only (or uses interleaved 3-section mRoPE) and
``current_platform.is_cuda() or current_platform.is_xpu()``.  Everything else
takes the eager branch (split, ``q_norm``/``k_norm``, ``rotary_emb``), whose
norm and rotary modules are CustomOps that vLLM-Ascend maps to its own
kernels.  On an Ascend host the platform answer depends on which plugin and
which shims (vLLM-Ascend's ``torch_cuda_wrapper``, Triton-Ascend) are in the
process; the fused kernel must never be selected there.

The replacement ``__init__`` runs the original, then sets
``use_fused_qk_norm_rope_gate = False`` on the instance, and checks that the
layer really is on the eager path (flag false after the assignment, ``q_norm``,
``k_norm`` and ``rotary_emb`` present); otherwise it raises naming the
layer's prefix.  Weights, their loaders and the module tree are untouched.
The check runs when ``Qwen3NextAttention.__init__`` returns: a subclass that
sets the flag again later in its own ``__init__`` is not seen (none in vLLM
0.31/0.32 calls it and then does).

Feature detection: a class with no ``_project_qkv_gate`` has no fused
dispatch (nothing to do); a class already carrying the in-tree port's marker
``_fish_omni_npu_eager`` is left alone.  The replacement carries the same
marker, so ``Qwen3NextAttention.__init__._fish_omni_npu_eager`` tells any
second copy of this logic that the class is done.
"""

from __future__ import annotations

import inspect
import sys

from drama3_patches.logger import init_logger
from drama3_patches.patchlib import NotNeeded, PatchContext, wrap

logger = init_logger(__name__)

MARKER = "_fish_omni_npu_eager"
FLAG = "use_fused_qk_norm_rope_gate"
EAGER_PARTS = ("q_norm", "k_norm", "rotary_emb")


class EagerPathError(RuntimeError):
    """A Qwen3-Next attention layer was built without the eager QK path."""


def _class_of(target: str) -> type:
    module_name, qualname = target.split(":")
    obj = sys.modules[module_name]
    for part in qualname.split(".")[:-1]:
        obj = getattr(obj, part)
    return obj


def is_eager_class(cls: type) -> bool:
    """True when ``cls`` (or its ``__init__``) carries the eager marker."""
    return bool(cls.__dict__.get(MARKER)) or bool(getattr(cls.__init__, MARKER, False))


def check_eager(layer, prefix: str) -> None:
    """Raise :class:`EagerPathError` unless ``layer`` will run the eager path."""
    missing = [name for name in EAGER_PARTS if getattr(layer, name, None) is None]
    fused = getattr(layer, FLAG, False)
    if fused or missing:
        what = f"{FLAG}={fused!r}" if fused else f"missing {', '.join(missing)}"
        raise EagerPathError(
            f"qwen3next-eager-attention: {type(layer).__name__} layer {prefix!r} did not take the "
            f"eager QK-norm/RoPE/gate path ({what}); the fused Triton kernel cannot run on NPU"
        )


def _build(original):
    sig = inspect.signature(original)
    prefix_default = sig.parameters["prefix"].default if "prefix" in sig.parameters else ""

    @wrap(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        try:
            prefix = sig.bind(self, *args, **kwargs).arguments.get("prefix", prefix_default)
        except TypeError:
            prefix = prefix_default
        # An instance attribute wins over whatever the platform checks computed.
        setattr(self, FLAG, False)
        check_eager(self, prefix)

    setattr(__init__, MARKER, True)
    return __init__


def plan(ctx: PatchContext) -> dict:
    out = {}
    for target in ctx.targets:
        cls = _class_of(target)
        if cls.__dict__.get(MARKER):
            raise NotNeeded(f"{cls.__qualname__} already carries {MARKER} (eager path built in)")
        if "_project_qkv_gate" not in vars(cls):
            ctx.leave(target, f"{cls.__qualname__} has no fused QK-norm/RoPE/gate dispatch: already eager")
            continue
        original = ctx.original(target)
        if getattr(original, MARKER, False):
            ctx.leave(target, f"{cls.__qualname__}.__init__ already forces the eager path")
            continue
        out[target] = _build(original)
        logger.debug("qwen3next-eager-attention: %s forces %s = False", target, FLAG)
    return out

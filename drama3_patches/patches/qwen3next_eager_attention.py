"""qwen3next-eager-attention: no Qwen3-Next attention layer that reads vLLM's fused-kernel flag
selects the Triton QK-RMSNorm / RoPE / gate kernel on NPU.

vLLM (0.31, 0.32) decides once, in ``Qwen3NextAttention.__init__``, whether ``_project_qkv_gate``
calls the Triton kernel ``fused_qk_rmsnorm_rope_gate``: ``use_fused_qk_norm_rope_gate`` is true
when the output gate is on, RoPE is NeoX style, the rotary cache is bf16/fp16, the model is
text-only (or uses interleaved 3-section mRoPE) and ``current_platform.is_cuda() or is_xpu()``.
Only vLLM's own ``Qwen3NextAttention.forward`` reads the flag (through ``_project_qkv_gate``).

What runs for Drama 3 on NPU (vllm-ascend public main, 182b75ea84): vLLM-Ascend's platform is an
out-of-tree platform (``_enum = OOT``), so vLLM's check is false and the flag is already False;
and vLLM-Ascend's worker patch ``patch/worker/patch_qwen3_5.py`` (imported on every non-310P
worker) replaces ``Qwen3NextAttention.forward`` for every model with
``AscendQwen3NextAttention.forward``, which never calls ``_project_qkv_gate``. For a text config
whose ``model_type`` contains ``qwen3_5`` -- Drama 3's backbone config is transformers'
``Qwen3_5MoeTextConfig``, ``qwen3_5_moe_text`` -- that forward runs vLLM-Ascend's Triton-Ascend op
``torch.ops.vllm.triton_split_qkv_rmsnorm_mrope``.

So the patch decides by what it finds, at import of ``qwen3_next`` (its ``plan``) and again for
each layer built (the wrapped ``__init__``):

* the class carries the in-tree port's marker ``_fish_omni_npu_eager``, or has no
  ``_project_qkv_gate``: nothing to do (not-needed);
* the forward in effect never reaches ``_project_qkv_gate`` (vLLM-Ascend's, when its worker patch
  was imported first): the flag is never read (not-needed, naming that forward);
* vLLM's platform check answers neither CUDA nor XPU in this process: vLLM already keeps the
  flag False (not-needed, naming the platform);
* otherwise (a process whose vLLM platform says CUDA/XPU while drama3-patches runs for npu) the
  constructor is wrapped: after the original it sets ``use_fused_qk_norm_rope_gate = False`` on
  the instance when the layer's forward reads it, and refuses, naming the layer prefix, a layer
  that would still take the fused kernel or lacks the eager path's ``q_norm`` / ``k_norm`` /
  ``rotary_emb``. A layer whose forward does not read the flag is left as built and the forward
  is named once in the log. Weights, weight loaders and the module tree are unchanged.
"""

from __future__ import annotations

import inspect
import sys

from drama3_patches.logger import init_logger
from drama3_patches.patchlib import NotNeeded, PatchContext, wrap

logger = init_logger(__name__)

MARKER = "_fish_omni_npu_eager"
FLAG = "use_fused_qk_norm_rope_gate"
READER = "_project_qkv_gate"
EAGER_PARTS = ("q_norm", "k_norm", "rotary_emb")

_named_forwards: set[str] = set()


class EagerPathError(RuntimeError):
    """A Qwen3-Next attention layer whose forward reads the flag would take the fused kernel."""


def is_eager_class(cls: type) -> bool:
    """True when ``cls`` (or its ``__init__``) carries the eager marker."""
    return bool(cls.__dict__.get(MARKER)) or bool(getattr(cls.__init__, MARKER, False))


def _code_names(func) -> set[str] | None:
    code = getattr(inspect.unwrap(func), "__code__", None)
    return None if code is None else set(code.co_names)


def forward_in_effect(cls: type):
    """The ``forward`` an instance of ``cls`` runs, and whether it reaches ``_project_qkv_gate``.

    Read from the code's names: a forward that names ``_project_qkv_gate`` reads the flag; one
    that delegates with ``super().forward`` is followed up the MRO; one that cannot be read is
    assumed to read it.
    """
    first = None
    for klass in cls.__mro__:
        forward = klass.__dict__.get("forward")
        if forward is None:
            continue
        first = first or forward
        names = _code_names(forward)
        if names is None or READER in names:
            return first, True
        if not {"super", "forward"} <= names:
            return first, False
    return first, False


def describe(func) -> str:
    func = inspect.unwrap(func)
    return f"{getattr(func, '__module__', '?')}.{getattr(func, '__qualname__', repr(func))}"


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
        forward, reads_flag = forward_in_effect(type(self))
        if not reads_flag:
            # Nothing reads the flag: whatever it says cannot select the fused kernel.
            name = describe(forward)
            if name not in _named_forwards:
                _named_forwards.add(name)
                logger.info(
                    "qwen3next-eager-attention: %s layers run %s, which never calls %s; "
                    "left as built", type(self).__name__, name, READER,
                )
            return
        try:
            prefix = sig.bind(self, *args, **kwargs).arguments.get("prefix", prefix_default)
        except TypeError:
            prefix = prefix_default
        # An instance attribute wins over whatever the platform checks computed.
        setattr(self, FLAG, False)
        check_eager(self, prefix)

    setattr(__init__, MARKER, True)
    return __init__


def _platform_selects_fused(module) -> str | None:
    """Why vLLM's own check cannot select the fused kernel here, or None when it can."""
    platform = getattr(module, "current_platform", None)
    if platform is None:
        return None
    if platform.is_cuda() or platform.is_xpu():
        return None
    return (
        f"vLLM's own check keeps {FLAG} False here: current_platform "
        f"{type(platform).__name__} is neither CUDA nor XPU"
    )


def plan(ctx: PatchContext) -> dict:
    out = {}
    for target in ctx.targets:
        cls, _ = ctx.owner(target)
        if cls.__dict__.get(MARKER):
            raise NotNeeded(f"{cls.__qualname__} already carries {MARKER} (eager path built in)")
        if READER not in vars(cls):
            ctx.leave(target, f"{cls.__qualname__} has no fused QK-norm/RoPE/gate dispatch: already eager")
            continue
        original = ctx.original(target)
        if getattr(original, MARKER, False):
            ctx.leave(target, f"{cls.__qualname__}.__init__ already forces the eager path")
            continue
        forward, reads_flag = forward_in_effect(cls)
        if not reads_flag:
            ctx.leave(target, f"{cls.__qualname__}.forward is {describe(forward)}, which never calls "
                              f"{READER}: {FLAG} is not read")
            continue
        why_not = _platform_selects_fused(sys.modules[cls.__module__])
        if why_not is not None:
            ctx.leave(target, why_not)
            continue
        out[target] = _build(original)
        logger.debug("qwen3next-eager-attention: %s forces %s = False", target, FLAG)
    return out

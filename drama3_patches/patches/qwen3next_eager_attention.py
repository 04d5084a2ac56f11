"""qwen3next-eager-attention: no Qwen3-Next attention layer that reads vLLM's fused-kernel flag selects the
Triton QK-RMSNorm / RoPE / gate kernel on NPU.

Record: ``patches_manifest.yaml``, id ``qwen3next-eager-attention`` (why, how, upstream change,
remove-when; ``drama3-patches list --verbose`` prints it). Below: only what reading this code
needs.

Layout: ``plan`` runs the not-needed checks in the manifest's order (``is_eager_class``,
``forward_in_effect`` read through its code names, ``_platform_selects_fused``); ``_build``
wraps ``__init__`` and checks each built layer with ``check_eager`` (``EagerPathError`` names
the layer prefix). The wrapper carries ``MARKER`` so a second look at the class sees it.
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

"""Run the published Triton kernels on CPU with Triton's interpreter (reference for eager kernels).

Use in a fresh interpreter (``support.subproc.call``), before anything imports a module that defines Triton
kernels (``vllm_omni...fish_omni.kernels``, ``vllm...fused_qk_norm_rope``)::

    from support import triton_interpret
    triton_interpret.enable()            # TRITON_INTERPRET=1, real triton behind vllm.triton_utils
    from vllm_omni.model_executor.models.fish_omni import kernels   # now interpreted

vLLM swaps Triton for a placeholder when no GPU driver is active; ``enable``
puts the real modules back into ``vllm.triton_utils`` so ``@triton.jit`` in a
module imported afterwards builds interpreted kernels.

Rounding: the interpreter converts float32 to bfloat16 by dropping the low
mantissa bits (truncation); GPU Triton converts with round-to-nearest-even
(``cvt.rn.bf16.f32``).  ``bf16_rounding("nearest-even")`` makes the
interpreter convert as the GPU does (the default after ``enable``), so the
reference has the published kernel's GPU numerics; ``bf16_rounding("truncate")``
restores the interpreter's own conversion.

``no_launch()`` makes every Triton kernel launch (interpreted or compiled)
raise :class:`TritonLaunch`, so a test can prove that code ran without one.
"""

from __future__ import annotations

import contextlib
import os
import sys

__all__ = ["TritonLaunch", "bf16_rounding", "enable", "launches_blocked", "no_launch"]

_KERNEL_MODULES = (
    "vllm_omni.model_executor.models.fish_omni.kernels",
    "vllm.model_executor.layers.fused_qk_norm_rope",
)
_TRUNCATING = None  # the interpreter's own float conversion, kept to restore it
_BLOCKED = 0


class TritonLaunch(RuntimeError):
    """A Triton kernel launch was attempted inside ``no_launch()``."""


def enable(rounding: str = "nearest-even") -> None:
    global _TRUNCATING
    late = [m for m in _KERNEL_MODULES if m in sys.modules]
    if late:
        raise RuntimeError(f"{late} imported before the interpreter was set up: their kernels are placeholders")
    os.environ["TRITON_INTERPRET"] = "1"
    import triton
    import triton.language as tl
    import triton.runtime.interpreter as interpreter
    import vllm.triton_utils as triton_utils
    import vllm.triton_utils.importing as importing

    triton_utils.triton, triton_utils.tl = triton, tl
    triton_utils.HAS_TRITON = importing.HAS_TRITON = True
    if _TRUNCATING is None:
        _TRUNCATING = interpreter._convert_float
        _guard_launches()
    bf16_rounding(rounding)


def bf16_rounding(mode: str) -> None:
    """``"nearest-even"`` (GPU Triton) or ``"truncate"`` (the stock interpreter)."""
    import triton.runtime.interpreter as interpreter

    if mode == "truncate":
        interpreter._convert_float = _TRUNCATING
    elif mode == "nearest-even":
        interpreter._convert_float = _convert_rne
    else:
        raise ValueError(mode)


def _convert_rne(data, src_type, dst_type, rounding_mode):
    import numpy as np
    import torch
    import triton.language as tl

    if src_type == tl.float32 and dst_type == tl.bfloat16:
        values = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32))
        return values.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    return _TRUNCATING(data, src_type, dst_type, rounding_mode)


def _guard_launches() -> None:
    # Every launch, interpreted or compiled, goes through one of these `run` methods.
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    for cls in (JITFunction, InterpretedFunction):
        original = cls.run

        def run(self, *args, __original=original, **kwargs):
            if _BLOCKED:
                raise TritonLaunch(f"Triton kernel {getattr(self, '__name__', self)!s} launched")
            return __original(self, *args, **kwargs)

        cls.run = run


def launches_blocked() -> bool:
    return bool(_BLOCKED)


@contextlib.contextmanager
def no_launch():
    """Inside the block any Triton launch raises :class:`TritonLaunch`."""
    global _BLOCKED
    _BLOCKED += 1
    try:
        yield
    finally:
        _BLOCKED -= 1

"""torch-npu's fused RMSNorm ops for the eager tower kernels, behind feature detection.

Off CUDA every aten op is one host dispatch (10-40 us on Ascend), and the tower's norms
dominate a decode frame in eager mode. Where the tensors live on an NPU and ``torch_npu``
provides ``npu_rms_norm`` and ``npu_add_rms_norm``, ``norms`` and ``qk_norm_rope_gate`` hand
each row normalisation to one of them instead of six to eight aten ops.

:func:`fused_norms` answers None (the eager path) for every other device, for a ``torch_npu``
without both ops, and when ``DRAMA3_PATCHES_NPU_FUSED`` is set off (docs/design.md). It never
imports ``torch_npu``: a tensor on a real NPU means the process has imported it already, and
a tensor on anything else must not start the Ascend runtime. The fused ops round ``gamma`` to
the activation dtype and keep their own rounding order, so they agree with the eager path to
bfloat16 tolerance, not bit for bit; the CPU path never reaches them.
"""

from __future__ import annotations

import sys

import torch

from drama3_patches import env

__all__ = ["FUSED_DTYPES", "FusedNorms", "for_tensor", "fused_norms"]

#: activation dtypes both fused ops take
FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_OPS = ("npu_rms_norm", "npu_add_rms_norm")
# device type -> FusedNorms or None, found once per process (torch_npu's ops and the opt-out do not change)
_BACKENDS: dict = {}


class FusedNorms:
    """Two fused row norms over ``gamma``'s trailing shape (``[D]``: each row of ``D``).

    ``rms_norm(x, gamma, eps) -> y`` and ``add_rms_norm(x, residual, gamma, eps) -> (y, x + residual)``,
    with ``y = s * rsqrt(mean(s^2) + eps) * gamma``. Built on ops shaped like torch-npu's
    (``(y, rstd)`` and ``(y, rstd, x_sum)``); the tests build one on stand-in ops of that shape.
    """

    __slots__ = ("_rms_norm", "_add_rms_norm")

    def __init__(self, rms_norm_op, add_rms_norm_op) -> None:
        self._rms_norm = rms_norm_op
        self._add_rms_norm = add_rms_norm_op

    def rms_norm(self, x: torch.Tensor, gamma: torch.Tensor, eps: float) -> torch.Tensor:
        return self._rms_norm(_dense(x), gamma, eps)[0]

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, gamma: torch.Tensor, eps: float):
        y, _, x_sum = self._add_rms_norm(_dense(x), _dense(residual), gamma, eps)
        return y, x_sum


def _dense(x: torch.Tensor) -> torch.Tensor:
    # The fused ops are documented on dense rows; a strided view (q heads inside [q | gate],
    # a column slice of qkv) is copied first. Dense input is passed as it is, with no launch.
    return x.contiguous()


def fused_norms(device) -> FusedNorms | None:
    """The fused norms for tensors on ``device`` (a ``torch.device``), or None for the eager path."""
    kind = device.type
    if kind != "npu":
        return None
    try:
        return _BACKENDS[kind]
    except KeyError:
        # the opt-out is read with the ops, once: the kernels run every layer of every frame
        found = _BACKENDS[kind] = _detect() if env.npu_fused() else None
        return found


def _detect() -> FusedNorms | None:
    # Only a torch_npu the process imported itself: an "npu" device without it (a simulated one)
    # has no fused ops, and importing it here could start a runtime nobody asked for.
    module = sys.modules.get("torch_npu")
    ops = [getattr(module, name, None) for name in _OPS]
    if module is None or not all(callable(op) for op in ops):
        return None
    return FusedNorms(*ops)


def for_tensor(x: torch.Tensor) -> FusedNorms | None:
    """:func:`fused_norms` for ``x``'s device, None where its dtype is not one the fused ops take."""
    if x.dtype not in FUSED_DTYPES:
        return None
    return fused_norms(x.device)

"""torch-npu's two fused norms stood in for on the CPU, each registered as one op (namespace
``drama3_test``), so ``support.launches`` counts one launch per fused op, as on the card.

They compute the fused ops' formula in float32 (not torch-npu's arithmetic) and refuse what the
kernels promise never to pass them (strided rows, gamma in another dtype). Used by
tests/kernels/test_npu_fused_path.py (monkeypatched detection) and by the e2e tier's dispatch
count (``DRAMA3_E2E_FUSED_STANDIN=1``: tests/e2e/site/e2e_dispatch.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

from drama3_patches.kernels import npu_fused

__all__ = ["STAND_IN", "fused_add_rms_norm", "fused_rms_norm"]


def _check_operands(x: Tensor, gamma: Tensor) -> None:
    # What the kernels promise the fused ops: dense rows and gamma in the activation dtype.
    if not x.is_contiguous():
        raise ValueError("the stand-in fused norm takes dense rows")
    if gamma.dtype != x.dtype:
        raise TypeError(f"gamma is {gamma.dtype}, rows are {x.dtype}")


def _normalise(s32: Tensor, gamma: Tensor, eps: float, dtype) -> tuple[Tensor, Tensor]:
    dims = tuple(range(-gamma.dim(), 0))  # over gamma's trailing shape
    rstd = torch.rsqrt(s32.pow(2).mean(dims, keepdim=True) + eps)
    return (s32 * rstd * gamma.to(torch.float32)).to(dtype), rstd


@torch.library.custom_op("drama3_test::fused_rms_norm", mutates_args=(), device_types="cpu")
def fused_rms_norm(x: Tensor, gamma: Tensor, epsilon: float) -> tuple[Tensor, Tensor]:
    _check_operands(x, gamma)
    return _normalise(x.to(torch.float32), gamma, epsilon, x.dtype)


@torch.library.custom_op("drama3_test::fused_add_rms_norm", mutates_args=(), device_types="cpu")
def fused_add_rms_norm(x1: Tensor, x2: Tensor, gamma: Tensor, epsilon: float) -> tuple[Tensor, Tensor, Tensor]:
    _check_operands(x1, gamma)
    _check_operands(x2, gamma)
    s32 = x1.to(torch.float32) + x2.to(torch.float32)
    y, rstd = _normalise(s32, gamma, epsilon, x1.dtype)
    return y, rstd, s32.to(x1.dtype)


STAND_IN = npu_fused.FusedNorms(torch.ops.drama3_test.fused_rms_norm, torch.ops.drama3_test.fused_add_rms_norm)

"""torch-npu's two fused norms stood in for on the CPU, each registered as one op (namespace
``drama3_test``), so ``support.launches`` counts one launch per fused op, as on the card.

They compute the fused ops' formula in float32 (not torch-npu's arithmetic) and refuse what the
kernels promise never to pass them (strided rows, gamma in another dtype). Used by
tests/kernels/test_npu_fused_path.py (monkeypatched detection) and by the e2e tier's dispatch
count (``DRAMA3_E2E_FUSED_STANDIN=1``: tests/e2e/site/e2e_dispatch.py).

:func:`faulty` gives each op with one of the faults the self-check in ``npu_fused`` must catch
(a torch-npu of another arity, shape, arithmetic, or one that refuses the call).
"""

from __future__ import annotations

import torch
from torch import Tensor

from drama3_patches.kernels import npu_fused

__all__ = ["CONTRACT_FAULTS", "FAULTS", "STAND_IN", "WRONG_EPS", "faulty", "fused_add_rms_norm", "fused_rms_norm"]


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


#: what :func:`faulty` can get wrong
FAULTS = ("arity", "shape", "values", "raises", "layernorm", "whole-row", "epsilon")
#: the faults of another op's contract: right shape and arity, wrong arithmetic
CONTRACT_FAULTS = ("layernorm", "whole-row", "epsilon")
WRONG_EPS = 1e-5  # the ``epsilon`` fault's own eps (LayerNorm's usual default), whatever it is given


def _other_norm(s32: Tensor, gamma: Tensor, eps: float, dtype, fault: str) -> Tensor:
    """``s32`` normalised as a look-alike of the fused ops would: LayerNorm (the mean taken out),
    over the whole row (every dimension but the first; for 2-D rows the whole batch) instead of
    gamma's span, or with :data:`WRONG_EPS`."""
    g = gamma.to(torch.float32)
    dims = tuple(range(-gamma.dim(), 0))
    if fault == "layernorm":
        centred = s32 - s32.mean(dims, keepdim=True)
        return (centred * torch.rsqrt(centred.pow(2).mean(dims, keepdim=True) + eps) * g).to(dtype)
    if fault == "whole-row":
        wide = tuple(range(1, s32.dim())) if s32.dim() > 2 else tuple(range(s32.dim()))
        return (s32 * torch.rsqrt(s32.pow(2).mean(wide, keepdim=True) + eps) * g).to(dtype)
    return _normalise(s32, gamma, WRONG_EPS, dtype)[0]


def faulty(op: str, fault: str):
    """torch-npu's ``op`` (``"npu_rms_norm"`` or ``"npu_add_rms_norm"``) stood in for with ``fault``:

    * ``arity``: ``npu_rms_norm`` returns ``y`` alone, ``npu_add_rms_norm`` ``(y, x_sum)``;
    * ``shape``: ``y`` (rms_norm) or ``x_sum`` (add_rms_norm) gains a leading dimension of one,
      which broadcasts silently into whatever adds it;
    * ``values``: rms_norm leaves ``gamma`` out of ``y``; add_rms_norm returns ``x1`` as ``x_sum``
      (the residual never added);
    * ``raises``: every call raises ``RuntimeError``, as an op refusing a dtype does;
    * ``layernorm``, ``whole-row``, ``epsilon``: ``y`` from another norm (:func:`_other_norm`):
      the mean taken out, the whole row normalised instead of each head, or another eps.
    """
    if fault not in FAULTS:
        raise ValueError(f"unknown fault {fault!r}; known: {FAULTS}")

    def refuse(x):
        raise RuntimeError(f"{op} (stand-in): {x.dtype} is not supported")

    def rms_norm(x, gamma, epsilon=1e-6):
        if fault == "raises":
            refuse(x)
        y, rstd = fused_rms_norm(x, gamma, epsilon)
        if fault == "arity":
            return y
        if fault == "shape":
            return y.unsqueeze(0), rstd
        if fault in CONTRACT_FAULTS:
            return _other_norm(x.to(torch.float32), gamma, epsilon, x.dtype, fault), rstd
        return fused_rms_norm(x, torch.ones_like(gamma), epsilon)[0], rstd

    def add_rms_norm(x1, x2, gamma, epsilon=1e-6):
        if fault == "raises":
            refuse(x1)
        y, rstd, x_sum = fused_add_rms_norm(x1, x2, gamma, epsilon)
        if fault == "arity":
            return y, x_sum
        if fault == "shape":
            return y, rstd, x_sum.unsqueeze(0)
        if fault in CONTRACT_FAULTS:
            s32 = x1.to(torch.float32) + x2.to(torch.float32)
            return _other_norm(s32, gamma, epsilon, x1.dtype, fault), rstd, x_sum
        return y, rstd, x1.clone()

    if op == "npu_rms_norm":
        return rms_norm
    if op == "npu_add_rms_norm":
        return add_rms_norm
    raise ValueError(f"unknown op {op!r}")

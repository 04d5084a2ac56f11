"""Sigmoid output gating: the eager counterpart of ``fish_omni.kernels.sigmoid_gate``."""

from __future__ import annotations

import torch

from .norms import into

__all__ = ["sigmoid_gate"]


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(gate)`` evaluated in float32, rounded once to ``x.dtype``.

    ``gate`` has ``x``'s number of elements (the published kernel pairs them
    element by element in memory order; here in logical order, the same for
    the contiguous tensors it is given).  A new tensor shaped like ``x``.
    """
    # One float32 buffer of our own; the product promotes x's elements to float32 on the fly
    # and is rounded once, straight into the result.
    s = gate.reshape(x.shape).to(torch.float32, copy=True).sigmoid_()
    if x.dtype == torch.float32:
        return s.mul_(x)
    return into(torch.empty(x.shape, dtype=x.dtype, device=x.device), torch.mul, s, x)

"""Sigmoid output gating: the eager counterpart of ``fish_omni.kernels.sigmoid_gate``."""

from __future__ import annotations

import torch

__all__ = ["sigmoid_gate"]


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(gate)`` evaluated in float32, rounded once to ``x.dtype``.

    ``gate`` has ``x``'s number of elements (the published kernel pairs them
    element by element in memory order; here in logical order, the same for
    the contiguous tensors it is given).  A new tensor shaped like ``x``.
    """
    # One float32 buffer of our own; mul_ promotes x's elements to float32 on the fly.
    out = gate.reshape(x.shape).to(torch.float32, copy=True)
    return out.sigmoid_().mul_(x).to(x.dtype)
